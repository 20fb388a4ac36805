"""Llama-family decoder forward over the paged KV cache: RMSNorm, RoPE (rotate-half, with the family's scaling:
``kvserve.layers.rotary``), GQA, a gated MLP (SwiGLU, or GELU-gated), optional biases on every projection.

One call runs a flat batch mixing whole prompts, prompt chunks and decode tokens (``InputBatch``) and returns
logits only for the rows that will be sampled. Q/K/V and gate/up projections are fused into one matmul each,
which matters on a CPU where every op has a fixed cost; for the same reason attention after the Q/K/V projection is
one backend call per layer and each residual add is fused with the norm after it. Every op runs through the
backends chosen at start-up (``ModelBackends``: attention, linear methods, element-wise ops); this module imports
no kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvserve.attention.kv_layout import pool_bytes
from kvserve.model.backends import ModelBackends
from kvserve.layers.rotary import RopeTable, rope_frequencies
from kvserve.model.base import ModelArch
from kvserve.model.fused_layers import FusedLayerLoop
from kvserve.batch import InputBatch


class LlamaModel:
    """A Llama-family causal LM holding fused weights; stateless apart from the weights (implements ``CausalLM``).

    Args:
        arch: hyperparameters (``ModelArch``).
        weights: Hugging Face-named tensors (``LoadedModel.weights``), read only: float tensors, or GGUF
            ``QuantTensor`` blocks for projections and the embedding (kept quantized; the embedding then decodes
            only the looked-up rows).
        backends: attention backend, linear method factory and element-wise ops; with ``backends.parallel`` set,
            the model is one tensor-parallel rank's shard (``num_heads`` / ``num_kv_heads`` of the heads, its slice
            of the KV pool; o_proj and down_proj end in an all-reduce, the LM head is gathered to rank 0).

    Attributes:
        num_heads, num_kv_heads: attention and KV heads computed here (all of them when not sharded).
        intermediate_size: MLP width computed here.

    Raises:
        ValueError: ``qkv_bias`` is set and a Q/K/V bias is missing; the config declares an o_proj or MLP bias the
            weights lack, or the weights hold one it does not declare; a tensor-parallel size that does not divide
            the heads, KV heads, ``intermediate_size`` or ``vocab_size``.
    """

    #: Q, K and V projections carry a bias (Qwen2); also set when the weights include them.
    qkv_bias = False

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], backends: ModelBackends):
        self.arch = arch
        self.backends = backends
        self.attn = backends.attention.for_head_dim(arch.head_dim)  # decided once, for this model
        self.ops = backends.ops
        tp = backends.tp_size  # a shard of the model when > 1: whole heads per rank, Megatron-style splits
        if tp > 1:
            arch.check_tensor_parallel_size(tp)
        self.num_heads, self.num_kv_heads = arch.num_attention_heads // tp, arch.num_key_value_heads // tp
        self.intermediate_size = arch.intermediate_size // tp  # this rank's share of the MLP
        column, row = backends.column_linear, backends.row_linear
        self.final_norm = weights["model.norm.weight"]
        self.dtype = self.final_norm.dtype  # activations and KV cache (quantized weights compute in float32)
        embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight", embed)
        self.lm_head = column([head], gather_output=True, what="lm_head")
        # replicated on every rank (a lookup: no matmul to split); a tied head may serve its rows
        self.embed = backends.make_embedding(embed, self.lm_head if head is embed else None)
        self.layers = []
        for i in range(arch.num_hidden_layers):
            p = f"model.layers.{i}."
            bias_names = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            has_bias = self.qkv_bias or arch.attention_bias or bias_names[0] in weights
            missing = [n for n in bias_names if n not in weights] if has_bias else []
            if missing:
                raise ValueError(f"{arch.architecture} needs Q/K/V biases; missing {missing}")
            o_bias = _declared_bias(weights, [p + "self_attn.o_proj.bias"], arch.o_proj_bias, "attention_bias")
            mlp = _declared_bias(weights, [p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")], arch.mlp_bias,
                                 "mlp_bias")
            qk_norm = [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"] if arch.qk_norm else []
            if any(n not in weights for n in qk_norm):
                raise ValueError(f"{arch.architecture} needs per-head Q/K norms; missing {qk_norm}")
            if tp > 1 and (o_bias or mlp):
                raise ValueError("tensor parallelism does not take o_proj or MLP biases yet")
            self.layers.append(
                dict(
                    attn_norm=weights[p + "input_layernorm.weight"],
                    qkv=column([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], what=p + "qkv_proj"),
                    qkv_bias=backends.column_bias([weights[n] for n in bias_names]) if has_bias else None,
                    o=row(weights[p + "self_attn.o_proj.weight"], what=p + "o_proj"),
                    o_bias=o_bias[0] if o_bias else None,
                    mlp_norm=weights[p + "post_attention_layernorm.weight"],
                    gate_up=column([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]],
                                   what=p + "gate_up_proj"),
                    gate_up_bias=torch.cat(mlp[:2]) if mlp else None,
                    down=row(weights[p + "mlp.down_proj.weight"], what=p + "down_proj"),
                    down_bias=mlp[2] if mlp else None,
                    qk_norm=[weights[n] for n in qk_norm] or None,
                )
            )
        self.inv_freq, attention_scaling = rope_frequencies(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.rope_table = RopeTable(self.inv_freq, self.dtype, attention_scaling)
        # The whole layer loop in one C call for steps the CPU kernels take whole (None: the backends run the Python
        # loop, decided once in select_backends).
        self.fused_layers = FusedLayerLoop.build(self)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the whole pool (this rank's heads): ``[layers, 2, num_blocks, block_size, H_kv, D]``."""
        a = self.arch
        return (a.num_hidden_layers, 2, num_blocks, block_size, self.num_kv_heads, a.head_dim)

    def bytes_per_block(self, block_size: int, kv_cache_dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over all layers, K and V (on this rank), in ``kv_cache_dtype`` (default: the
        model's dtype; ``kv_pool.pool_bytes``)."""
        return pool_bytes(self.kv_cache_shape(1, block_size), kv_cache_dtype or self.dtype)  # int8: scales too

    def _rope(self, batch: InputBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the batch's positions, each ``[T, 1, D]`` (``RopeTable``; no position reaches a
        request's ``seq_len``)."""
        return self.rope_table(batch.positions, max(batch.context_lens))

    @torch.inference_mode()
    def forward(self, batch: InputBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the flat batch, writing its K/V into the cache.

        Per layer: attention from the fused Q/K/V projection in one backend call (``AttentionBackend.forward_qkv``:
        RoPE, K/V write, attention), and each residual add fused with the norm after it (``add_rms_norm``). When
        the CPU kernels take the whole step, the layer loop is one C call (``fused_layers``), with the same result.

        Args:
            batch: the step's ``InputBatch`` (``T`` tokens).
            kv_cache: ``[layers, 2, num_blocks, block_size, H_kv, D]`` in the model dtype or the engine's
                ``kv_cache_dtype``.

        Returns:
            ``[S, vocab_size]`` float32 logits of the rows ``batch.logits_indices`` (``S`` of them); on a
            tensor-parallel rank other than 0, ``[S, vocab_size / tp]`` (its own vocabulary slice).
        """
        meta = self.attn.build_metadata(batch)
        rope = self._rope(batch)
        h = self.embed(batch.input_ids)  # the residual stream: a fresh tensor, updated in place by add_rms_norm
        if self.arch.embedding_multiplier != 1.0:
            h = h * self.arch.embedding_multiplier
        x = None  # the final norm of every row, when the fused loop ran the step
        if self.fused_layers is not None and meta.whole_step_in_kernel:  # the attention backend's decision
            x = self.fused_layers(h, batch, meta, rope, kv_cache)
        every_row = batch.logits_rows_are_all()  # a decode step: no gather (each torch call costs here)
        if x is None:
            h = self._layer_loop(h, batch, meta, rope, kv_cache)
            x = self.ops.rms_norm(h if every_row else h[batch.logits_indices], self.final_norm, self.arch.rms_norm_eps)
        elif not every_row:
            x = x[batch.logits_indices]
        logits = self.lm_head(x)
        if self.arch.logits_scaling != 1.0:
            logits = logits / self.arch.logits_scaling
        return logits if logits.dtype == torch.float32 else logits.float()

    def _qk_norm(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """``qkv [T, (H_q + 2 H_kv) D]`` with every query and key head RMS-normed over its ``D`` values (weights
        ``q_norm``, ``k_norm`` ``[D]``; Qwen3), values unchanged: a new ``[T, (H_q + 2 H_kv) D]`` tensor."""
        t, d, nq, nk = qkv.shape[0], self.arch.head_dim, self.num_heads, self.num_kv_heads
        q = self._norm(qkv[:, : nq * d].reshape(t * nq, d), q_norm).view(t, nq * d)
        k = self._norm(qkv[:, nq * d: (nq + nk) * d].reshape(t * nk, d), k_norm).view(t, nk * d)
        return torch.cat([q, k, qkv[:, (nq + nk) * d:]], dim=1)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x [N, H]`` with ``weight [H]`` (``ops.rms_norm``; a family may compute it its own way)."""
        return self.ops.rms_norm(x, weight, self.arch.rms_norm_eps)

    def _layer_loop(self, h: torch.Tensor, batch: InputBatch, meta, rope: tuple, kv_cache: torch.Tensor) -> torch.Tensor:
        """Every decoder layer on the residual stream ``h [T, hidden]`` (updated in place where the ops allow);
        returns the last layer's output, before the final norm."""
        a, n_q, eps = self.arch, self.num_heads, self.arch.rms_norm_eps
        scale, res = a.attention_scale, a.residual_multiplier
        layers, caches = self.layers, kv_cache.unbind(0)  # each layer's [2, num_blocks, block_size, H_kv, D] view
        uses_rope = a.no_rope_layers or (1,) * len(layers)
        # a layer without RoPE rotates by the identity: x * 1 - y * 0 is x, bit for bit (SmolLM3's NoPE layers)
        no_rope = None if all(uses_rope) else (torch.ones_like(rope[0]), torch.zeros_like(rope[1]))
        # Buffers the backends may write each layer's norm, attention and SwiGLU outputs into (each is read only by
        # the projection right after it, so one per step serves every layer; backends that cannot, ignore them).
        t, f32 = batch.num_tokens, self.dtype
        x_buf, attn_buf = torch.empty(t, a.hidden_size, dtype=f32), torch.empty(t, n_q * a.head_dim, dtype=f32)
        act_buf = torch.empty(t, self.intermediate_size, dtype=f32)
        x = self.ops.rms_norm(h, layers[0]["attn_norm"], eps)
        for i, w in enumerate(layers):
            qkv = w["qkv"](x)
            if w["qkv_bias"] is not None:
                qkv = qkv + w["qkv_bias"]
            if w["qk_norm"] is not None:
                qkv = self._qk_norm(qkv, *w["qk_norm"])
            attn = self.attn.forward_qkv(qkv, n_q, caches[i], meta, rope if uses_rope[i] else no_rope, batch, scale,
                                         attn_buf, sliding_window=a.layer_window(i),
                                         logit_softcap=a.attn_logit_softcapping)
            o = w["o"](attn)
            if w["o_bias"] is not None:
                o = o + w["o_bias"]
            if res != 1.0:
                o = o * res
            h, x = self.ops.add_rms_norm(h, o, w["mlp_norm"], eps, x_buf)
            gate_up = w["gate_up"](x)
            if w["gate_up_bias"] is not None:
                gate_up = gate_up + w["gate_up_bias"]
            down = w["down"](self.ops.act_mul(gate_up, a.hidden_act, act_buf))
            if w["down_bias"] is not None:
                down = down + w["down_bias"]
            if res != 1.0:
                down = down * res
            if i + 1 < len(layers):
                h, x = self.ops.add_rms_norm(h, down, layers[i + 1]["attn_norm"], eps, x_buf)
            else:
                h = h + down
        return h


def _declared_bias(weights: dict, names: list[str], declared: bool, field: str) -> list:
    """The bias tensors ``names`` when the config declares them (``field``), else ``[]``.

    Raises:
        ValueError: declared but missing, or present but not declared (either would silently change the math)."""
    present = [n for n in names if n in weights]
    if declared and len(present) < len(names):
        raise ValueError(f"the config sets {field}=true but the weights lack {sorted(set(names) - set(present))}")
    if not declared and present:
        raise ValueError(f"the weights hold {present} but the config does not set {field}=true")
    return [weights[n] for n in names] if declared else []
