"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer"), rotate-half form as in Hugging Face's Llama
(``apply_rotary_pos_emb``): the frequencies of each scaling scheme a family uses, the cos/sin rows of a step's
positions, and their application with PyTorch ops.

Scaling schemes (``RopeScaling.rope_type``), each a function of the head width, the base, the scheme's parameters
and at most the serving length ``max_model_len`` fixed at start-up -- never of a step's sequence lengths, so a
token's rotation does not depend on its batch and the K/V already cached stay valid:
- ``"linear"``: position interpolation (Chen et al. 2023): every frequency divided by ``factor``;
- ``"dynamic"``: dynamic NTK (Hugging Face's, after /u/bloc97 and /u/emozilla): the base raised to
  ``base * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``. Hugging Face recomputes it
  per forward for ``L`` = that forward's length (past ``max_position_embeddings`` only), which would change the
  rotation of keys already cached; a paged server fixes ``L = max(max_model_len, max_position_embeddings)`` once.
  So up to ``max_position_embeddings`` tokens of serving length it is plain RoPE, exactly as transformers runs
  every such sequence; above, it equals transformers on a sequence of ``max_model_len`` tokens (vLLM fixes
  ``L = max_position_embeddings * factor`` instead);
- ``"longrope"``: LongRoPE (Ding et al. 2024; Phi-3 / Phi-3.5 / Phi-4-mini): each frequency divided by its
  ``short_factor`` or ``long_factor``, cos and sin scaled by ``attention_factor`` (default
  ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``, ``factor`` defaulting to
  ``max_position_embeddings / original_max_position_embeddings``). transformers picks the long factors per forward
  when its length passes ``original_max_position_embeddings``; kvserve picks once, as vLLM does: the long factors
  when ``max_model_len > original_max_position_embeddings`` (so a server at the default length of a 128k model
  uses the long factors for every sequence, and ``max_model_len <= original_max_position_embeddings`` the short);
- ``"llama3"``: Llama 3.1's: wavelengths longer than ``original_max_position_embeddings / low_freq_factor``
  divided by ``factor``, shorter than ``... / high_freq_factor`` kept, a linear blend between (Meta's Llama 3.1
  release, ``apply_scaling``);
- ``"yarn"``: YaRN (Peng et al. 2023, section 3.2-3.4): per-frequency blend of interpolation and extrapolation by a
  linear ramp over the correction range of ``beta_fast`` .. ``beta_slow`` rotations, and cos/sin scaled by the
  attention factor (``0.1 ln(factor) + 1`` unless given);
- ``partial_rotary_factor`` (any scheme; Phi-4-mini, StableLM): only the first ``d = int(D * factor)`` features
  of each head rotate, in rotate-half pairs ``(i, i + d / 2)``; the frequencies are those of a ``d``-wide head.
  kvserve rotates full-width heads (one kernel), so the Q and K rows of each head are reordered once at load
  (``partial_rotary_rows``) so that those pairs become ``(i, i + D / 2)``, and the unrotated features sit at
  zero frequency (cos 1, sin 0: unchanged bit for bit); attention scores are sums over the same products;
- ``freq_factors``: llama.cpp's ``rope_freqs.weight`` (how a GGUF stores Llama 3.1's scaling): each frequency
  divided by its factor.

kvserve's CPU attention backend applies the same rotation inside its fused attention call
(``csrc/paged_attention.c``, ``kvserve_rope_write_attend_f32``) with the same rounding, so both give equal bits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

