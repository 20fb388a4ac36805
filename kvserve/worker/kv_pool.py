"""The KV pool's memory: zero-filled, but taken from the OS page by page as blocks are first written.

``torch.zeros`` writes every byte of the pool at start-up, so its whole size counts in the resident set (RSS) from
the first second, and zeroing a pool of gigabytes takes seconds. ``lazy_zeros`` maps private anonymous memory
instead (``mmap(MAP_PRIVATE | MAP_ANONYMOUS)``): Linux guarantees such pages read as zeros and backs each with
RAM only on its first write (reads of an untouched page map the shared zero page), so the pool has exactly
``torch.zeros``' contents -- masked-out keys are 0, never garbage that could turn a ``0 * x`` into NaN -- while
RSS grows with the blocks actually used. (``torch.empty`` would be lazy too for large sizes under glibc's malloc,
but its contents are unspecified.)
"""

from __future__ import annotations

import mmap
import math

import torch

from kvserve.attention.kv_layout import pool_shape


def lazy_zeros(shape: tuple, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zero tensor of ``shape`` / ``dtype`` whose pages are allocated on first write (CPU); on another device
    ``torch.zeros``.

    The tensor keeps its mapping alive; the memory returns to the OS when the tensor is freed.

    Raises:
        ValueError: a negative dimension.
    """
    if any(int(s) < 0 for s in shape):
        raise ValueError(f"shape must have non-negative dimensions, got {list(shape)}")
    nbytes = math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()
    if device != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)



def new_kv_pool(shape: tuple, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """A zero KV pool (``lazy_zeros``) for the logical shape ``shape`` (a model's ``kv_cache_shape``,
    ``[..., H_kv, D]``) in ``dtype``: an int8 pool's rows carry their scales (``kv_layout.pool_shape``). An
    all-zero int8 row has scale 0 and reads as zeros, as the other types' zeros do."""
    return lazy_zeros(pool_shape(shape, dtype), dtype, device)
