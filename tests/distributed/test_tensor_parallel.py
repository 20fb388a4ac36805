"""Tensor parallelism (``tensor_parallel_size``): a tiny randomly initialised Llama (4 heads, 2 KV heads) written by
``transformers``, split over 2 processes, gives the same greedy tokens as the whole model in one process and logits
within 1e-4; a killed worker ends the engine with an error naming its rank; sizes that do not divide are refused at
start-up. The Qwen2 split (Q/K/V biases cut like their weights) and GGUF block slicing are checked in-process."""

import os
import signal
import threading

import numpy as np
import pytest
import torch

from kvserve import SamplingParams
from kvserve.core.sched_output import ScheduledRequest, SchedulerOutput
from kvserve.distributed.worker import forward_plan
from kvserve.engine.llm_engine import LLMEngine
from kvserve.layers.linear import shard_cols, shard_rows
from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model

VOCAB = 256
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2)
PROMPTS = [[1, 17, 99, 3, 250, 64, 8, 8, 120, 77, 5], [1, 200, 201, 202] * 6, [1, 42]]
ENGINE = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, distributed_timeout_seconds=60.0)


def _write_tiny(path, config_cls, model_cls, bias: bool = False):
    """A random tiny model + a word-level tokenizer (``t0 .. t255``) saved as a Hugging Face directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY)).eval()
    with torch.no_grad():  # larger weights than the default init: well separated logits, random biases
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.5 if name.endswith("bias") else 0.15)
    model.save_pretrained(str(path), safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(
        str(path))
    return str(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _write_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """The whole model in this process (T=1) and the model split over this process + one worker (T=2)."""
    one = LLMEngine.from_engine_args(model=tiny_llama, **ENGINE)
    two = LLMEngine.from_engine_args(model=tiny_llama, tensor_parallel_size=2, **ENGINE)
    yield one, two
    two.shutdown()
    assert all(p.exitcode is not None for p in two.model_runner.procs)


def _plan(block_base: int) -> SchedulerOutput:
    """Every prompt's full prefill into blocks from ``block_base`` on, sampling each prompt's last row."""
    scheduled, base = [], block_base
    for i, ids in enumerate(PROMPTS):
        n = -(-len(ids) // ENGINE["block_size"])
        scheduled.append(ScheduledRequest(str(i), ids, 0, list(range(base, base + n)), samples=True))
        base += n
    return SchedulerOutput(scheduled)


def _generate(engine, prompts, max_tokens=6) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=max_tokens)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    engine.kv_cache_manager.check_integrity()
    return [list(done[i]) for i in ids]


def test_logits_match_single_process(engines):
    one, two = engines
    plan = _plan(block_base=40)  # blocks no request holds (the pool is idle)
    ref = forward_plan(one.model, one.model_runner.kv_cache, plan, one.block_size)
    got = two.model_runner.compute_logits(plan)
    assert got.shape == ref.shape == (len(PROMPTS), VOCAB)
    assert torch.allclose(got, ref, rtol=0, atol=1e-4), (got - ref).abs().max()
    assert two.model.num_kv_heads == 1 and two.model_runner.runner.kv_cache.shape[-2] == 1  # half the KV pool


def test_greedy_tokens_match_single_process(engines):
    one, two = engines
    prompts = PROMPTS + [PROMPTS[1]]  # the repeat is a prefix-cache hit: the same block ids on both ranks
    expected = _generate(one, prompts)
    assert _generate(two, prompts) == expected
    assert len({tuple(t) for t in expected}) > 1 and all(len(t) == 6 for t in expected)
    assert two.kv_cache_manager.prefix_cache_hits > 0


def test_prompt_logprobs_match_single_process(engines):
    """Prompt logprobs add scored prefill rows to the logits on every rank (the same step batch), so T=2 scores
    the prompt like T=1."""
    def score(engine):
        rid = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished and o.request_id == rid:
                    return o.prompt_logprobs
    ref, got = score(engines[0]), score(engines[1])
    assert got[0] is None and len(got) == len(ref) == len(PROMPTS[2])
    for r, g in zip(ref[1:], got[1:]):
        assert r.keys() == g.keys() and all(abs(r[t] - g[t]) < 1e-4 for t in r)


@pytest.mark.parametrize("tp, field", [(3, "num_attention_heads=4"), (4, "num_key_value_heads=2")])
def test_size_that_does_not_divide_is_refused(tiny_llama, tp, field):
    with pytest.raises(ValueError, match=f"tensor_parallel_size={tp} must divide the model's {field}"):
        LLMEngine.from_engine_args(model=tiny_llama, tensor_parallel_size=tp, **ENGINE)


@pytest.mark.parametrize("args, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer in"),
    (dict(distributed_timeout_seconds=0), "distributed_timeout_seconds must be in"),
    (dict(tensor_parallel_size=2, speculative_config={"method": "draft_model"}), "not supported with tensor_para"),
])
def test_bad_arguments(args, match):
    from kvserve.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**args)


class _ThreadGroup:
    """The ``ParallelGroup`` collectives for ranks run as threads of this process (sharding checks without
    processes): every rank deposits its tensor, waits for the others, then reads the sum / concatenation."""

    def __init__(self, world_size: int):
        self.world_size, self.slots = world_size, [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=60)  # a failing rank breaks it: no hang

    def rank_view(self, rank: int):
        group = self

        class View:
            world_size = group.world_size

            def all_reduce(self, x):
                return group._exchange(rank, x, lambda xs: torch.stack(xs).sum(0))

            def gather(self, x, dim):
                out = group._exchange(rank, x, lambda xs: torch.cat(xs, dim=dim))
                return out if rank == 0 else x

        view = View()
        view.rank = rank
        return view

    def _exchange(self, rank, x, combine):
        self.slots[rank] = x
        self.barrier.wait()
        out = combine(list(self.slots))
        self.barrier.wait()
        return out


def test_qwen2_biases_split_with_their_weights(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    loaded = load_model(_write_tiny(tmp_path, Qwen2Config, Qwen2ForCausalLM))
    ref_model = build_model(loaded, select_backends("cpu", torch.float32, "fp32"))
    plan = _plan(block_base=0)
    ref = forward_plan(ref_model, torch.zeros(ref_model.kv_cache_shape(16, 4)), plan, 4)
    group, results = _ThreadGroup(2), {}

    def rank(r):
        model = build_model(loaded, select_backends("cpu", torch.float32, "fp32", parallel=group.rank_view(r)))
        results[r] = forward_plan(model, torch.zeros(model.kv_cache_shape(16, 4)), plan, 4)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0].shape == ref.shape and results[1].shape == (len(PROMPTS), VOCAB // 2)
    assert torch.allclose(results[0], ref, rtol=0, atol=1e-4)


def test_gguf_blocks_split_exactly():
    """Rows and whole-block column slices of a Q4_1 tensor decode to slices of the tensor; a slice that would cut
    a block is refused."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from kvserve.quant.gguf_io import QuantTensor

    w = np.random.default_rng(0).standard_normal((6, 192)).astype(np.float32)
    t = QuantTensor("w", Q.Q4_1, gguf.quants.quantize(w, Q.Q4_1), (6, 192))  # 6 blocks of 32 per row
    full = t.dequantize()
    for r in range(3):
        assert np.array_equal(shard_cols(t, r, 3).dequantize(), full[:, r * 64:(r + 1) * 64])
        assert np.array_equal(shard_rows(t, r, 3).dequantize(), full[r * 2:(r + 1) * 2])
    with pytest.raises(ValueError, match="Q4_1 blocks of 32 values cannot be split"):
        shard_cols(t, 0, 4)  # 192 / 4 = 48 columns: not whole blocks
    with pytest.raises(ValueError, match="w rows: 6 is not divisible by tensor_parallel_size=4"):
        shard_rows(t, 0, 4, "w")


def test_killed_worker_ends_the_engine_with_an_error(engines):
    """Last in this module: it leaves the T=2 engine failed."""
    _, two = engines
    rid = two.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=20))
    two.step()
    worker = two.model_runner.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"worker rank 1 \(pid {worker.pid}\) died: it exited with code -9"):
        while two.has_unfinished_requests():
            two.step()
    with pytest.raises(RuntimeError, match="worker rank 1"):  # failed for good, at once
        two.step()
    two.abort_request(rid)


def test_new_engine_after_failure_and_garbage_collection_stops_workers(engines, tiny_llama):
    """After the failed engine's shutdown a new tensor-parallel engine starts in this process (a fresh group), and
    dropping the last reference stops its worker."""
    import gc

    one, two = engines
    two.shutdown()
    three = LLMEngine.from_engine_args(model=tiny_llama, tensor_parallel_size=2, **ENGINE)
    assert _generate(three, PROMPTS[:1]) == _generate(one, PROMPTS[:1])
    worker = three.model_runner.procs[0]
    del three
    gc.collect()
    assert worker.exitcode == 0