#: ``RopeScaling.rope_type`` values implemented here.
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling scheme and its parameters (Hugging Face's ``rope_scaling`` / ``rope_parameters`` names).

    Attributes:
        rope_type: one of ``ROPE_TYPES``, or ``"default"`` with ``freq_factors`` only.
        factor: the context stretch (linear, dynamic, llama3, yarn, longrope).
        original_max_position_embeddings: the pretraining context (llama3, yarn, longrope).
        low_freq_factor, high_freq_factor: llama3's band edges.
        beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate: YaRN's (``attention_factor``
            ``None``: derived from ``factor`` and the mscales).
        freq_factors: ``[D / 2]`` divisors of the frequencies (GGUF ``rope_freqs.weight``), or ``None``.
        short_factor, long_factor: LongRoPE's per-frequency divisors, ``d / 2`` each (longrope).
        max_position_embeddings: the model's context (dynamic: where the stretch starts).
        max_model_len: the serving length the scheme is fixed for (dynamic, longrope; module docstring);
            ``None``: ``max_position_embeddings``. Set by ``for_max_model_len``.
        partial_rotary_factor: the rotated fraction of each head (1.0: all of it).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True
    freq_factors: Optional[tuple] = None
    short_factor: Optional[tuple] = None
    long_factor: Optional[tuple] = None
    max_position_embeddings: Optional[int] = None
    max_model_len: Optional[int] = None
    partial_rotary_factor: float = 1.0

    @property
    def depends_on_max_model_len(self) -> bool:
        """Whether the frequencies depend on the serving length (dynamic NTK, LongRoPE)."""
        return self.rope_type in ("dynamic", "longrope")

    def for_max_model_len(self, max_model_len: Optional[int]) -> "RopeScaling":
        """This scheme fixed for a server of ``max_model_len`` tokens (``None``: the model's context)."""
        return replace(self, max_model_len=max_model_len) if self.depends_on_max_model_len else self

    def uses_long_factor(self) -> bool:
        """LongRoPE: whether the long factors apply (``max_model_len`` past ``original_max_position_embeddings``)."""
        length = self.max_model_len or self.max_position_embeddings or 0
        return length > self.original_max_position_embeddings


