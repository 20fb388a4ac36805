"""``LLMEngine``: add requests, step, read outputs. One step reads top to bottom:

    scheduler_output = scheduler.schedule()                    # who computes how many tokens, KV slots allocated
    model_output     = model_runner.execute_model(...)         # one flat batch over the paged cache + sampling
    updated          = scheduler.update_from_output(...)       # append tokens, stop checks, free finished blocks
    outputs          = output processor (text, stop strings)   # RequestOutput objects; a stop string finishes
                                                               # its request (scheduler.finish_requests)
    speculator.step(...)                                       # (speculative decoding) drafts for the next step
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from datetime import timedelta
from typing import Optional, Union

import torch

from kvserve.config import EngineConfig, derive_limits
from kvserve.core.kv_cache_manager import KVCacheManager, blocks_needed
from kvserve.core.scheduler import Scheduler
from kvserve.engine.harmony_render import chat_format_for
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.stats import EngineStats
from kvserve.model.backends import on_int8_kernels, select_backends
from kvserve.model.chat_config import describe_end_tokens, load_chat_template
from kvserve.model.loader import load_model
from kvserve.model.registry import FAMILY_OF, build_model
from kvserve.request import Request, RequestStatus
from kvserve.sample import logits_edits
from kvserve.sample.sampler import Sampler
from kvserve.sample.thinking import ThinkingBudget
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.speculator import Speculator
from kvserve.structured.backend import GrammarBackend
from kvserve.engine.protocol import tokenize_prompt
from kvserve.validation import ParamError
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
_thread = threading.local()  # per thread: the OpenMP thread count this module last set there (LLMEngine.step)

PromptType = Union[str, list]


class LLMEngine:
    """The synchronous engine.

    Args:
        config: ``EngineConfig``. Use ``LLMEngine.from_engine_args(model=..., block_size=..., ...)``.

    Attributes:
        limits: the configuration's values once the model is known (``kvserve.config.EngineLimits``).
        max_model_len: longest sequence (tokens) a request may reach: the configured value or the model's
            context length.
        num_blocks, block_size: the pool geometry.

    Raises:
        ValueError: bad configuration or an unloadable model.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        mc, sc = config.model_config, config.scheduler_config
        if mc.num_threads:
            torch.set_num_threads(mc.num_threads)
        self._num_threads = torch.get_num_threads()  # what every thread that steps this engine must use
        quantization = mc.effective_quantization
        loaded = load_model(mc.model, mc.dtype, keep_quantized=quantization != "fp32")
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.arch = loaded.arch
        pc = config.parallel_config
        tp, tp_group = pc.tensor_parallel_size, None
        if tp > 1:  # before anything starts: the split must divide the model's heads, MLP and vocabulary
            from kvserve.distributed.parallel_state import TensorParallelGroup

            loaded.arch.check_tensor_parallel_size(tp)
            tp_group = TensorParallelGroup(0, tp, timedelta(seconds=pc.distributed_timeout_seconds))
        self.backends = select_backends(mc.device, loaded.weights["model.norm.weight"].dtype, quantization,
                                        config.kernel_config, parallel=tp_group)
        self.model = build_model(loaded, self.backends, mc.max_model_len)
        lim = self.limits = derive_limits(  # the model's dtype is mc.dtype (load_model casts)
            config, loaded.arch.max_position_embeddings,
            lambda kv_dtype: self.model.bytes_per_block(config.cache_config.block_size, getattr(torch, kv_dtype)),
            quantized_weights=on_int8_kernels(self.model.layers[0]["qkv"]))
        kv_dtype_name = lim.kv_cache_dtype
        self.kv_cache_dtype = getattr(torch, kv_dtype_name)
        logger.info("%s: %s", self.arch.architecture,
                    self.backends.describe(self.model.layers[0]["qkv"], self.model.lm_head, self.kv_cache_dtype))
        self.block_size, self.num_blocks, self.pool_tokens = lim.block_size, lim.num_blocks, lim.pool_tokens
        self.max_model_len, self.max_total_tokens = lim.max_model_len, lim.max_total_tokens
        self.eos_token_ids, self.eos_token_id = loaded.eos_token_ids, loaded.eos_token_id
        self.chat_template = load_chat_template(mc.chat_template)  # None: the tokenizer's own
        self.chat_format = chat_format_for(FAMILY_OF[self.arch.architecture].chat_format, self.chat_template)
        logger.info("generation ends on token ids %s unless ignore_eos; chat prompts: %s",
                    describe_end_tokens(self.eos_token_ids, self.tokenizer),
                    "the harmony format (openai-harmony)" if self.chat_format == "harmony" else
                    "--chat-template" if self.chat_template is not None else
                    "the model's chat template" if getattr(self.tokenizer, "chat_template", None) else
                    "no chat template (chat requests are refused; pass --chat-template)")
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); max_model_len %d",
            self.num_blocks, self.block_size, self.pool_tokens,
            self.num_blocks * self.model.bytes_per_block(self.block_size, self.kv_cache_dtype) / 2**20,
            kv_dtype_name, self.max_model_len,
        )
        window = KVCacheManager.shared_window(loaded.arch.layer_window(i)
                                              for i in range(loaded.arch.num_hidden_layers))
        self.kv_cache_manager = KVCacheManager(self.num_blocks, self.block_size,
                                               config.cache_config.enable_prefix_caching, sliding_window=window)
        sampler = Sampler(self.eos_token_ids)
        spec = config.speculative_config
        self.speculator = self._make_speculator(spec, mc, sc, sampler) if spec is not None else None
        if tp > 1:  # rank 0 of the group: ships each plan to the workers, samples on the gathered logits
            from kvserve.distributed.executor import TensorParallelExecutor
            from kvserve.distributed.parallel_state import free_port
            from kvserve.distributed.worker import ShardSpec

            shard_spec = ShardSpec(str(loaded.path), mc.dtype, quantization, mc.device, mc.num_threads,
                                   self.num_blocks, self.block_size, tp, pc.distributed_timeout_seconds, free_port(),
                                   kv_dtype_name, config.kernel_config, mc.max_model_len)
            self.model_runner = TensorParallelExecutor(self.model, sampler, shard_spec, tp_group)
        else:
            self.model_runner = ModelRunner(self.model, self.num_blocks, self.block_size, sampler, device=mc.device,
                                            kv_cache_dtype=self.kv_cache_dtype)
        self.kv_tier = None  # the prefix cache's disk tier (CacheConfig.kv_disk_cache_dir)
        if config.cache_config.kv_disk_cache_dir is not None:
            from kvserve.engine.kv_tier_setup import make_kv_tier

            self.kv_tier = make_kv_tier(self, config.cache_config)
            self.kv_cache_manager.newly_cached = []
        self.scheduler = Scheduler(sc, self.kv_cache_manager, self.eos_token_ids, self.eos_token_id, self.kv_tier)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_backend = GrammarBackend(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        self.stats = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (a no-op without tensor parallelism; also done when the
        engine is garbage collected or the interpreter exits) and finish the disk tier's queued writes."""
        if self.kv_tier is not None:
            self.kv_tier.close()
        stop = getattr(self.model_runner, "shutdown", None)
        if stop is not None:
            stop()

    def _make_speculator(self, spec, mc, sc, sampler) -> Speculator:
        """The n-gram proposer, or the draft-model proposer with its own model view and KV pool, with the policy.

        Raises:
            ValueError: ``draft_num_layers`` out of range, or a draft model whose vocabulary differs from the
                target's (the message names both paths and sizes).
        """
        from kvserve.spec_decode.policy import SpecPolicy

        if spec.method == "ngram":
            from kvserve.spec_decode.ngram import NgramProposer

            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)
        else:
            proposer = self._make_draft_proposer(spec, mc, sc, sampler)
        policy = SpecPolicy(spec.num_speculative_tokens, proposer.initial_k, proposer.free, proposer.cost)
        return Speculator(proposer, policy)

    def _make_draft_proposer(self, spec, mc, sc, sampler):
        from kvserve.config import DEFAULT_DRAFT_NUM_LAYERS
        from kvserve.spec_decode.draft_model import (DraftModelProposer, draft_pool_blocks, early_exit_model,
                                                     relative_cost)

        if spec.model is None:
            layers = spec.draft_num_layers
            if layers is None:
                layers = min(DEFAULT_DRAFT_NUM_LAYERS, self.arch.num_hidden_layers - 1)
            draft = early_exit_model(self.model, layers)
        else:
            loaded = load_model(spec.model, mc.dtype, keep_quantized=self.backends.quantization != "fp32")
            if loaded.arch.vocab_size != self.arch.vocab_size or (
                loaded.tokenizer.get_vocab() != self.tokenizer.get_vocab()
            ):
                raise ValueError(
                    f"speculative_config.model {str(loaded.path)!r} has a different vocabulary "
                    f"(vocab_size {loaded.arch.vocab_size}) from the target {str(self.model_path)!r} "
                    f"(vocab_size {self.arch.vocab_size}); a draft model must share the target's tokenizer"
                )
            draft = build_model(loaded, self.backends, mc.max_model_len)
        num_blocks = draft_pool_blocks(self.num_blocks, sc.max_num_seqs, spec.num_speculative_tokens, self.block_size)
        cost = relative_cost(draft, self.model)
        logger.info("draft model: %d layers, %.2f of the target's cost per token; draft KV pool %d blocks",
                    draft.arch.num_hidden_layers, cost, num_blocks)
        return DraftModelProposer(draft, num_blocks, self.block_size, sampler, cost=cost,
                                  kv_cache_dtype=self.kv_cache_dtype)

    @classmethod
    def from_engine_args(cls, **engine_args) -> "LLMEngine":
        """Build from flat arguments (``model``, ``dtype``, ``max_model_len``, ``block_size``, ``num_kv_blocks``,
        ``kv_cache_memory_bytes``, ``kv_cache_dtype``, ``max_num_seqs``, ``max_num_batched_tokens``,
        ``enable_chunked_prefill``, ``enable_prefix_caching``, ``scheduling``, ``scheduling_policy``,
        ``num_threads``, ...: every ``EngineConfig`` field)."""
        return cls(EngineConfig.from_kwargs(**engine_args))

    # ------------------------------------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list:
        """Token ids of a text prompt (the tokenizer's own special-token rule, e.g. a BOS, unless
        ``add_special_tokens`` is false: a chat template's text carries its own), or validated ids as given.

        Raises:
            ParamError: (``prompt``) empty prompt, text that is not valid Unicode (a lone surrogate), wrong type, or
                ids outside ``[0, vocab_size)``.
        """
        return tokenize_prompt(self.tokenizer, self.arch.vocab_size, prompt, add_special_tokens)

    def add_request(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        arrival_time: Optional[float] = None,
        priority: int = 0,
        add_special_tokens: bool = True,
    ) -> str:
        """Validate and queue a request; returns its id. A text prompt is tokenized by ``tokenize`` (with
        ``add_special_tokens``).

        Raises:
            ParamError: (naming the field) empty or invalid prompt; prompt longer than ``max_model_len``; prompt
                needing more KV blocks than the whole pool; without chunked prefill, prompt longer than
                ``max_num_batched_tokens``; a duplicate ``request_id``; a non-integer ``priority``;
                ``structured_outputs`` the grammar backend cannot compile; a ``logit_bias`` / ``allowed_token_ids``
                id outside the vocabulary, or those edits with speculative decoding (``_logits_edits``). Nothing is
                queued or allocated then.
        """
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ParamError.of("sampling_params", f" must be a SamplingParams, got {type(sp).__name__}")
        bad_stop = [t for t in sp.stop_token_ids if t >= self.arch.vocab_size]
        if bad_stop:
            raise ParamError.of("stop_token_ids", f" must be in [0, {self.arch.vocab_size}), got {bad_stop[:5]}")
        ids = self.tokenize(prompt, add_special_tokens)
        n = len(ids)
        if n > self.max_model_len:
            raise ParamError.of("prompt", f" has {n} tokens, more than max_model_len={self.max_model_len}")
        if blocks_needed(n, self.block_size) > self.num_blocks:
            raise ParamError.of("prompt", f" has {n} tokens and needs {blocks_needed(n, self.block_size)} KV blocks, "
                                          f"but the pool has only num_kv_blocks={self.num_blocks} "
                                          f"(block_size={self.block_size})")
        sc = self.config.scheduler_config
        if not sc.enable_chunked_prefill and n > sc.max_num_batched_tokens:
            raise ParamError.of("prompt", f" has {n} tokens, more than max_num_batched_tokens="
                                          f"{sc.max_num_batched_tokens} (enable chunked prefill to run longer prompts)")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ParamError.of("priority", f" must be an integer, got {priority!r}")
        grammar = None if sp.structured_outputs is None else self.grammar_backend.compile(sp.structured_outputs)
        edits = self._logits_edits(sp, ids)
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self.output_processor.groups:
            raise ParamError.of("request_id", f" {rid!r} is already in use")
        if sp.n > self.config.scheduler_config.max_num_seqs:
            raise ParamError("n", f"n={sp.n} exceeds max_num_seqs={self.config.scheduler_config.max_num_seqs}")
        samples = [
            Request(
                rid if i == 0 else f"{rid}#{i}",
                ids,
                sp if i == 0 or sp.seed is None else dataclasses.replace(sp, seed=sp.seed + i),
                max_total_tokens=self.max_total_tokens,
                prompt=prompt if isinstance(prompt, str) else None,
                arrival_time=arrival_time,
                priority=priority,
            )
            for i in range(sp.n)
        ]
        if grammar is not None:  # one matcher per sample
            for s in samples:
                s.grammar = self.grammar_backend.new_state(grammar)
        if edits is not None:  # one thinking budget per sample
            bad_words, make_thinking = edits
            for s in samples:
                s.sampling_state.bad_words_token_ids = bad_words
                s.sampling_state.thinking = make_thinking()
        if sp.n > 1:
            for i, s in enumerate(samples):
                s.parent_id, s.sample_index = rid, i
            samples[0].fork_children = samples[1:]
        self.scheduler.add_request(samples[0])
        self.output_processor.add_request(samples)
        self.stats.prompt_tokens += n
        return rid

    def _logits_edits(self, sp: SamplingParams, prompt_ids: list[int]):
        """What a request's ``logit_bias`` / ``allowed_token_ids`` / ``bad_words`` / ``thinking_token_budget`` need
        (``kvserve.sample.logits_edits``): ``(bad words as token ids, a maker of one ThinkingBudget per sample)``,
        or ``None`` when it sets none of them.

        Raises:
            ParamError: a token id outside the vocabulary, or any of them with speculative decoding (the
                verifier samples without these edits), naming the field.
        """
        if not sp.edits_logits:
            return None
        if self.speculator is not None:
            name = next(n for n in ("logit_bias", "allowed_token_ids", "bad_words", "thinking_token_budget")
                        if getattr(sp, n))
            raise ParamError.of(name, " is not supported with speculative decoding")
        logits_edits.check_token_ids(sp, self.arch.vocab_size)
        bad_words = logits_edits.bad_words_token_ids(sp.bad_words or [], self.tokenizer)

        def make_thinking() -> Optional[ThinkingBudget]:
            if sp.thinking_token_budget is None:
                return None
            start, end = (self.tokenizer.encode(m, add_special_tokens=False) for m in sp.reasoning_markers)
            is_open = sp.reasoning_open if sp.reasoning_open is not None else logits_edits.reasoning_open_in_prompt(
                prompt_ids, sp.reasoning_markers, self.tokenizer)
            return ThinkingBudget(sp.thinking_token_budget, start, end, is_open)

        return bad_words, make_thinking

    def abort_request(self, request_ids) -> None:
        """Abort requests (a str or an iterable of str); their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            samples = self.output_processor.groups.get(rid, ())
            self.scheduler.finish_requests([s.request_id for s in samples], RequestStatus.FINISHED_ABORTED)
            self.output_processor.remove(rid)
            if self.speculator is not None:
                self.speculator.abort([s.request_id for s in samples], self.scheduler.running)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------------------------------------ step
    def step(self) -> list:
        """Run one iteration; returns a ``RequestOutput`` for every request that received a token.

        Any thread may call it (one at a time). OpenMP keeps its thread count per thread, and a thread that has not
        run a PyTorch op yet starts with OpenMP's default (all cores), which the kernels would use; so the engine's
        count (``num_threads``, else PyTorch's) is set on the first step on each thread, and again whenever
        PyTorch's count has changed since (another engine built with another count, or user code)."""
        if getattr(_thread, "num_threads", None) != self._num_threads or torch.get_num_threads() != self._num_threads:
            torch.set_num_threads(self._num_threads)
            _thread.num_threads = self._num_threads
        scheduler_output = self.scheduler.schedule()
        model_output = self.model_runner.execute_model(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.kv_tier is not None:
            self._save_to_kv_tier()
        for req in updated:
            if self.output_processor.update_text(req) is not None:
                # a stop string: the request finishes as stopped through the scheduler's one finish path (vLLM
                # aborts it); its outputs end at the token that completed the string (OutputProcessor)
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        outputs = self.output_processor.make_outputs(updated)
        if self.speculator is not None:
            drafts = self.speculator.step(scheduler_output, model_output, updated, self.scheduler.running)
            self.scheduler.update_draft_token_ids(drafts)
        if scheduler_output.scheduled:
            self.stats.num_preemptions = self.scheduler.num_preemptions
            self.stats.prefix_cache_queries = self.kv_cache_manager.prefix_cache_queries
            self.stats.prefix_cache_hits = self.kv_cache_manager.prefix_cache_hits
            if self.speculator is not None:
                self.stats.spec_decode = self.speculator.stats
            if self.kv_tier is not None:
                self.stats.kv_tier = self.kv_tier.stats
            self.stats.generation_tokens += sum(len(c.delta_token_ids) for o in outputs for c in o.outputs)
            self.stats.record_step(
                len(scheduler_output.scheduled),
                scheduler_output.total_num_scheduled_tokens,
                self.kv_cache_manager.stats(self.scheduler.running),
            )
        return outputs

    def _save_to_kv_tier(self) -> None:
        """Hand the blocks that became cached this step to the disk tier: copies taken now (before the next
        ``schedule`` may reuse a freed block), written by its worker threads."""
        for block_id, block_hash in self.kv_cache_manager.take_newly_cached():
            if self.kv_tier.wants(block_hash):
                self.kv_tier.save(block_hash, self.model_runner.copy_block_out(block_id))

    def reset_stats(self) -> None:
        """Start a fresh ``EngineStats`` (e.g. after a warm-up request)."""
        self.stats = EngineStats(num_blocks=self.num_blocks, block_size=self.block_size)
        self.scheduler.num_preemptions = 0
        if self.kv_tier is not None:
            self.kv_tier.stats = type(self.kv_tier.stats)()
        if self.speculator is not None:
            self.speculator.stats = type(self.speculator.stats)(self.speculator.policy.max_k)
        self.kv_cache_manager.prefix_cache_queries = self.kv_cache_manager.prefix_cache_hits = 0

    def kv_cache_stats(self):
        """Current ``KVCacheStats`` of the pool."""
        return self.kv_cache_manager.stats(self.scheduler.running)
