"""Bad input raises ValueError naming the field; the same engine then serves a normal request, no block leaks."""

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def small_llm():
    # 8 blocks x 16 = 128 slots = max_model_len (a larger max_model_len is refused at start-up:
    # tests/engine/test_startup_check.py)
    return LLM(num_kv_blocks=8, block_size=16, max_model_len=128, max_num_batched_tokens=4096)


def serve_normal(llm):
    out = llm.generate("What is 1 + 1?", SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.finished and len(out.outputs[0].token_ids) >= 1
    assert_pool_clean(llm.llm_engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(seed=-1), "seed"),
        (dict(n=0), "n"),
        (dict(n=17), "n"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_sampling_params_out_of_range(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(small_llm):
    tok = small_llm.get_tokenizer()
    cases = [
        ("", "prompt"),
        ([[]], "prompt"),
        ([10**6], "prompt token ids"),
        (tok.encode("word " * 300)[:129], "max_model_len"),
        (12345, "prompt"),
    ]
    for prompt, field in cases:
        with pytest.raises(ValueError, match=field):
            small_llm.generate(prompt, SamplingParams(max_tokens=4))
        assert_pool_clean(small_llm.llm_engine)
    serve_normal(small_llm)


def test_bad_prompt_in_a_batch_leaves_nothing_queued(small_llm):
    with pytest.raises(ValueError, match="prompt"):
        small_llm.generate(["Hello there", "", "More"], SamplingParams(max_tokens=4))
    assert_pool_clean(small_llm.llm_engine)
    with pytest.raises(ValueError, match="sampling_params"):
        small_llm.generate(["a", "b"], [SamplingParams()])
    serve_normal(small_llm)


def test_prompt_over_token_budget_is_rejected():
    llm = LLM(num_kv_blocks=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        llm.generate(list(range(100, 140)), SamplingParams(max_tokens=2))
    serve_normal(llm)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(model="/nonexistent/model.gguf"), "/nonexistent/model.gguf"),
        (dict(block_size=0), "block_size"),
        (dict(num_kv_blocks=0), "num_kv_blocks"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(scheduling="fifo"), "scheduling"),
        (dict(scheduling_policy="lifo"), "scheduling_policy"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(dtype="float16"), "dtype"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(not_an_arg=1), "not_an_arg"),
    ],
)
def test_bad_engine_args(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(**kwargs)


def test_unsupported_architecture_and_unreadable_files(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(d))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(model=str(bad))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(tmp_path / "empty"))


def test_abort_returns_blocks(llm):
    engine = llm.llm_engine
    rid = engine.add_request("Tell me about the moon.", SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.kv_cache_stats().used_blocks > 0
    engine.abort_request(rid)
    assert_pool_clean(engine)
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("a", request_id="x")
        engine.add_request("b", request_id="x")
    engine.abort_request("x")
    assert_pool_clean(engine)
