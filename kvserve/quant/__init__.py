"""GGUF quantized weights: block formats, reading them from a file, and packing them for the int8 kernels.

- ``formats``: GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4; and 2-D
  F16 / BF16 weights) decoded exactly as ``gguf.quants``.
- ``layouts``: the kernel layouts' geometry (format ids, block bytes, named offsets), shared with C through the
  generated ``csrc/qgemm_layouts.h``.
- ``traits``: the table of formats: per GGUF type (geometry, decoder, kind, layout), per layout (pack, unpack).
- ``kquantize``: simple Q6_K / Q5_K quantizers (``gguf.quants`` has none), for tests and benchmarks.
- ``gguf_io``: ``read_gguf_tensors(path)``: every tensor of a GGUF file, quantized ones as ``QuantTensor`` views.
- ``pack``: weights -> the kernels' packed layouts (Q4, Q4F, Q5F, Q4K, Q6, Q8, MX4, Q2K, Q3K:
  ``kvserve.kernels.qgemm``) and
  back (``unpack_rows_*``); per-channel int8 and per-block int8 quantizers.

The linear methods that compute with them are ``kvserve.layers.quant_linear``.
"""

from kvserve.quant.gguf_io import QuantTensor, read_gguf_tensors, rope_unpermute_index

__all__ = ["QuantTensor", "read_gguf_tensors", "rope_unpermute_index"]
