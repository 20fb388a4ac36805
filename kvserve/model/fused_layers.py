"""The decoder's layer loop in one C call (``csrc/decoder.c``), for steps the CPU kernels can take whole.

A decode step of SmolLM2 with 4-bit weights takes a few milliseconds, and the Python loop over its 30 layers -- about
eight calls into C per layer, each with its checks, a new output tensor and a ``ctypes`` crossing -- was a third of
it (measured: docs/performance.md, "Decode step breakdown"). ``FusedLayerLoop`` hands the loop to C, which runs
the model's ``DecoderSpec`` (``kvserve.model.layer_spec``) as the Python loop (``kvserve.model.decoder``) interprets
it: per layer the same kernels in the same order (quantized Q/K/V projection and its bias, the Q/K norms, RoPE of
the layer's table + K/V write + paged attention with the layer's window, soft-cap and sinks, output projection, bias,
residual multiplier, post-norm, residual add + RMSNorm, gate/up, the activation, down, residual add + the next
RMSNorm; after the last layer, the model's final RMSNorm), so the residual stream it leaves and the normed rows it
returns equal the Python loop's and the final norm of its rows bit for bit (``tests/model/test_fused_layers.py``,
``tests/model/test_layer_spec.py``: every family). The GELU variants' activation is the Python loop's own PyTorch
op, called back once per layer (``_TorchActivation``); SwiGLU's is the C kernel. A Q/K/V projection whose parts
differ in format (``ConcatLinear``: a Q4_K_M file's Q6_K ``attn_v`` beside Q4_K ``attn_q`` / ``attn_k``) runs as
the Python loop runs it, one matmul per part, each into its columns of the Q/K/V rows. A mixture-of-experts MLP is the
Python loop's own ``MoE`` object, called back once per MoE layer (``_MoECallback``: the router's top-k and the
grouping by expert are Python's). ``build`` declines a spec with an op the C loop lacks, naming it (none today).

Chosen once, at start-up: ``select_backends`` decides from the ``KernelConfig`` (``fused_layers``) and what can run
here (float32, one process, the CPU kernels and a quantized path) whether models get a loop
(``ModelBackends.fused_layers``), and ``FusedLayerLoop.build`` builds it when every projection runs on a kernel
path with no padding (``QuantLinear.kernel_weight``) and the model's attention runs on the CPU kernel. Per step,
the attention backend's ``build_metadata`` says whether every request of the step is attended by the paged-attention
kernel (``whole_step_in_kernel``; on the CPU kernel backend, every step is), and the model then calls this loop for
prefill and decode steps alike. ``torch.compile`` of the Python loop is no substitute: it breaks its
graph at every kernel call and measured 3.3x slower than this loop, 2.3x slower than the plain Python loop
(``python -m benchmarks.layer_loop``; docs/performance.md, "Decode step breakdown").
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from kvserve.attention.kv_layout import pool_shape
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import qgemm as qkernels

logger = logging.getLogger(__name__)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _QWeight(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("w", _ptr), ("oscale", _ptr), ("n", _i64), ("k", _i64)]


#: ``DecoderLayer.qk_norm`` of each ``LayerSpec.qk_norm``; the most RoPE tables a step passes (``MAX_ROPES``).
_QK_NORMS = {"none": 0, "head": 1, "proj": 2}
_MAX_ROPES = 4


class _Layer(ctypes.Structure):
    _fields_ = [("pre_norms", _i64), ("mlp_norm", _ptr), ("next_norm", _ptr), ("post_attn_norm", _ptr),
                ("post_mlp_norm", _ptr), ("qk_norm", _i64), ("q_norm", _ptr), ("k_norm", _ptr), ("rope", _i64),
                ("window", _i64), ("softcap", _f32), ("qkv_bias", _ptr), ("o_bias", _ptr), ("gate_up_bias", _ptr),
                ("down_bias", _ptr), ("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight),
                ("mlp", _ptr), ("qkv_rest", _QWeight * 2), ("sinks", _ptr)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("h_q", _i64), ("h_kv", _i64), ("d", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("residual_multiplier", _f32),
                ("isa", _i64), ("act", _i64), ("attn_norm", _ptr), ("layers", _ptr), ("rms_norm", _ptr),
                ("rope_write_attend", _ptr * 3), ("add_rms_norm", _ptr), ("act_mul", _ptr)]


#: ``DecoderStack.act_mul``'s C signature: ``(gu [T, 2I], y [T, I], T, I)``.
_ACT_MUL = ctypes.CFUNCTYPE(None, _ptr, _ptr, _i64, _i64)
#: ``DecoderLayer.mlp``'s C signature: ``(x [T, hidden], y [T, hidden], T, layer) -> 0 | error``.
_MLP = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, _ptr, _i64, _i64)


class _Step(ctypes.Structure):
    _fields_ = [("T", _i64), ("cos", _ptr * _MAX_ROPES), ("sin", _ptr * _MAX_ROPES), ("slot_mapping", _ptr),
                ("block_tables", _ptr),
                ("max_blocks", _i64), ("q_start", _ptr), ("q_len", _ptr), ("seq_len", _ptr), ("num_reqs", _i64),
                ("block_size", _i64), ("kv_cache", _ptr), ("kv_dtype", _i64), ("layer_bytes", _i64),
                ("timing_ns", _ptr)]

#: KV-cache dtype -> ``DecoderStep.kv_dtype`` (the index of its ``rope_write_attend`` kernel).
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _qweight(layer) -> Optional[_QWeight]:
    """The C view of a projection, or ``None`` when it has no ``kernel_weight`` (not a kernel-path quantized layer
    without padding)."""
    pw = getattr(layer, "kernel_weight", None)
    if pw is None:
        return None
    return _QWeight(pw.fmt, pw.data.data_ptr(), None if pw.oscale is None else pw.oscale.data_ptr(),
                    pw.out_features, pw.in_features)


def _qkv_parts(layer) -> Optional[list]:
    """The C views of a Q/K/V projection, 3 of them (``DecoderLayer.qkv`` and ``qkv_rest``): one packed weight and
    two empty, or the parts of a ``ConcatLinear`` (parts whose formats differ) and empty ones; ``None`` when a part
    has no ``kernel_weight``."""
    parts = [_qweight(p) for p in getattr(layer, "parts", [layer])]
    if len(parts) > 3 or any(p is None for p in parts):
        return None
    return parts + [_QWeight()] * (3 - len(parts))


def _lacks(spec) -> Optional[str]:
    """The first op of ``spec`` (a ``DecoderSpec``) this C loop does not run, named; ``None``: it runs them all
    (a ``"moe"`` MLP runs through ``_MoECallback``)."""
    return None


def _readable(t: Optional[torch.Tensor]) -> bool:
    """``t`` is absent, or float32 contiguous (a pointer the C loop can read)."""
    return t is None or (t.dtype == torch.float32 and t.is_contiguous())


def _addr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


class _TorchActivation:
    """The C loop's ``act_mul`` for the GELU variants: a C-callable function that runs the Python loop's own
    ``ops.act_mul`` on the loop's gate/up scratch rows and copies the result into its activation scratch, so both
    loops give the same bits (one call back into Python per layer; SwiGLU runs its C kernel instead).
    ``bind`` it to the step's scratch before the loop runs; an exception inside is kept and raised by
    ``raise_error`` after the loop returns (a callback cannot raise through C)."""

    def __init__(self, ops, activation: str):
        self.ops, self.activation, self.error = ops, activation, None
        self.scratch, self.gu_ptr, self.act_ptr = None, 0, 0
        self.fn = _ACT_MUL(self)

    def bind(self, scratch: torch.Tensor, gu_ptr: int, act_ptr: int) -> None:
        self.scratch, self.gu_ptr, self.act_ptr = scratch, gu_ptr, act_ptr

    def __call__(self, gu_ptr, act_ptr, t, inter) -> None:
        try:
            base = self.scratch.data_ptr()
            if gu_ptr != self.gu_ptr or act_ptr != self.act_ptr:
                raise ValueError("the activation callback was called on memory it was not bound to")
            g0, a0 = (gu_ptr - base) // 4, (act_ptr - base) // 4
            gu = self.scratch[g0: g0 + t * 2 * inter].view(t, 2 * inter)
            self.scratch[a0: a0 + t * inter].view(t, inter).copy_(self.ops.act_mul(gu, self.activation))
        except Exception as e:  # noqa: BLE001 - raised after the C call (raise_error)
            self.error = e

    def raise_error(self) -> None:
        e, self.error = self.error, None
        if e is not None:
            raise e


class _MoECallback:
    """The C loop's ``DecoderLayer.mlp`` for mixture-of-experts layers: a C-callable function that runs the layer's
    ``kvserve.layers.moe.MoE`` (the Python loop's own object, so both loops give the same bits) on the loop's input
    rows and writes its output into the loop's ``delta`` rows -- one call back into Python per MoE layer. An
    exception inside is kept and raised by ``raise_error`` after the loop returns (a callback cannot raise
    through C)."""

    def __init__(self, moes: list, hidden: int):
        self.moes, self.hidden, self.error = moes, hidden, None
        self.fn = _MLP(self)

    def __call__(self, x_ptr, y_ptr, t, layer) -> int:
        try:
            n = t * self.hidden
            x = torch.frombuffer((ctypes.c_float * n).from_address(x_ptr), dtype=torch.float32).view(t, -1)
            y = torch.frombuffer((ctypes.c_float * n).from_address(y_ptr), dtype=torch.float32).view(t, -1)
            y.copy_(self.moes[layer](x))
            return 0
        except Exception as e:  # noqa: BLE001 - raised after the C call (raise_error)
            self.error = e
            return 1

    def raise_error(self) -> None:
        e, self.error = self.error, None
        if e is not None:
            raise e


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class FusedLayerLoop:
    """All decoder layers of one step in one ``kvserve_decoder_stack`` call. Build with ``FusedLayerLoop.build``.

    Call with ``(h, batch, meta, ropes, kv_cache)``: ``h [T, hidden]`` float32 contiguous, the residual stream
    (the embeddings; updated in place to the last layer's output, before the final norm); ``batch`` the step's
    ``InputBatch``; ``meta`` its attention metadata; ``ropes`` the model's ``(cos, sin)`` pairs
    (``DecoderModel.ropes``: one per RoPE table, then NoPE's identity), each ``[T, 1, D]`` float32;
    ``kv_cache`` ``[layers, 2, num_blocks, block_size, H_kv, D]`` float32 or bfloat16 contiguous; ``meta`` must
    have ``whole_step_in_kernel``. Returns the final RMSNorm of every row, ``[T, hidden]`` float32 (a view of the
    loop's scratch, valid until its next call: the LM head's input); ``h`` then holds the last layer's output and
    this step's K/V are written.

    Raises:
        ValueError: a step the loop does not take (its attention not all in the kernel, a cache of another layer
            count or layout, tensors of another dtype), or the model's shapes do not match its weights: bugs of
            the caller, not input errors.
        MemoryError: a kernel could not allocate its scratch memory.

    Attributes:
        timings: ``None``, or an int64 ``[3]`` tensor to which every call adds the nanoseconds spent in the matmuls,
            the attention kernel and the element-wise kernels (``kvserve bench throughput --profile-step``).
    """

    def __init__(self, model, stack: _Stack, layers, lib, act_mul=None, moe=None):
        # the model is held so the weights the C structs point into stay alive as long as this loop (and the
        # activation and MoE callbacks, when there are, as long as the stack that points to them)
        self._model, self._stack, self._layers, self._lib, self._act_mul = model, stack, layers, lib, act_mul
        self._moe = moe
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._x_views: dict = {}  # row count -> the [T, hidden] view of the scratch's start (cleared on growth)
        self.timings: Optional[torch.Tensor] = None
        # what the cache must look like: one [2, blocks, block_size, H_kv, D] slab per layer of *this* loop (a cache
        # of another layer count -- an early-exit draft's -- must never reach the kernel)
        self._kv_lead, self._kv_tail = (stack.num_layers, 2), (model.num_kv_heads, model.arch.head_dim)
        a = model.arch
        d = a.head_dim
        # x, qkv, attn, delta, gate_up, act: kvserve_decoder_stack's scratch, floats per row
        self._widths = (a.hidden_size, (model.num_heads + 2 * model.num_kv_heads) * d, model.num_heads * d,
                        a.hidden_size, 2 * model.intermediate_size, model.intermediate_size)

    @classmethod
    def build(cls, model) -> Optional["FusedLayerLoop"]:
        """The fused loop for ``model`` (a ``DecoderModel``), or ``None`` when its backends run no fused loop
        (``ModelBackends.fused_layers``), its spec has an op the C loop lacks, or a projection has no
        ``kernel_weight`` (the reason, naming the op, is logged at debug level): see the module docstring."""
        def no(reason: str) -> None:
            logger.debug("fused layer loop off: %s", reason)
            return None

        if not model.backends.fused_layers:
            return no("the backends run the Python layer loop")
        a = model.arch
        lib, cpu = qkernels.load(), cpu_kernels.load()
        d, hidden, inter = a.head_dim, a.hidden_size, model.intermediate_size
        attn_isa = getattr(model.attn, "isa", None)  # the CPU kernel backend's build; None: another backend
        if attn_isa is None:
            return no(f"attention runs on {model.attn.name}, not the CPU kernel")
        if d % 8 or hidden % 8 or inter % 8 or model.num_heads % model.num_kv_heads:
            return no("shapes the kernels do not take")
        spec = model.spec
        lacks = _lacks(spec)
        if lacks:
            return no(f"the C loop lacks {lacks}")
        num_ropes = len(spec.ropes) + any(s.rope is None for s in spec.layers)  # (+ NoPE's identity: model.ropes)
        if num_ropes > _MAX_ROPES:
            return no(f"{num_ropes} RoPE tables (the C loop takes {_MAX_ROPES})")
        n, layers, acts = len(model.layers), (_Layer * len(model.layers))(), set()
        moe = _MoECallback([w["moe"] for w in model.layers], hidden) if any(w["moe"] for w in model.layers) else None
        for i, (w, s) in enumerate(zip(model.layers, spec.layers)):
            names = ("o",) if w["moe"] is not None else ("o", "gate_up", "down")
            qkv, parts = _qkv_parts(w["qkv"]), [_qweight(w[k]) for k in names]
            if qkv is None or any(p is None for p in parts):
                return no(f"layer {i}: a projection without a kernel_weight")
            parts += [_QWeight()] * (3 - len(parts))  # (a MoE layer's MLP: the callback's)
            acts.update((p.isa, p.activations) for p in [*getattr(w["qkv"], "parts", [w["qkv"]]),
                                                         *(w[k] for k in names)])
            # the next layer's input norm; after the last layer, the final norm (its rows are the LM head's input)
            nxt = model.final_norm if i + 1 == n else (
                model.layers[i + 1]["attn_norm"] if spec.layers[i + 1].pre_norms else None)
            q_norm, k_norm = w["qk_norm"] or (None, None)
            tensors = [w["mlp_norm"], nxt, w["post_attn_norm"], w["post_mlp_norm"], q_norm, k_norm, w["qkv_bias"],
                       w["o_bias"], w["gate_up_bias"], w["down_bias"], w["sinks"]]
            if not all(map(_readable, tensors)):
                return no(f"layer {i}: a norm, bias or sink not float32 contiguous")
            layers[i] = _Layer(s.pre_norms, *map(_addr, tensors[:4]), _QK_NORMS[s.qk_norm], _addr(q_norm),
                               _addr(k_norm), num_ropes - 1 if s.rope is None else s.rope, s.window or 0,
                               s.attn_softcap or 0.0, *map(_addr, tensors[6:10]), qkv[0], *parts,
                               _address(moe.fn) if w["moe"] is not None else None, (_QWeight * 2)(*qkv[1:]),
                               _addr(w["sinks"]))
        if len(acts) != 1:
            return no(f"mixed kernel paths or activation quantizations {sorted(acts)}")
        isa, act = acts.pop()
        norm0 = model.layers[0]["attn_norm"]
        if not _readable(norm0):
            return no("layer 0's norm not float32 contiguous")
        torch_act = None if spec.activation == "silu" else _TorchActivation(model.ops, spec.activation)
        stack = _Stack(n, hidden, model.num_heads, model.num_kv_heads, d, inter, a.rms_norm_eps,
                       spec.attention_scale, spec.residual_multiplier, qkernels.ISAS[isa], qkernels.ACTIVATIONS[act],
                       _addr(norm0), ctypes.addressof(layers), _address(cpu.kvserve_rms_norm_f32),
                       (_ptr * 3)(*(_address(cpu_kernels.attention_fn(dt, attn_isa, sinks=True))
                                    for dt in _KV_DTYPES)),
                       _address(cpu.kvserve_add_rms_norm_f32),
                       _address(cpu.kvserve_silu_mul_f32 if torch_act is None else torch_act.fn))
        lib.kvserve_decoder_stack.argtypes = [_ptr] * 9  # stack, step, h, x, qkv, attn, delta, gate_up, act
        lib.kvserve_decoder_stack.restype = ctypes.c_int
        return cls(model, stack, layers, lib, torch_act, moe)

    def __call__(self, h: torch.Tensor, batch, meta, ropes, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run every layer on ``h [T, hidden]`` float32 (the embeddings; left holding the last layer's output, before
        the final norm, as the Python loop leaves it). Returns the final RMSNorm of every row, ``[T, hidden]``
        float32 (a view of this loop's scratch: valid until its next call)."""
        if not (meta.whole_step_in_kernel and meta.kernel is not None and kv_cache.dtype in _KV_DTYPES
                and kv_cache.is_contiguous() and kv_cache.shape[:2] == self._kv_lead
                and kv_cache.shape[4:] == pool_shape(self._kv_tail, kv_cache.dtype)
                and h.shape[1] == self._stack.hidden):
            raise ValueError(f"the fused layer loop does not take this step (attention all in the kernel: "
                             f"{meta.whole_step_in_kernel}; cache {list(kv_cache.shape)} {kv_cache.dtype}, expected "
                             f"{list(self._kv_lead)} x blocks x block_size x {list(self._kv_tail)})")
        t = batch.num_tokens
        tables, q_start, q_len, seq_len = meta.kernel
        ints = (batch.slot_mapping, tables, q_start, q_len, seq_len)
        rot = [x for cs in ropes for x in cs]
        if not (all(x.dtype == torch.float32 and x.is_contiguous() for x in rot) and len(ropes) <= _MAX_ROPES
                and all(v.dtype == torch.int64 and v.is_contiguous() for v in ints)
                and h.dtype == torch.float32 and h.is_contiguous()):
            raise ValueError("the fused layer loop takes float32 rows and rope, int64 tables, all contiguous")
        need = t * sum(self._widths)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(max(need, 2 * self._scratch.numel()), dtype=torch.float32)
            self._x_views = {}
        base, ptrs = self._scratch.data_ptr(), []  # addresses only: each torch view would be a call (cold: costly)
        for w in self._widths:
            ptrs.append(base)
            base += 4 * t * w
        layer_bytes = kv_cache.stride(0) * kv_cache.element_size()  # one layer's K and V (contiguous)
        step = _Step(t, (_ptr * _MAX_ROPES)(*(c.data_ptr() for c, _ in ropes)),
                     (_ptr * _MAX_ROPES)(*(s.data_ptr() for _, s in ropes)), batch.slot_mapping.data_ptr(), tables.data_ptr(),
                     tables.shape[1], q_start.data_ptr(), q_len.data_ptr(), seq_len.data_ptr(), tables.shape[0],
                     kv_cache.shape[3], kv_cache.data_ptr(), _KV_DTYPES[kv_cache.dtype], layer_bytes,
                     None if self.timings is None else self.timings.data_ptr())
        if self._act_mul is not None:
            self._act_mul.bind(self._scratch, ptrs[4], ptrs[5])
        rc = self._lib.kvserve_decoder_stack(ctypes.byref(self._stack), ctypes.byref(step), h.data_ptr(), *ptrs)
        if self._act_mul is not None:
            self._act_mul.raise_error()
        if self._moe is not None:
            self._moe.raise_error()
        if rc == -4:
            raise RuntimeError("kvserve_decoder_stack: a mixture-of-experts layer failed")
        if rc == -1:
            raise ValueError("kvserve_decoder_stack: the model's shapes do not match its weights")
        if rc:
            raise MemoryError(f"kvserve_decoder_stack could not allocate its scratch memory (code {rc})")
        x = self._x_views.get(t)  # x, which the last layer's add_rms_norm wrote; a view made once per row count
        if x is None:  # (slicing a tensor is a torch call: ~60 us with the caches cold from the weights)
            x = self._x_views[t] = self._scratch[: t * self._widths[0]].view(t, -1)
        return x
