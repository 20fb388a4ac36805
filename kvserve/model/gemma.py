"""Gemma 2 and Gemma 3 text families (Gemma2ForCausalLM, Gemma3ForCausalLM; llama.cpp's ``gemma2`` / ``gemma3``).

The Llama decoder with (Gemma Team, "Gemma 2", 2024, section 2; "Gemma 3 Technical Report", 2025, section 2):
- RMSNorm scaled by ``(1 + w)`` (the checkpoint stores ``w``; computed in float32 as ``transformers`` does), and four
  norms per layer: before attention, on the attention output before its residual add, before the MLP, and on the
  MLP output before its residual add;
- embeddings multiplied by ``sqrt(hidden_size)``, rounded to the model's dtype (as ``transformers`` does);
- a GeGLU MLP (``hidden_activation``, tanh-approximated GELU);
- softmax scale ``query_pre_attn_scalar ** -0.5`` (``ModelArch.attention_multiplier``);
- sliding-window attention on the ``"sliding_attention"`` layers (Gemma 2: every other layer; Gemma 3: five of
  six) and attention-logit soft-capping ``c * tanh(s / c)`` (Gemma 2): passed to the attention backend per layer;
- final-logit soft-capping ``c * tanh(logits / c)`` (``GemmaArch.final_logit_softcapping``);
- Gemma 3: per-head Q/K RMSNorm (``(1 + w)`` too) and per-layer RoPE: the sliding layers rotate with their own
  base (``rope_local_base_freq``, plain RoPE), the global layers with ``rope_theta`` and the RoPE scaling.

Sliding windows and attention soft-capping run in every attention backend (keyword arguments ``sliding_window`` /
``logit_softcap`` of ``AttentionBackend.forward_qkv``; docs/models.md, "Sliding-window attention").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.batch import InputBatch
from kvserve.layers.rotary import RopeScaling, RopeTable, rope_frequencies
from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.llama import LlamaModel

#: Hugging Face architectures of this module -> llama.cpp's ``general.architecture``.
GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


@dataclass(frozen=True)
class GemmaArch(ModelArch):
    """``ModelArch`` plus what only the Gemma families use.

    Attributes:
        final_logit_softcapping: logits become ``c * tanh(logits / c)``; ``None``: no capping.
        local_rope_theta: the RoPE base of the ``"sliding_attention"`` layers (Gemma 3's ``rope_local_base_freq``);
            ``None``: every layer uses ``rope_theta`` and ``rope_scaling``.
        local_rope_scaling: the RoPE scaling of those layers (``None``: plain RoPE), when ``local_rope_theta`` is set.
    """

    final_logit_softcapping: Optional[float] = None
    local_rope_theta: Optional[float] = None
    local_rope_scaling: Optional[RopeScaling] = None


class GemmaModel(LlamaModel):
    """Gemma 2 / Gemma 3 (text) over the paged KV cache (implements ``CausalLM``); see the module docstring.

    Args:
        arch: a ``GemmaArch``.
        weights, backends: as ``LlamaModel``; the norm weights are Hugging Face's ``w`` (the model uses ``1 + w``),
            and each layer also has ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm``.

    Raises:
        ValueError: as ``LlamaModel``; a norm weight missing (named).
    """

    def __init__(self, arch: GemmaArch, weights: dict[str, torch.Tensor], backends: ModelBackends):
        names = [f"model.layers.{i}.{n}_feedforward_layernorm.weight" for i in range(arch.num_hidden_layers)
                 for n in ("pre", "post")]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ValueError(f"{arch.architecture} needs pre- and post-feed-forward norms; missing {missing[:4]}")
        super().__init__(arch, weights, backends)
        self.fused_layers = None  # the C loop runs Llama's layer only
        self.final_norm = _shifted(self.final_norm)
        for i, w in enumerate(self.layers):
            p = f"model.layers.{i}."
            w["attn_norm"] = _shifted(w["attn_norm"])
            w["post_attn_norm"] = _shifted(w.pop("mlp_norm"))  # Gemma's post_attention_layernorm
            w["pre_ffn_norm"] = _shifted(weights[p + "pre_feedforward_layernorm.weight"])
            w["post_ffn_norm"] = _shifted(weights[p + "post_feedforward_layernorm.weight"])
            if w["qk_norm"] is not None:
                w["qk_norm"] = [_shifted(n) for n in w["qk_norm"]]
        # the embedding scale as transformers applies it: sqrt(hidden) rounded to the model's dtype
        self.embed_scale = float(torch.tensor(arch.hidden_size**0.5, dtype=self.dtype))
        self.local_rope_table = self.rope_table
        if arch.local_rope_theta is not None:
            inv_freq, factor = rope_frequencies(arch.head_dim, arch.local_rope_theta, arch.local_rope_scaling)
            self.local_rope_table = RopeTable(inv_freq, self.dtype, factor)
        self.layer_kinds = arch.layer_types or tuple(
            "sliding_attention" if arch.sliding_window is not None else "full_attention" for _ in self.layers)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``rms_norm(x) * weight`` computed in float32 (``weight``: ``1 + w``, float32), in ``x``'s dtype (also
        the per-head Q/K norms of ``LlamaModel._qk_norm``)."""
        eps = self.arch.rms_norm_eps
        if x.dtype == torch.float32:
            return self.ops.rms_norm(x, weight, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, out: torch.Tensor):
        """``(h + delta, _norm(h + delta))``; ``h`` may be updated in place (``ops.add_rms_norm``)."""
        if h.dtype == torch.float32:
            return self.ops.add_rms_norm(h, delta, weight, self.arch.rms_norm_eps, out)
        h = h + delta
        return h, self._norm(h, weight)

    @torch.inference_mode()
    def forward(self, batch: InputBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the flat batch, writing its K/V into the cache (``LlamaModel.forward``'s contract).

        Args:
            batch: the step's ``InputBatch`` (``T`` tokens).
            kv_cache: ``[layers, 2, num_blocks, block_size, H_kv, D]``.

        Returns:
            ``[S, vocab_size]`` float32 logits of the rows ``batch.logits_indices``, soft-capped when the model
            says so.
        """
        end = max(batch.context_lens)
        ropes = {"full_attention": self.rope_table(batch.positions, end)}
        ropes["sliding_attention"] = (ropes["full_attention"] if self.local_rope_table is self.rope_table
                                      else self.local_rope_table(batch.positions, end))
        # one metadata per layer kind: a backend may cache per-step state keyed on the rope and window it saw
        metas = {kind: self.attn.build_metadata(batch) for kind in set(self.layer_kinds)}
        h = self.embed(batch.input_ids) * self.embed_scale
        h = self._gemma_layers(h, batch, metas, ropes, kv_cache)
        x = self._norm(h if batch.logits_rows_are_all() else h[batch.logits_indices], self.final_norm)
        logits = self.lm_head(x)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if logits.dtype == torch.float32 else logits.float()

    def _gemma_layers(self, h: torch.Tensor, batch: InputBatch, metas: dict, ropes: dict,
                      kv_cache: torch.Tensor) -> torch.Tensor:
        """Every decoder layer on the residual stream ``h [T, hidden]``; returns the last layer's output, before
        the final norm."""
        a, n_q = self.arch, self.num_heads
        t = batch.num_tokens
        x_buf = torch.empty(t, a.hidden_size, dtype=self.dtype)
        attn_buf = torch.empty(t, n_q * a.head_dim, dtype=self.dtype)
        act_buf = torch.empty(t, self.intermediate_size, dtype=self.dtype)
        caches = kv_cache.unbind(0)
        x = self._norm(h, self.layers[0]["attn_norm"])
        for i, w in enumerate(self.layers):
            qkv = w["qkv"](x)
            if w["qkv_bias"] is not None:
                qkv = qkv + w["qkv_bias"]
            if w["qk_norm"] is not None:
                qkv = self._qk_norm(qkv, *w["qk_norm"])
            kind = self.layer_kinds[i]
            attn = self.attn.forward_qkv(qkv, n_q, caches[i], metas[kind], ropes[kind], batch, a.attention_scale,
                                         attn_buf, sliding_window=a.layer_window(i),
                                         logit_softcap=a.attn_logit_softcapping)
            o = w["o"](attn)
            if w["o_bias"] is not None:
                o = o + w["o_bias"]
            h, x = self._add_norm(h, self._norm(o, w["post_attn_norm"]), w["pre_ffn_norm"], x_buf)
            down = w["down"](self.ops.act_mul(w["gate_up"](x), a.hidden_act, act_buf))
            down = self._norm(down, w["post_ffn_norm"])
            if i + 1 < len(self.layers):
                h, x = self._add_norm(h, down, self.layers[i + 1]["attn_norm"], x_buf)
            else:
                h = h + down
        return h


def _shifted(w: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm scale ``1 + w`` in float32 (``w`` as the checkpoint stores it)."""
    return w.float() + 1.0
