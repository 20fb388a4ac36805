"""What every model family implements, and the hyperparameters the loaders read.

A model is a forward over the flat batch (``kvserve.batch.InputBatch``) and the paged KV cache,
built through ``kvserve.model.registry.build_model`` with the backends chosen at start-up; it returns logits only
for the rows that sample. Adding a family is one module (its ``DecoderModel`` and its ``FAMILY``:
``kvserve.model.family``) plus one registry line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from kvserve.batch import InputBatch
from kvserve.layers.rotary import RopeScaling

#: ``ModelArch.hidden_act`` values implemented (Hugging Face's names): SiLU, exact GELU, tanh-approximated GELU.
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class MoEArch:
    """A mixture-of-experts decoder's expert layout, read from the model's metadata (``hf_config``, ``loader``).

    Attributes:
        num_experts: routed experts per MoE layer (Hugging Face ``num_experts`` / ``num_local_experts``; GGUF
            ``expert_count``).
        top_k: experts per token (``num_experts_per_tok``; GGUF ``expert_used_count``).
        intermediate_size: one expert's MLP width (``moe_intermediate_size``, else ``intermediate_size``; GGUF: the
            ``ffn_gate_exps`` rows per expert).
        renormalize: the chosen softmax probabilities are divided by their sum (``norm_topk_prob``; Mixtral: always).
        shared_intermediate_size: the width of a shared expert every token runs (Qwen2-MoE), 0: none.
        sparse_layers: per layer, whether its MLP is the MoE (Qwen's ``decoder_sparse_step`` / ``mlp_only_layers``:
            the others run a dense MLP of ``ModelArch.intermediate_size``).
        swiglu_alpha, swiglu_limit: the clamped SwiGLU's constants of a family whose experts use it (gpt-oss's
            ``swiglu_alpha`` / ``swiglu_limit``: ``kvserve.layers.moe.ExpertMLP``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool = False
    shared_intermediate_size: int = 0
    sparse_layers: tuple = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class ModelArch:
    """Hyperparameters of a decoder, read from the model's own metadata.

    Attributes:
        architecture: the registry name (Hugging Face's ``architectures[0]``: a key of ``registry.FAMILY_OF``).
        attention_bias: Q, K and V projections carry a bias (Qwen2; Llama's ``attention_bias``).
        o_proj_bias: the attention output projection carries one (Llama's ``attention_bias``).
        mlp_bias: gate, up and down projections carry one (Llama's ``mlp_bias``).
        hidden_act: the gated MLP's activation, one of ``HIDDEN_ACTS``.
        rope_scaling: the RoPE scaling scheme (``kvserve.layers.rotary``), ``None`` for plain RoPE.
        attention_multiplier: the softmax scale (Granite's ``attention_multiplier``, Gemma's
            ``query_pre_attn_scalar ** -0.5``); ``None``: ``head_dim ** -0.5``.
        sliding_window: the attention window in tokens, Hugging Face's meaning: the query at position ``p`` sees
            the keys at positions ``j`` with ``p - sliding_window < j <= p``; ``None``: no window (Mistral, Gemma).
        layer_types: per layer, ``"sliding_attention"`` or ``"full_attention"`` (transformers' ``layer_types``);
            ``None`` with a ``sliding_window``: every layer is windowed. See ``layer_window``.
        moe: the expert layout of a mixture-of-experts model (``MoEArch``); ``None``: every MLP is dense.
        Others: as in Hugging Face's configs (sizes in features, ``rope_theta`` the RoPE base).

    What only one family reads is a field of its own subclass (its ``Family.arch_class``: ``GemmaArch``,
    ``GraniteArch``, ``SmolLM3Arch``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    architecture: str
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_scaling: Optional[RopeScaling] = None
    attention_multiplier: Optional[float] = None
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple] = None
    moe: Optional[MoEArch] = None

    def layer_window(self, layer: int) -> Optional[int]:
        """The attention window (tokens) of layer ``layer``, or ``None`` where it attends to every earlier key."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``attention_multiplier``, else ``head_dim ** -0.5``."""
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim**-0.5

    def __post_init__(self) -> None:
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers or not set(
                self.layer_types) <= {"sliding_attention", "full_attention"}):
            raise ValueError(f"layer_types must give 'sliding_attention' or 'full_attention' for each of the "
                             f"{self.num_hidden_layers} layers, got {self.layer_types}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens or None, got {self.sliding_window}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def check_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        """Raise ``ValueError`` unless every dimension tensor parallelism splits divides by
        ``tensor_parallel_size``: attention heads, KV heads (each rank keeps whole heads and its slice of the KV
        pool), ``intermediate_size`` (the MLP) and ``vocab_size`` (the LM head). The message names the field."""
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if value % tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the model's {name}="
                                 f"{value} ({self.architecture}); choose a divisor of {value}")


class CausalLM(Protocol):
    """The protocol a model family implements.

    Attributes:
        arch: its ``ModelArch``.
        dtype: weight and activation dtype, and the KV cache's by default (``kv_cache_dtype="auto"``).
    """

    arch: ModelArch
    dtype: torch.dtype

    def forward(self, batch: InputBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the flat batch, writing its K/V into ``kv_cache`` (``kv_cache_shape``); returns
        ``[len(batch.logits_indices), vocab_size]`` float32 logits of the rows ``batch.logits_indices``."""
        ...

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the whole KV pool for ``num_blocks`` blocks of ``block_size`` tokens."""
        ...

    def bytes_per_block(self, block_size: int, kv_cache_dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over all layers, K and V, in ``kv_cache_dtype`` (default: ``dtype``)."""
        ...
