"""Quantized weights kept quantized, multiplied with int8 dot products (issue 12, the kernel half).

- ``formats``: GGUF block formats (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) decoded exactly as ``gguf.quants``.
- ``gguf_io``: ``read_gguf_tensors(path)``: every tensor of a GGUF file, quantized ones as ``QuantTensor`` views.
- ``pack``: weights -> the kernel's packed layout; per-channel int8 and per-block int8 quantizers.
- ``kernels``: the C library (``csrc/qgemm.c``), ISA chosen at run time (AVX2 / AVX-512 VNNI), self-checked.
- ``linear``: ``make_linear_method(weight, quantization)``, ``QuantLinear``, ``QuantEmbedding``.
"""

from kvserve.model.quant.gguf_io import QuantTensor, read_gguf_tensors, rope_unpermute_index
from kvserve.model.quant.linear import (QUANTIZATION_METHODS, ConcatLinear, QuantEmbedding, QuantLinear,
                                        check_quantization, make_linear_method)

__all__ = ["QuantTensor", "read_gguf_tensors", "rope_unpermute_index", "QUANTIZATION_METHODS", "QuantEmbedding",
           "QuantLinear", "ConcatLinear", "check_quantization", "make_linear_method"]
