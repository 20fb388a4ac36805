"""On-disk cache of packed quantized weights, so a second start-up skips decoding and repacking the GGUF blocks.

One file per (model file content, quantization, code version) in ``<cache root>/weights/`` (the cache root is the
kernels' folder: ``$KVSERVE_CACHE_DIR``, default ``~/.cache/kvserve``):
``<sha256 of the model file, 16 hex>-<quantization>-<code version, 16 hex>.kvpack``.

Keys:

- **Model file content**: the SHA-256 of the whole file (``source_sha256``), memoised in
  ``<root>/hashes/<path hash>.json`` by ``(device, inode, size, mtime_ns, ctime_ns)``. ``ctime`` is set by the kernel
  on every write, rename or ``utime`` and cannot be set from user space, so an edited file never matches an old
  memo, even when its size and mtime are restored; a hash of only the header would miss re-quantized data with
  the same layout. The first hash reads the file once (fast next to the packing it guards).
- **Quantization**: ``"auto"`` or ``"int8"`` (``"fp32"`` keeps no packed weights).
- **Code version** (``code_version``): ``PACK_VERSION`` plus a hash of the sources that define the packed layout
  and how it is made (``quant/pack.py``, ``formats.py``, ``layouts.py``, ``traits.py``, ``layers/quant_linear.py``,
  ``csrc/qgemm*.{c,h}``): a change
  to any of them makes a new entry (and the old one of that model and quantization is deleted).

The GGUF metadata cache (``read_gguf_cached``) lives in the same root: ``<root>/gguf-meta/<sha256 of the model
file, 16 hex>-m<METADATA_VERSION>.json`` holds ``quant.gguf_io.gguf_metadata`` (the scalar metadata fields and the
tensor table), the full content hash and a SHA-256 of the body, written the same atomic way. A first run reads the
file with ``gguf.GGUFReader`` (slow: a numpy view per vocabulary item; logged as a one-off) and writes the entry;
later runs read the JSON and memory-map the file. An entry that is unreadable, of another version or model, fails
its checksum, or whose tensor table does not fit the file is rebuilt, never used.

File layout of a ``.kvpack``: the payload (each array at a 64-byte aligned offset), the JSON header (format, keys,
and per fused projection the packed parts: kind, format, shapes, payload offsets), then a trailer: ``b"KVSPACK2"``,
``uint64`` payload bytes, ``uint64`` header bytes, ``uint32`` CRC-32 of payload and header. The header comes last so
that a first run streams the entry: each projection's packed arrays are appended to a temporary file as soon as the
projection is built and the layer then computes from those bytes, memory-mapped (``_EntryWriter``), so no second,
anonymous copy of the packed weights exists even while packing, and the GGUF pages each projection was packed from
leave the resident set at once (``QuantTensor.release``); the finished file is ``os.replace``-d into place (readers
see nothing or the whole file). Read with ``numpy.memmap`` (copy-on-write mapping: the weights are the file's
pages, never copied); before use the size, the trailer, the header's keys and the CRC are checked, and anything
wrong (truncated, flipped bytes, another version or model) means the entry is rebuilt, never used.

``WeightCache.build_model`` is called by ``registry.build_model``: it gives the model a ``make_linear`` that serves
each projection (named by its GGUF tensors) from the entry, or builds it with the backends' own and writes the
entry after the model is built.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import logging
import os
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from kvserve.kernels.build import cache_root
from kvserve.kernels.qgemm import QuantPath, default_path
from kvserve.quant import pack as P
from kvserve.quant.gguf_io import (METADATA_VERSION, QuantTensor, check_gguf_magic, gguf_metadata, gguf_tensors,
                                        open_gguf)
from kvserve.layers.quant_linear import ConcatLinear, QuantLinear, describe_weight_formats, weight_formats

logger = logging.getLogger(__name__)

#: Bump when the entry format or the meaning of its fields changes (source changes are hashed anyway).
PACK_VERSION = 5  # 2: Q6_K kept in its own packed format (FMT_Q6); 3: Q4_K as stored (FMT_Q4K); 4: header at the end;
# 5: Q2_K as stored (FMT_Q2K), Q3_K in its own layout (FMT_Q3K)
_MAGIC = b"KVSPACK2"
_TRAILER = struct.Struct("<8sQQI")  # magic, payload bytes, header bytes, CRC-32 of payload and header
_ALIGN = 64
_PKG = Path(__file__).resolve().parents[1]
_VERSIONED_SOURCES = [_PKG / "quant" / n for n in ("pack.py", "formats.py", "layouts.py", "traits.py")] + \
    [_PKG / "layers" / "quant_linear.py"] + \
    [_PKG / "kernels" / "csrc" / n for n in ("qgemm.c", "qgemm_amx.h", "qgemm_layouts.h", "qgemm_mx4.h", "qgemm_q2k.h")]


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """16 hex digits: ``PACK_VERSION`` and the packing sources' bytes, hashed."""
    h = hashlib.sha256(f"kvpack{PACK_VERSION}".encode())
    for p in _VERSIONED_SOURCES:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def atomic_write(path: Path, chunks) -> None:
    """Write ``chunks`` (bytes-like) to ``path`` through a temporary file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def source_sha256(path: Path, root: Optional[Path] = None) -> str:
    """SHA-256 (hex) of a file's content, memoised by ``(device, inode, size, mtime_ns, ctime_ns)`` in
    ``<root>/hashes/`` (see the module docstring for why that identity is safe). A memo that cannot be read or
    written is ignored (the hash is then computed each time)."""
    path = Path(path).resolve()
    st = path.stat()
    ident = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    memo = (root or cache_root()) / "hashes" / (hashlib.sha256(str(path).encode()).hexdigest()[:16] + ".json")
    try:
        saved = json.loads(memo.read_text())
        if saved.get("identity") == ident and len(saved.get("sha256", "")) == 64:
            return saved["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        atomic_write(memo, [json.dumps({"path": str(path), "identity": ident, "sha256": digest}).encode()])
    except OSError as e:
        logger.debug("cannot memoise the hash of %s in %s: %s", path, memo, e)
    return digest


def _names(parts: list) -> Optional[str]:
    """The cache key of a projection: its GGUF tensor names joined by ``|``; ``None`` if a part is not a GGUF
    ``QuantTensor`` (float weights are not cached)."""
    if not all(isinstance(p, QuantTensor) for p in parts):
        return None
    return "|".join(p.name for p in parts)


def _quant_parts(layer) -> Optional[list]:
    """The ``QuantLinear`` parts of a built layer (one, or a ``ConcatLinear``'s), or ``None`` if it has others."""
    parts = layer.parts if isinstance(layer, ConcatLinear) else [layer]
    return parts if all(isinstance(p, QuantLinear) for p in parts) else None


#: Entries of one model and quantization kept across code versions (the newest by use; ``_delete_others``).
KEEP_VERSIONS = 3


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _touch(path: Path) -> None:
    """Mark an entry as just used (its modification time), for ``KEEP_VERSIONS``; a read-only folder is fine."""
    try:
        os.utime(path)
    except OSError:
        pass


class WeightCache:
    """The packed-weight entries of one model file.

    Args:
        source: the ``.gguf`` file.
        source_hash: its ``source_sha256``.
        root: the cache folder (default ``cache_root()``).
    """

    def __init__(self, source: Path, source_hash: str, root: Optional[Path] = None):
        self.source = Path(source)
        self.source_hash = source_hash
        self.root = Path(root) if root is not None else cache_root()

    def entry_path(self, quantization: str) -> Path:
        """Where the entry of ``quantization`` lives (for the current ``code_version``)."""
        return self.root / "weights" / f"{self.source_hash[:16]}-{quantization}-{code_version()}.kvpack"

    def _expected(self, quantization: str) -> dict:
        return {"format": PACK_VERSION, "source_sha256": self.source_hash, "quantization": quantization,
                "code_version": code_version()}

    # ------------------------------------------------------------------------------------------------- build
    def build_model(self, build: Callable, backends):
        """``build(backends)`` with the backends' ``make_linear`` served from the entry of
        ``backends.quantization``; on a miss (absent, corrupt or stale entry) the layers are built as usual and the
        entry is written afterwards. Returns what ``build`` returns."""
        quantization = backends.quantization
        path = self.entry_path(quantization)
        entry = self.read(quantization, backends.quant_path, backends.use_kernels)
        if entry is None:
            logger.info("first run: packing weights into %s (one-off)", path)
        make = backends.make_linear
        runs_as: list = []  # (the file's format, the layer's path) per weight tensor, for the load log
        writer = None
        if entry is None:
            try:
                writer = _EntryWriter(path, backends.quant_path, backends.use_kernels)
            except OSError as e:
                logger.warning("cannot write the packed-weight cache %s: %s", path, e)

        def make_linear(parts: list):
            nonlocal writer
            key = _names(parts)
            if key is not None and entry is not None and key in entry:
                layer = entry[key]
            else:
                layer = make(parts)
                for p in parts:  # its blocks are packed: the file's pages and any reordered copy can go
                    if isinstance(p, QuantTensor):
                        p.release()
                if key is not None and writer is not None:
                    try:  # written at once, and computed from the entry's mapped pages: no second copy
                        layer = writer.add(key, layer)
                    except OSError as e:
                        logger.warning("cannot write the packed-weight cache %s: %s", path, e)
                        writer.abort()
                        writer = None
            runs_as.extend(weight_formats(parts, layer))
            return layer

        try:
            model = build(dataclasses.replace(backends, make_linear=make_linear))
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        if runs_as:
            logger.info("weights: %s", describe_weight_formats(runs_as))
        if writer is not None and not writer.layers:  # nothing quantized to keep
            writer.abort()
        elif writer is not None:
            try:
                writer.finish(self._expected(quantization), self._delete_others)
            except OSError as e:
                logger.warning("cannot write the packed-weight cache %s: %s", path, e)
                writer.abort()
            return_free_heap()
        return model

    def _delete_others(self, path: Path) -> None:
        """Delete the entries of this model and ``path``'s quantization written by other code versions, all but the
        ``KEEP_VERSIONS - 1`` most recently used (modification time, refreshed on each read): two kvserve checkouts
        on one machine keep both their entries instead of repacking at every start."""
        quantization = path.name.split("-")[1]
        others = [p for p in path.parent.glob(f"{self.source_hash[:16]}-{quantization}-*.kvpack") if p != path]
        others.sort(key=_mtime, reverse=True)
        for old in others[KEEP_VERSIONS - 1:]:
            old.unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------------ write
    def write(self, quantization: str, layers: dict) -> Path:
        """Write the entry of ``quantization``: ``layers`` maps a key (``_names``) to a built layer; layers other
        than ``QuantLinear`` / ``ConcatLinear`` of them are skipped. Older entries of this model and
        quantization are deleted. Returns the path.

        Raises:
            OSError: the folder or file cannot be written.
        """
        writer = _EntryWriter(self.entry_path(quantization), map_layers=False)
        try:
            for key, layer in layers.items():
                writer.add(key, layer)
            return writer.finish(self._expected(quantization), self._delete_others)
        except BaseException:
            writer.abort()
            raise

    # ------------------------------------------------------------------------------------------------- read
    def read(self, quantization: str, path: Optional[QuantPath] = None, use_kernels: bool = True) -> Optional[dict]:
        """The entry of ``quantization`` as key -> built layer (``QuantLinear`` or ``ConcatLinear``, computing on
        the kernel ``path``, default ``default_path()``) over memory-mapped packed weights, or ``None`` when it is
        absent, corrupt or stale (logged; it is then rebuilt by ``build_model``)."""
        quant_path = default_path() if path is None else path
        entry = self.entry_path(quantization)
        if not entry.exists():
            return None
        try:
            layers = self._read(entry, quantization, quant_path, use_kernels)
            _touch(entry)
            return layers
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
            logger.warning("packed-weight cache %s unusable (%s); rebuilding it", entry, e)
            return None

    def _read(self, path: Path, quantization: str, quant_path: QuantPath, use_kernels: bool) -> dict:
        mm = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, pages never copied
        if len(mm) < _TRAILER.size:
            raise ValueError("truncated")
        magic, payload_bytes, hlen, crc = _TRAILER.unpack(bytes(mm[len(mm) - _TRAILER.size:]))
        if magic != _MAGIC:
            raise ValueError(f"bad magic {magic!r}")
        if payload_bytes + hlen + _TRAILER.size != len(mm):
            raise ValueError(f"{len(mm)} bytes, expected {payload_bytes + hlen + _TRAILER.size} (truncated)")
        payload = mm[:payload_bytes]
        hbytes = bytes(mm[payload_bytes: payload_bytes + hlen])
        if zlib.crc32(hbytes, zlib.crc32(memoryview(payload))) != crc:  # before anything is parsed
            raise ValueError("checksum mismatch (truncated or corrupt)")
        header = json.loads(hbytes)
        for k, v in self._expected(quantization).items():
            if header.get(k) != v:
                raise ValueError(f"stale: {k} is {header.get(k)!r}, expected {v!r}")
        if header["payload_bytes"] != payload_bytes:
            raise ValueError(f"payload of {payload_bytes} bytes, the header says {header['payload_bytes']}")
        return {key: _layer(specs, lambda spec: _array(payload, spec), quant_path, use_kernels)
                for key, specs in header["layers"].items()}


def _array(payload: np.ndarray, spec: Optional[dict]) -> Optional[torch.Tensor]:
    """The tensor ``spec`` (``{"offset", "dtype", "shape"}`` or ``None``) describes, a view of ``payload``."""
    if spec is None:
        return None
    dt = np.dtype(spec["dtype"])
    n = int(np.prod(spec["shape"], dtype=np.int64))
    return torch.from_numpy(payload[spec["offset"]: spec["offset"] + n * dt.itemsize].view(dt).reshape(spec["shape"]))


def _layer(specs: list, array: Callable, quant_path: QuantPath, use_kernels: bool):
    """A ``QuantLinear`` (one spec) or ``ConcatLinear`` over the arrays ``array(spec)`` gives for each part."""
    parts = [QuantLinear(P.PackedWeight(s["fmt"], array(s["data"]), s["out_features"], s["in_features"],
                                        array(s["oscale"])), s["kind"], in_features=s["layer_in_features"],
                         isa=quant_path.isa, activations=quant_path.activations, use_kernels=use_kernels)
             for s in specs]
    return parts[0] if len(parts) == 1 else ConcatLinear(parts)


class _EntryWriter:
    """Writes a ``.kvpack`` entry one layer at a time: each layer's packed arrays are appended to a temporary file
    in the entry's folder as soon as the layer is built, and (``map_layers``) ``add`` returns the same layer over
    those bytes, memory-mapped, so the freshly packed copy is dropped at once: a first run never holds a second
    copy of the packed weights. ``finish`` appends the header and trailer and renames the file into place (the
    mappings stay valid: the same file). Payload arrays start at 64-byte aligned offsets."""

    def __init__(self, path: Path, quant_path: Optional[QuantPath] = None, use_kernels: bool = True,
                 map_layers: bool = True):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        self.path, self.tmp, self.f = path, Path(tmp), os.fdopen(fd, "wb")
        self.quant_path = default_path() if quant_path is None else quant_path
        self.use_kernels, self.map_layers = use_kernels, map_layers
        self.offset, self.crc, self.layers = 0, 0, {}

    def _append(self, chunk) -> None:
        self.f.write(chunk)
        self.crc = zlib.crc32(chunk, self.crc)
        self.offset += len(chunk)

    def add(self, key: str, layer):
        """Append ``layer``'s packed arrays (a ``QuantLinear`` or a ``ConcatLinear`` of them; anything else is
        returned as it is, unwritten); returns the layer to use: over the written bytes when ``map_layers``."""
        parts = _quant_parts(layer)
        if parts is None:
            return layer
        specs = []
        for q in parts:
            pw = q.packed
            spec = {"kind": q.path.rsplit("/", 1)[0], "fmt": pw.fmt, "out_features": pw.out_features,
                    "in_features": pw.in_features, "layer_in_features": q.in_features}
            for field, t in (("data", pw.data), ("oscale", pw.oscale)):
                if t is None:
                    spec[field] = None
                    continue
                a = np.ascontiguousarray(t.numpy())
                self._append(bytes(-self.offset % _ALIGN))
                spec[field] = {"offset": self.offset, "dtype": a.dtype.str, "shape": list(a.shape)}
                self._append(memoryview(a).cast("B"))
            specs.append(spec)
        self.layers[key] = specs
        if not self.map_layers:
            return layer
        self.f.flush()  # the bytes in the page cache, where the mapping reads them
        return _layer(specs, self._mapped, self.quant_path, self.use_kernels)

    def _mapped(self, spec: Optional[dict]) -> Optional[torch.Tensor]:
        if spec is None:
            return None
        dt = np.dtype(spec["dtype"])
        m = np.memmap(self.tmp, dtype=dt, mode="c", offset=spec["offset"], shape=tuple(spec["shape"]))
        return torch.from_numpy(m)

    def finish(self, expected: dict, delete_others: Callable) -> Path:
        """Append the header (``expected`` keys, the layers, the payload size) and the trailer, rename the file to
        the entry's path, and ``delete_others(path)``. Returns the path."""
        self._append(bytes(-self.offset % _ALIGN))
        payload_bytes = self.offset
        hbytes = json.dumps(dict(expected, layers=self.layers, payload_bytes=payload_bytes), sort_keys=True).encode()
        self._append(hbytes)
        self.f.write(_TRAILER.pack(_MAGIC, payload_bytes, len(hbytes), self.crc))
        self.f.close()
        os.replace(self.tmp, self.path)
        delete_others(self.path)
        return self.path

    def abort(self) -> None:
        """Close and delete the temporary file (layers already mapped keep their pages until dropped)."""
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def return_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim(0)``; a no-op elsewhere).

    A load leaves tens of MB of freed memory inside glibc's heap -- the tokenizer's JSON parse, the metadata, the
    transient copies; on a first run the blocks decoded for packing -- which malloc keeps resident (it returns only
    the heap's top). ``malloc_trim`` releases the free pages in the middle too (``madvise(MADV_DONTNEED)``), so
    generation starts from a lower RSS and the process's peak falls (docs/performance.md, "Start-up and memory").
    Called after a load (``loader``) and after packing (``WeightCache.build_model``); it costs milliseconds and
    frees nothing in use.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


# ------------------------------------------------------------------------------------------- GGUF metadata cache


def gguf_metadata_path(source_hash: str, root: Optional[Path] = None) -> Path:
    """Where the metadata entry of the model file with content hash ``source_hash`` lives."""
    return (root or cache_root()) / "gguf-meta" / f"{source_hash[:16]}-m{METADATA_VERSION}.json"


def _body_sha256(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_gguf_cached(path: Path, source_hash: str, root: Optional[Path] = None) -> tuple:
    """A GGUF file's metadata and tensors, from the metadata cache when it holds this content.

    Args:
        path: the ``.gguf`` file.
        source_hash: its ``source_sha256``.
        root: the cache folder (default ``cache_root()``).

    Returns:
        ``(meta, tensors)``: ``meta`` as ``gguf_io.gguf_metadata`` returns it (``meta["fields"]``: the scalar
        metadata); ``tensors``: name -> ``QuantTensor`` (views of a ``numpy.memmap`` of the file) or float32 array
        (``gguf_io.gguf_tensors``).

    Raises:
        ValueError: on a miss, the file cannot be parsed by ``gguf.GGUFReader`` or holds an unsupported tensor.
    """
    entry_path = gguf_metadata_path(source_hash, root)
    if entry_path.exists():
        try:
            entry = json.loads(entry_path.read_text())
            body = entry["body"]
            for k, v in (("format", METADATA_VERSION), ("source_sha256", source_hash), ("sha256", _body_sha256(body))):
                if entry.get(k) != v:
                    raise ValueError(f"{k} is {entry.get(k)!r}, expected {v!r}")
            if not isinstance(body.get("fields"), dict):
                raise ValueError("no fields")
            return body, gguf_tensors(path, body)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("GGUF metadata cache %s unusable (%s); rebuilding it", entry_path, e)
    check_gguf_magic(path)  # a file that is no GGUF fails here, before the log line promises a cache entry
    logger.info("first run: reading %s with gguf.GGUFReader into %s (one-off)", path, entry_path)
    body = gguf_metadata(open_gguf(path))
    tensors = gguf_tensors(path, body)
    entry = {"format": METADATA_VERSION, "source_sha256": source_hash, "sha256": _body_sha256(body), "body": body}
    try:
        atomic_write(entry_path, [json.dumps(entry, sort_keys=True).encode()])
    except OSError as e:
        logger.warning("cannot write the GGUF metadata cache %s: %s", entry_path, e)
    return body, tensors
