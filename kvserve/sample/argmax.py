"""``argmax``: the index of each row's largest value, the one reduction every sampler path ends in.

On the CPU it runs through NumPy. PyTorch 2.13's CPU ``argmax`` over the last dimension was measured 10-19x slower
than ``numpy.argmax`` on this project's shapes (float32 ``[1, 49152]``: 55-61 us vs 5.5-5.9 us; ``[8, 49152]``:
302-685 us vs 34-38 us; ``[64, 49152]``: 2.5-4.8 ms vs 0.25-0.28 ms, 1 and 2 threads; docs/performance.md, "Sampling"), which made
the greedy pick the largest part of the sampler at batch 64. Both return the first maximum, and both treat NaN as
larger than any number (the first NaN wins), so the result is the same.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximum along the last dimension, as ``x.argmax(dim=-1)``.

    Args:
        x: ``[..., V]`` with ``V >= 1``, any dtype and device (float32/float64 on the CPU go through NumPy, the rest
            through PyTorch).

    Returns:
        int64 ``[...]`` on ``x``'s device (0-d for a 1-d ``x``), a new tensor.

    Raises:
        IndexError/ValueError (from PyTorch): ``x`` is 0-d or its last dimension is empty.
    """
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or x.dim() == 0 or x.shape[-1] == 0:
        return x.argmax(dim=-1)
    return torch.from_numpy(np.asarray(x.detach().numpy().argmax(axis=-1), dtype=np.int64))
