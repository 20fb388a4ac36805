"""GGUF quantized weights: block formats, reading them from a file, and packing them for the int8 kernels.

- ``formats``: GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) decoded exactly as ``gguf.quants``.
- ``gguf_io``: ``read_gguf_tensors(path)``: every tensor of a GGUF file, quantized ones as ``QuantTensor`` views.
- ``pack``: weights -> the kernels' packed layout (``kvserve.kernels.qgemm``); per-channel int8 and per-block int8
  quantizers.

The linear methods that compute with them are ``kvserve.layers.quant_linear``.
"""

from kvserve.quant.gguf_io import QuantTensor, read_gguf_tensors, rope_unpermute_index

__all__ = ["QuantTensor", "read_gguf_tensors", "rope_unpermute_index"]
