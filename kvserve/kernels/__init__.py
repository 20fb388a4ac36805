"""kvserve's C kernels, compiled on first use (``build``) and loaded with ``ctypes``.

- ``build``: the one JIT builder (sources in ``csrc/``, libraries cached by content hash).
- ``cpu``: the float32 kernels: matmul, paged attention (with RoPE and the K/V write), RMSNorm, silu * up.
- ``qgemm``: the int8 dot-product matmul of quantized weights, its instruction-set path chosen by CPUID at run
  time (AVX2, AVX-512 VNNI, AMX), and the fused layer loop's entry point.
"""
