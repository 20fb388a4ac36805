"""Builds the prefix cache's disk tier of an engine: the fingerprint of its K/V bits and the store's budget.

The fingerprint (docs/design.md, "KV tiers") is a sha256 over a JSON of everything that changes the bits of a
block's K/V in this engine, so that an entry is only ever read back by an engine that would have computed the same
bits:

- ``model``: the SHA-256 of the model file (``weight_cache.source_sha256``, memoised under
  ``~/.cache/kvserve/hashes``), or of a directory's ``config.json`` and weight files;
- ``quantization``, ``dtype`` (activations), the quantized matmuls' instruction set and activation precision, the
  attention backend and its instruction set, whether the C kernels and the fused layer loop run;
- ``kv_cache_dtype``, ``block_size``, the shape and dtype of every tensor slice of a block (the model runner's
  ``block_slices``), the model's architecture (layers, heads, head_dim, rope, ...);
- ``code``: a hash of the sources that compute K/V (``kvserve/model``, ``layers``, ``quant``, ``kernels``,
  ``attention``, ``batch.py``), and ``KV_TIER_VERSION``: a new kvserve version never reads an old one's entries
  (they age out under the budget).

Batch invariance (docs/design.md, "Invariants") is what makes this enough: a block's K/V does not depend on the
batch, the chunking or the thread count, so equal fingerprints and equal chained token ids mean equal bits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
from pathlib import Path

from kvserve.config import DEFAULT_KV_DISK_CACHE_FREE_FRACTION, DEFAULT_KV_DISK_CACHE_MAX_BYTES, CacheConfig
from kvserve.core.kv_disk_store import DiskBlockStore
from kvserve.core.kv_disk_tier import KVDiskTier
from kvserve.model.weight_cache import source_sha256

logger = logging.getLogger(__name__)

#: Bump when the meaning of an entry's payload changes in a way the hashed sources do not show.
KV_TIER_VERSION = 1
_PKG = Path(__file__).resolve().parents[1]
_KV_SOURCES = ("model", "layers", "quant", "kernels", "attention", "batch.py")


@functools.lru_cache(maxsize=None)
def kv_code_version() -> str:
    """16 hex digits: a hash of the sources that compute K/V (module docstring)."""
    h = hashlib.sha256(f"kvtier{KV_TIER_VERSION}".encode())
    for name in _KV_SOURCES:
        root = _PKG / name
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h"))
        for p in paths:
            h.update(str(p.relative_to(_PKG)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def model_sha256(path) -> str:
    """The SHA-256 (hex) of a model file, or of a directory's ``config.json`` and weight files (hashed in name
    order)."""
    path = Path(path)
    if path.is_file():
        return source_sha256(path)
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.name == "config.json" or p.suffix in (".safetensors", ".gguf", ".bin"):
            h.update(p.name.encode())
            h.update(source_sha256(p).encode())
    return h.hexdigest()


def kv_fingerprint(engine) -> tuple[bytes, dict]:
    """The fingerprint (32 bytes) of ``engine``'s K/V bits and the facts it hashes (module docstring)."""
    backends, runner = engine.backends, engine.model_runner
    attn = engine.model.attn
    facts = {
        "version": KV_TIER_VERSION,
        "code": kv_code_version(),
        "model": model_sha256(engine.model_path),
        "quantization": backends.quantization,
        "dtype": engine.config.model_config.dtype,
        "quant_isa": backends.quant_path.isa,
        "quant_activations": backends.quant_path.activations,
        "attention": [type(attn).__name__, getattr(attn, "isa", None)],
        "cpu_kernels": backends.use_kernels,
        "fused_layers": backends.fused_layers,
        "kv_cache_dtype": str(engine.kv_cache_dtype),
        "block_size": engine.block_size,
        "block_slices": [[list(t.shape), str(t.dtype)] for t in runner.block_slices(0)],
        "arch": repr(engine.arch),
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).digest()
    return digest, facts


def default_budget(directory: Path) -> int:
    """``CacheConfig.kv_disk_cache_bytes``' default for ``directory``: ``DEFAULT_KV_DISK_CACHE_FREE_FRACTION`` of
    its file system's free space, at most ``DEFAULT_KV_DISK_CACHE_MAX_BYTES``."""
    free = shutil.disk_usage(directory).free
    return max(1, min(int(free * DEFAULT_KV_DISK_CACHE_FREE_FRACTION), DEFAULT_KV_DISK_CACHE_MAX_BYTES))


def make_kv_tier(engine, cache_config: CacheConfig) -> KVDiskTier:
    """The disk tier of ``engine`` in ``cache_config.kv_disk_cache_dir``.

    Raises:
        ValueError: the directory cannot be created or written.
    """
    root = Path(cache_config.kv_disk_cache_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"kv_disk_cache_dir {str(root)!r} cannot be used: {e}") from e
    budget = cache_config.kv_disk_cache_bytes or default_budget(root)
    fingerprint, facts = kv_fingerprint(engine)
    store = DiskBlockStore(root, fingerprint, budget)
    tier = KVDiskTier(store, engine.model_runner.block_nbytes)
    logger.info("KV disk tier: %s (budget %.1f GiB, %.1f GiB in use), %d KiB a block, fingerprint %s (%s, %s, "
                "KV %s, block_size %d)", store.dir, budget / 2**30, store.bytes_estimate / 2**30,
                tier.payload_bytes // 1024, fingerprint.hex()[:16], facts["quantization"], facts["quant_isa"],
                facts["kv_cache_dtype"], facts["block_size"])
    return tier
