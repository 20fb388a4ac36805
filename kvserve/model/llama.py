"""Llama-family decoder forward over the paged KV cache: RMSNorm, RoPE (rotate-half), GQA, SwiGLU.

One call runs a flat batch mixing whole prompts, prompt chunks and decode tokens (see ``attention.py``) and
returns logits only for the rows that will be sampled. Q/K/V and gate/up projections are fused into one matmul
each, which matters on a CPU where every op has a fixed cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model import cpu_kernels
from kvserve.model.attention import AttentionMetadata, paged_attention, write_kv
from kvserve.model.linear import Linear
from kvserve.model.loader import ModelArch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in float32: ``x / rms(x) * weight``. ``x``: ``[T, hidden]``."""
    if x.dtype == torch.float32:
        if cpu_kernels.load() is not None:
            y = cpu_kernels.rms_norm(x, weight, eps)  # one pass instead of PyTorch's five ops
            if y is not None:
                return y
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): ``silu(gate) * up`` for ``gate_up [T, 2I]`` (gate first) -> ``[T, I]``."""
    if gate_up.dtype == torch.float32 and cpu_kernels.load() is not None:
        y = cpu_kernels.silu_mul(gate_up)
        if y is not None:
            return y
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LlamaModel:
    """A Llama-family causal LM holding fused weights; stateless apart from the weights.

    Args:
        arch: hyperparameters (``ModelArch``).
        weights: Hugging Face-named tensors (``LoadedModel.weights``); consumed (fused copies are kept).
    """

    def __init__(self, arch: ModelArch, weights: dict):
        self.arch = arch
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.lm_head = Linear(weights.get("lm_head.weight", self.embed))
        self.final_norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(arch.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                dict(
                    attn_norm=weights[p + "input_layernorm.weight"],
                    qkv=Linear(torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])),
                    o=Linear(weights[p + "self_attn.o_proj.weight"]),
                    mlp_norm=weights[p + "post_attention_layernorm.weight"],
                    gate_up=Linear(torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])),
                    down=Linear(weights[p + "mlp.down_proj.weight"]),
                )
            )
        d = arch.head_dim
        self.inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple:
        """Shape of the whole pool: ``[layers, 2, num_blocks, block_size, H_kv, D]``."""
        a = self.arch
        return (a.num_hidden_layers, 2, num_blocks, block_size, a.num_key_value_heads, a.head_dim)

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes over all layers, K and V."""
        a = self.arch
        return 2 * a.num_hidden_layers * block_size * a.num_key_value_heads * a.head_dim * self.embed.element_size()

    def _rope(self, positions: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run the flat batch, writing its K/V into the cache.

        Args:
            input_ids: ``[T]`` int64.
            positions: ``[T]`` int64, absolute position of each token in its sequence.
            kv_cache: ``[layers, 2, num_blocks, block_size, H_kv, D]`` in the model dtype.
            meta: ``AttentionMetadata`` for this batch.
            logits_indices: ``[S]`` int64, flat rows whose next-token logits are wanted.

        Returns:
            ``[S, vocab_size]`` float32 logits.
        """
        a = self.arch
        n_q, n_kv, d = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        scale = d**-0.5
        cos, sin = self._rope(positions)
        h = F.embedding(input_ids, self.embed)
        for i, w in enumerate(self.layers):
            x = rms_norm(h, w["attn_norm"], a.rms_norm_eps)
            qkv = w["qkv"](x)
            qk = self._apply_rope(qkv[:, : (n_q + n_kv) * d].view(-1, n_q + n_kv, d), cos, sin)  # q and k at once
            q, k = qk[:, :n_q], qk[:, n_q:]
            write_kv(kv_cache[i], k, qkv[:, (n_q + n_kv) * d :].view(-1, n_kv, d), meta.slot_mapping)
            attn = paged_attention(q, kv_cache[i], meta, scale)
            h = h + w["o"](attn.reshape(-1, n_q * d))
            x = rms_norm(h, w["mlp_norm"], a.rms_norm_eps)
            h = h + w["down"](silu_mul(w["gate_up"](x)))
        h = rms_norm(h[logits_indices], self.final_norm, a.rms_norm_eps)
        return self.lm_head(h).float()
