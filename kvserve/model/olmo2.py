"""OLMo 2 family (Olmo2ForCausalLM; OLMo et al. 2024, "2 OLMo 2 Furious", section 3.2): the Llama decoder with
the norms moved after the sub-layers -- each layer is ``h + norm(attn(h))`` then ``h + norm(mlp(h))``, no norm
before either -- and the queries and keys RMS-normed over the whole projection (``[H_q D]`` and ``[H_kv D]``
weights, not one per head as Qwen3) before RoPE. The Python layer loop runs it (the fused C loop runs pre-norm
layers only); tensor parallelism is refused (the Q/K norm spans every head)."""

from __future__ import annotations

import torch

from kvserve.batch import InputBatch
from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.llama import LlamaModel


class Olmo2Model(LlamaModel):
    """``LlamaModel`` reading, per layer, ``post_attention_layernorm``, ``post_feedforward_layernorm`` and
    ``self_attn.{q,k}_norm`` (``[H_q D]``, ``[H_kv D]``) and no ``input_layernorm``.

    Raises:
        ValueError: a norm weight is missing, or tensor parallelism is asked for.
    """

    def __init__(self, arch: ModelArch, weights: dict, backends: ModelBackends):
        if backends.tp_size > 1:
            raise ValueError(f"tensor_parallel_size={backends.tp_size} is not supported for {arch.architecture}: "
                             f"its Q/K norms span every head; use 1")
        names = [f"model.layers.{i}.{n}.weight" for i in range(arch.num_hidden_layers)
                 for n in ("post_attention_layernorm", "post_feedforward_layernorm", "self_attn.q_norm",
                           "self_attn.k_norm")]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ValueError(f"{arch.architecture} needs post-attention, post-MLP and Q/K norms; missing {missing[:4]}")
        # LlamaModel reads a pre-attention norm per layer; OLMo 2 has none (this one is never used)
        unused = torch.ones(arch.hidden_size, dtype=weights["model.norm.weight"].dtype)
        super().__init__(arch, {**weights, **{f"model.layers.{i}.input_layernorm.weight": unused
                                               for i in range(arch.num_hidden_layers)}}, backends)
        self.fused_layers = None
        for i, w in enumerate(self.layers):
            p = f"model.layers.{i}."
            w["post_attn_norm"] = weights[p + "post_attention_layernorm.weight"]
            w["post_mlp_norm"] = weights[p + "post_feedforward_layernorm.weight"]
            w["q_norm"], w["k_norm"] = weights[p + "self_attn.q_norm.weight"], weights[p + "self_attn.k_norm.weight"]

    def _layer_loop(self, h: torch.Tensor, batch: InputBatch, meta, rope: tuple, kv_cache: torch.Tensor) -> torch.Tensor:
        """Every OLMo 2 layer on the residual stream ``h [T, hidden]``; returns the last layer's output, before the
        final norm."""
        a, n_q, eps, ops = self.arch, self.num_heads, self.arch.rms_norm_eps, self.ops
        nq, nk = n_q * a.head_dim, self.num_kv_heads * a.head_dim
        caches = kv_cache.unbind(0)
        attn_buf = torch.empty(batch.num_tokens, nq, dtype=self.dtype)
        for i, w in enumerate(self.layers):
            qkv = w["qkv"](h)
            if w["qkv_bias"] is not None:
                qkv = qkv + w["qkv_bias"]
            q = ops.rms_norm(qkv[:, :nq].contiguous(), w["q_norm"], eps)
            k = ops.rms_norm(qkv[:, nq: nq + nk].contiguous(), w["k_norm"], eps)
            qkv = torch.cat([q, k, qkv[:, nq + nk:]], dim=1)
            attn = self.attn.forward_qkv(qkv, n_q, caches[i], meta, rope, batch, a.attention_scale, attn_buf)
            o = w["o"](attn)
            if w["o_bias"] is not None:
                o = o + w["o_bias"]
            h = h + ops.rms_norm(o, w["post_attn_norm"], eps)
            down = w["down"](ops.act_mul(w["gate_up"](h), a.hidden_act))
            h = h + ops.rms_norm(down, w["post_mlp_norm"], eps)
        return h