def partial_rotary_rows(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of one head's ``D = head_dim`` query/key features that turns Hugging Face's partial rotary (pairs
    ``(i, i + d / 2)`` for ``i < d / 2``, ``d = rotary_dim``; features ``d ..`` unrotated) into kvserve's full-width
    rotate-half (pairs ``(j, j + D / 2)``) with the unrotated features at frequencies ``d / 2 ..`` (zero):
    ``new[j] = old[index[j]]``, an int64 ``[D]`` permutation."""
    half, r2 = head_dim // 2, rotary_dim // 2
    rest = list(range(rotary_dim, head_dim))
    return torch.tensor(list(range(r2)) + rest[: half - r2] + list(range(r2, rotary_dim)) + rest[half - r2:])


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``[D / 2]`` float32 inverse frequencies ``theta ** (-2i / D)``."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling] = None) -> tuple[torch.Tensor, float]:
    """The inverse frequencies ``[D / 2]`` float32 of a scheme (module docstring) and the factor its cos and sin
    are multiplied by (1.0 but for YaRN and LongRoPE). ``scaling=None``: plain RoPE. With a
    ``partial_rotary_factor`` below 1 the first ``d / 2`` are the frequencies of a ``d``-wide head and the rest 0
    (the Q/K rows then in ``partial_rotary_rows`` order), and a factor other than 1 is a ``[D / 2]`` float32 tensor
    (1 at the unrotated features).

    Raises:
        ValueError: an unknown ``rope_type``; ``freq_factors`` of another length than ``D / 2``, or with a
            ``rope_type`` other than ``"default"``; LongRoPE factors of another length than ``d / 2``.
    """
    if scaling is None or scaling.partial_rotary_factor == 1.0:
        return _frequencies(head_dim, theta, scaling)
    dim = int(head_dim * scaling.partial_rotary_factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"partial_rotary_factor={scaling.partial_rotary_factor} gives {dim} rotated features of "
                         f"{head_dim}; it must give an even number in (0, {head_dim}]")
    inv_freq, attention = _frequencies(dim, theta, scaling)
    pad = head_dim // 2 - dim // 2
    if attention != 1.0:  # the unrotated features stay as they are: their cos 1, not scaled
        attention = torch.cat([torch.full((dim // 2,), attention), torch.ones(pad)])
    return torch.cat([inv_freq, torch.zeros(pad)]), attention


def _frequencies(dim: int, theta: float, s: Optional[RopeScaling]) -> tuple[torch.Tensor, float]:
    """``rope_frequencies`` of a ``dim``-wide rotation (the whole head, or its rotated part)."""
    inv_freq = rope_inv_freq(dim, theta)
    if s is None:
        return inv_freq, 1.0
    if s.freq_factors is not None:
        if s.rope_type != "default":
            raise ValueError(f"rope_freqs factors together with rope_type {s.rope_type!r} are not supported")
        if len(s.freq_factors) != dim // 2:
            raise ValueError(f"rope_freqs has {len(s.freq_factors)} factors; the head width {dim} needs "
                             f"{dim // 2}")
        inv_freq = inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32)
    if s.rope_type == "default":
        return inv_freq, 1.0
    if s.rope_type == "linear":
        return inv_freq / s.factor, 1.0
    if s.rope_type == "dynamic":
        trained = s.max_position_embeddings
        length = max(s.max_model_len or trained, trained)
        base = theta * ((s.factor * length / trained) - (s.factor - 1)) ** (dim / (dim - 2))
        return rope_inv_freq(dim, base), 1.0
    if s.rope_type == "longrope":
        ext = s.long_factor if s.uses_long_factor() else s.short_factor
        if len(ext) != dim // 2:
            raise ValueError(f"rope_scaling long_factor / short_factor have {len(ext)} entries; the rotated width "
                             f"{dim} needs {dim // 2}")
        attention = s.attention_factor
        if attention is None:
            old = s.original_max_position_embeddings
            attention = 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(old))
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**shape), float(attention)
    if s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)  # long waves: interpolated
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled), 1.0
    if s.rope_type == "yarn":
        attention = s.attention_factor
        if attention is None:
            attention = (_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
                         if s.mscale and s.mscale_all_dim else _yarn_mscale(s.factor))

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the context
            return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
        if s.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1: keep the frequency (fast dimensions), 0: interpolate it
        pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        inv = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
        return inv, float(attention)
    raise ValueError(f"rope_type must be one of {('default',) + ROPE_TYPES}, got {s.rope_type!r}")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 attention_scaling=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles (times ``attention_scaling``, as Hugging Face applies YaRN's factor: a
    float, or a ``[D / 2]`` tensor per frequency): ``positions [T]`` int -> two ``[T, 1, D]`` tensors of ``dtype``
    (contiguous; the two halves of each row are equal), broadcastable over heads."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if isinstance(attention_scaling, torch.Tensor):
        scale = torch.cat([attention_scaling, attention_scaling])
        cos, sin = cos * scale, sin * scale
    elif attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RopeTable:
    """``rope_cos_sin`` of positions ``0 .. n-1`` computed once and indexed per step (two index ops instead of six
    element-wise ones: a batch-1 decode step is a few milliseconds, and those ops were ~0.1 ms of it). The rows are
    the same bits as ``rope_cos_sin`` of the step's positions (element-wise ops: the value at a position does not
    depend on the others; ``tests/model/test_rotary.py``). The table grows by doubling when a step reaches past it
    (float32, 64-dim heads: 512 bytes per position).

    Args:
        inv_freq: ``[D / 2]`` float32 (``rope_frequencies``).
        dtype: of the returned rows.
        attention_scaling: cos and sin are multiplied by it (YaRN's and LongRoPE's attention factor, a float or a
            ``[D / 2]`` tensor; 1.0 otherwise).
    """

    def __init__(self, inv_freq: torch.Tensor, dtype: torch.dtype, attention_scaling=1.0):
        self.inv_freq, self.dtype, self.attention_scaling = inv_freq, dtype, attention_scaling
        self.cos = self.sin = torch.empty(0, inv_freq.shape[0] * 2, dtype=dtype)

    def __call__(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` int64, all below ``end`` -> ``(cos, sin)``, each ``[T, 1, D]`` contiguous."""
        if end > self.cos.shape[0]:
            n = max(end, 2 * self.cos.shape[0], 256)
            cos, sin = rope_cos_sin(torch.arange(n), self.inv_freq, self.dtype, self.attention_scaling)
            self.cos, self.sin = cos[:, 0], sin[:, 0]
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated: ``x * cos + rotate_half(x) * sin`` with ``cos``, ``sin`` from ``rope_cos_sin``
    (a new tensor)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
