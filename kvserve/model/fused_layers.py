"""The decoder's layer loop in one C call (``csrc/decoder.c``), for steps the CPU kernels can take whole.

A decode step of SmolLM2 with 4-bit weights takes a few milliseconds, and the Python loop over its 30 layers -- about
eight calls into C per layer, each with its checks, a new output tensor and a ``ctypes`` crossing -- was a third of
it (measured: docs/performance.md, "Decode step breakdown"). ``FusedLayerLoop`` hands the loop to C:
per layer the same kernels in the same order (quantized Q/K/V projection, RoPE + K/V write + paged attention,
output projection, residual add + RMSNorm, gate/up, silu * up, down, residual add + the next RMSNorm; after the
last layer, the model's final RMSNorm), so the residual stream it leaves and the normed rows it returns equal the
Python loop's and ``rms_norm`` of its rows bit for bit (``tests/model/test_fused_layers.py``).

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

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import qgemm as qkernels

logger = logging.getLogger(__name__)

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _QWeight(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("w", _ptr), ("oscale", _ptr), ("n", _i64), ("k", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("mlp_norm", _ptr), ("next_norm", _ptr), ("qkv_bias", _ptr),
                ("qkv", _QWeight), ("o", _QWeight), ("gate_up", _QWeight), ("down", _QWeight)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", _i64), ("hidden", _i64), ("h_q", _i64), ("h_kv", _i64), ("d", _i64),
                ("intermediate", _i64), ("eps", _f32), ("scale", _f32), ("isa", _i64), ("act", _i64),
                ("attn_norm", _ptr), ("layers", _ptr), ("rms_norm", _ptr), ("rope_write_attend", _ptr * 2),
                ("add_rms_norm", _ptr), ("silu_mul", _ptr)]


class _Step(ctypes.Structure):
    _fields_ = [("T", _i64), ("cos", _ptr), ("sin", _ptr), ("slot_mapping", _ptr), ("block_tables", _ptr),
                ("max_blocks", _i64), ("q_start", _ptr), ("q_len", _ptr), ("seq_len", _ptr), ("num_reqs", _i64),
                ("block_size", _i64), ("kv_cache", _ptr), ("kv_dtype", _i64), ("layer_bytes", _i64),
                ("timing_ns", _ptr)]

#: KV-cache dtype -> ``DecoderStep.kv_dtype`` (the index of its ``rope_write_attend`` kernel).
_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _qweight(layer) -> Optional[_QWeight]:
    """The C view of a projection, or ``None`` when it has no ``kernel_weight`` (not a kernel-path quantized layer
    without padding)."""
    pw = getattr(layer, "kernel_weight", None)
    if pw is None:
        return None
    return _QWeight(pw.fmt, pw.data.data_ptr(), None if pw.oscale is None else pw.oscale.data_ptr(),
                    pw.out_features, pw.in_features)


def _lacks(spec, head_dim: int) -> Optional[str]:
    """The first op of ``spec`` (a ``DecoderSpec``) this C loop does not run, named; ``None``: it runs them all."""
    for i, s in enumerate(spec.layers):
        if s.norms != "pre":
            return f"{s.norms!r} norms (layer {i})"
        if s.qk_norm != "none":
            return f"the {s.qk_norm!r} Q/K norm (layer {i})"
        if s.rope != 0:
            return f"a layer without RoPE or with another table (layer {i})"
        if s.window is not None or s.attn_softcap is not None:
            return f"a sliding window or an attention soft-cap (layer {i})"
        if s.mlp != "dense":
            return f"a {s.mlp!r} MLP (layer {i})"
    if spec.activation != "silu":
        return f"the {spec.activation} activation"
    if spec.o_bias or spec.mlp_bias:
        return "o_proj or MLP biases"
    if spec.residual_multiplier != 1.0 or spec.attention_scale != head_dim**-0.5:
        return "a residual multiplier or another softmax scale"
    return None


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


class FusedLayerLoop:
    """All decoder layers of one step in one ``kvserve_decoder_stack`` call. Build with ``FusedLayerLoop.build``.

    Call with ``(h, batch, meta, rope, kv_cache)``: ``h [T, hidden]`` float32 contiguous, the residual stream
    (the embeddings; updated in place to the last layer's output, before the final norm); ``batch`` the step's
    ``InputBatch``; ``meta`` its attention metadata; ``rope`` ``(cos, sin)`` ``[T, 1, D]`` float32;
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

    def __init__(self, model, stack: _Stack, layers, lib):
        # the model is held so the weights the C structs point into stay alive as long as this loop
        self._model, self._stack, self._layers, self._lib = model, stack, layers, lib
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
        """The fused loop for ``model`` (a ``LlamaModel``), or ``None`` when its backends run no fused loop
        (``ModelBackends.fused_layers``) or a projection has no ``kernel_weight`` (the reason is logged at debug
        level): see the module docstring."""
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
        lacks = _lacks(spec, d)
        if lacks:
            return no(f"the C loop lacks {lacks}")
        layers = (_Layer * len(model.layers))()
        acts = set()
        for i, w in enumerate(model.layers):
            parts = [_qweight(w[k]) for k in ("qkv", "o", "gate_up", "down")]
            if any(p is None for p in parts):
                return no(f"layer {i}: a projection without a kernel_weight")
            acts.update((w[k].isa, w[k].activations) for k in ("qkv", "o", "gate_up", "down"))
            # the next layer's input norm; after the last layer, the final norm (its rows are the LM head's input)
            nxt = model.layers[i + 1]["attn_norm"] if i + 1 < len(model.layers) else model.final_norm
            norms = [w["mlp_norm"], nxt]
            bias = w["qkv_bias"]
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in norms + ([bias] if bias is not None else [])):
                return no(f"layer {i}: norm or bias not float32 contiguous")
            layers[i] = _Layer(w["mlp_norm"].data_ptr(), nxt.data_ptr(),
                               None if bias is None else bias.data_ptr(), *parts)
        if len(acts) != 1:
            return no(f"mixed kernel paths or activation quantizations {sorted(acts)}")
        isa, act = acts.pop()
        norm0 = model.layers[0]["attn_norm"]
        if norm0.dtype != torch.float32 or not norm0.is_contiguous():
            return no("layer 0's norm not float32 contiguous")
        stack = _Stack(len(model.layers), hidden, model.num_heads, model.num_kv_heads, d, inter, a.rms_norm_eps,
                       spec.attention_scale, qkernels.ISAS[isa], qkernels.ACTIVATIONS[act], norm0.data_ptr(),
                       ctypes.addressof(layers), _address(cpu.kvserve_rms_norm_f32),
                       (_ptr * 2)(*(_address(cpu_kernels.attention_fn(dt, attn_isa)) for dt in _KV_DTYPES)),
                       _address(cpu.kvserve_add_rms_norm_f32), _address(cpu.kvserve_silu_mul_f32))
        lib.kvserve_decoder_stack.argtypes = [_ptr] * 9  # stack, step, h, x, qkv, attn, delta, gate_up, act
        lib.kvserve_decoder_stack.restype = ctypes.c_int
        return cls(model, stack, layers, lib)

    def __call__(self, h: torch.Tensor, batch, meta, ropes, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run every layer on ``h [T, hidden]`` float32 (the embeddings; left holding the last layer's output, before
        the final norm, as the Python loop leaves it). Returns the final RMSNorm of every row, ``[T, hidden]``
        float32 (a view of this loop's scratch: valid until its next call)."""
        if not (meta.whole_step_in_kernel and meta.kernel is not None and kv_cache.dtype in _KV_DTYPES
                and kv_cache.is_contiguous() and kv_cache.shape[:2] == self._kv_lead
                and kv_cache.shape[4:] == self._kv_tail and h.shape[1] == self._stack.hidden):
            raise ValueError(f"the fused layer loop does not take this step (attention all in the kernel: "
                             f"{meta.whole_step_in_kernel}; cache {list(kv_cache.shape)} {kv_cache.dtype}, expected "
                             f"{list(self._kv_lead)} x blocks x block_size x {list(self._kv_tail)})")
        cos, sin = ropes[0]
        t = batch.num_tokens
        tables, q_start, q_len, seq_len = meta.kernel
        ints = (batch.slot_mapping, tables, q_start, q_len, seq_len)
        if not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
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
        step = _Step(t, cos.data_ptr(), sin.data_ptr(), batch.slot_mapping.data_ptr(), tables.data_ptr(),
                     tables.shape[1], q_start.data_ptr(), q_len.data_ptr(), seq_len.data_ptr(), tables.shape[0],
                     kv_cache.shape[3], kv_cache.data_ptr(), _KV_DTYPES[kv_cache.dtype], layer_bytes,
                     None if self.timings is None else self.timings.data_ptr())
        rc = self._lib.kvserve_decoder_stack(ctypes.byref(self._stack), ctypes.byref(step), h.data_ptr(), *ptrs)
        if rc == -1:
            raise ValueError("kvserve_decoder_stack: the model's shapes do not match its weights")
        if rc:
            raise MemoryError(f"kvserve_decoder_stack could not allocate its scratch memory (code {rc})")
        x = self._x_views.get(t)  # x, which the last layer's add_rms_norm wrote; a view made once per row count
        if x is None:  # (slicing a tensor is a torch call: ~60 us with the caches cold from the weights)
            x = self._x_views[t] = self._scratch[: t * self._widths[0]].view(t, -1)
        return x
