"""The decoder forward over the paged KV cache, for every family: the one Python layer loop, interpreting the
model's ``DecoderSpec`` (``kvserve.model.layer_spec``): RMSNorm in the spec's placement, RoPE (rotate-half, with
the family's scaling: ``kvserve.layers.rotary``; per-layer tables, NoPE layers), GQA with per-layer windows and
soft-caps, Q/K norms, a gated MLP (SwiGLU, or GELU-gated), optional biases on every projection, the family's
scalars, attention sinks.

One call runs a flat batch mixing whole prompts, prompt chunks and decode tokens (``InputBatch``) and returns
logits only for the rows that will be sampled. Q/K/V and gate/up projections are fused into one matmul each,
which matters on a CPU where every op has a fixed cost; for the same reason attention after the Q/K/V projection is
one backend call per layer and each residual add is fused with the norm after it. Every op runs through the
backends chosen at start-up (``ModelBackends``: attention, linear methods, element-wise ops); this module imports
no kernel. When the CPU kernels take the whole step, the C loop (``kvserve.model.fused_layers``) runs the same spec
with the same result, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from kvserve.attention.kv_layout import pool_bytes
from kvserve.batch import InputBatch
from kvserve.layers.moe import MoE, ExpertMLP
from kvserve.layers.rotary import RopeTable, rope_frequencies
from kvserve.model.backends import ModelBackends
from kvserve.model.base import ModelArch
from kvserve.model.fused_layers import FusedLayerLoop
from kvserve.model.layer_spec import DecoderSpec, llama_spec

#: Per-layer norm weights of Llama's layout (the role -> the name after ``model.layers.<i>.``).
LLAMA_NORMS = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
               "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}


class DecoderModel:
    """A decoder-only causal LM holding fused weights; stateless apart from the weights (implements ``CausalLM``).
    A family module subclasses it with its ``spec`` (and, where its names differ from Llama's, ``LAYER_NORMS``).

    Args:
        arch: hyperparameters (``ModelArch``).
        weights: Hugging Face-named tensors (``LoadedModel.weights``), read only: float tensors, or GGUF
            ``QuantTensor`` blocks for projections and the embedding (kept quantized; the embedding then decodes
            only the looked-up rows).
        backends: attention backend, linear method factory and element-wise ops; with ``backends.parallel`` set,
            the model is one tensor-parallel rank's shard (``num_heads`` / ``num_kv_heads`` of the heads, its slice
            of the KV pool; o_proj and down_proj end in an all-reduce, the LM head is gathered to rank 0).

    Attributes:
        spec: the ``DecoderSpec`` the layer loops run.
        num_heads, num_kv_heads: attention and KV heads computed here (all of them when not sharded).
        intermediate_size: MLP width computed here.

    Raises:
        ValueError: a Q/K/V bias the spec needs is missing; the config declares an o_proj or MLP bias the weights
            lack, or the weights hold one it does not declare; a norm weight the spec needs is missing (named);
            attention sinks the spec needs missing or not ``[num_attention_heads]``;
            a tensor-parallel size that does not divide the heads, KV heads, ``intermediate_size`` or
            ``vocab_size``, or tensor parallelism with whole-projection Q/K norms or o_proj / MLP biases.
    """

    #: role -> weight name after ``model.layers.<i>.`` of the per-layer norms (``attn_norm``, ``mlp_norm``,
    #: ``post_attn_norm``, ``post_mlp_norm``, ``q_norm``, ``k_norm``) the spec may use.
    LAYER_NORMS = LLAMA_NORMS

    @classmethod
    def spec(cls, arch: ModelArch) -> DecoderSpec:
        """The family's ``DecoderSpec`` for ``arch`` (here: Llama's, with what ``arch`` turns on)."""
        return llama_spec(arch)

    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], backends: ModelBackends):
        self.arch = arch
        self.spec = spec = self.spec(arch)
        self.backends = backends
        self.attn = backends.attention.for_head_dim(arch.head_dim)  # decided once, for this model
        self.ops = backends.ops
        tp = backends.tp_size  # a shard of the model when > 1: whole heads per rank, Megatron-style splits
        if tp > 1:
            arch.check_tensor_parallel_size(tp)
            if any(s.qk_norm == "proj" for s in spec.layers):
                raise ValueError(f"tensor_parallel_size={tp} is not supported for {arch.architecture}: its Q/K "
                                 f"norms span every head; use 1")
            if any(s.mlp == "moe" for s in spec.layers):
                raise ValueError(f"tensor_parallel_size={tp} is not supported for {arch.architecture}: a "
                                 f"mixture-of-experts model runs on one rank; use 1")
        self.num_heads, self.num_kv_heads = arch.num_attention_heads // tp, arch.num_key_value_heads // tp
        self.intermediate_size = arch.intermediate_size // tp  # this rank's share of the MLP
        column, row = backends.column_linear, backends.row_linear
        self._check_norms(weights)
        self.final_norm = self._norm_weight(weights["model.norm.weight"])
        self.dtype = weights["model.norm.weight"].dtype  # activations and KV cache (quantized weights: float32)
        embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight", embed)
        self.lm_head = column([head], gather_output=True, what="lm_head")
        # replicated on every rank (a lookup: no matmul to split); a tied head may serve its rows
        self.embed = backends.make_embedding(embed, self.lm_head if head is embed else None)
        self.embed_scale = spec.embedding_multiplier
        if spec.embedding_multiplier_in_dtype:  # transformers rounds Gemma's normalizer to the model's dtype
            self.embed_scale = float(torch.tensor(spec.embedding_multiplier, dtype=self.dtype))
        self.layers = []
        for i, s in enumerate(spec.layers):
            p = f"model.layers.{i}."
            bias_names = [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
            has_bias = spec.qkv_bias or bias_names[0] in weights
            missing = [n for n in bias_names if n not in weights] if has_bias else []
            if missing:
                raise ValueError(f"{arch.architecture} needs Q/K/V biases; missing {missing}")
            o_bias = _declared_bias(weights, [p + "self_attn.o_proj.bias"], spec.o_bias, "attention_bias")
            moe = s.mlp == "moe"
            mlp = [] if moe else _declared_bias(weights, [p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")],
                                                spec.mlp_bias, "mlp_bias")
            if tp > 1 and (o_bias or mlp):
                raise ValueError("tensor parallelism does not take o_proj or MLP biases yet")
            norms = {role: self._norm_weight(weights[p + name]) for role, name in self._norm_names(s).items()}
            self.layers.append(dict(
                qkv=column([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], what=p + "qkv_proj"),
                qkv_bias=backends.column_bias([weights[n] for n in bias_names]) if has_bias else None,
                o=row(weights[p + "self_attn.o_proj.weight"], what=p + "o_proj"),
                o_bias=o_bias[0] if o_bias else None,
                gate_up=None if moe else column([weights[p + "mlp.gate_proj.weight"],
                                                 weights[p + "mlp.up_proj.weight"]], what=p + "gate_up_proj"),
                gate_up_bias=torch.cat(mlp[:2]) if mlp else None,
                down=None if moe else row(weights[p + "mlp.down_proj.weight"], what=p + "down_proj"),
                moe=self._moe(weights, p) if moe else None,
                down_bias=mlp[2] if mlp else None,
                **{role: norms.get(role) for role in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm")},
                qk_norm=[norms["q_norm"], norms["k_norm"]] if s.qk_norm != "none" else None,
                sinks=self._sinks(weights, p) if spec.attention_sinks else None,
            ))
        self.rope_tables = []
        for r in spec.ropes:
            inv_freq, attention_scaling = rope_frequencies(arch.head_dim, r.theta, r.scaling)
            self.rope_tables.append(RopeTable(inv_freq, self.dtype, attention_scaling))
        self.inv_freq = self.rope_tables[0].inv_freq
        # The whole layer loop in one C call for steps the CPU kernels take whole (None: the Python loop, decided
        # once in select_backends and FusedLayerLoop.build).
        self.fused_layers = FusedLayerLoop.build(self)

    # ------------------------------------------------------------------------------------------------ weights

    def _moe(self, weights: dict, p: str) -> MoE:
        """The mixture-of-experts MLP of the layer with prefix ``p`` (``kvserve.layers.moe``), from Hugging Face
        (Qwen-MoE's) names: the router ``mlp.gate.weight`` ``[E, hidden]``; each expert's
        ``mlp.experts.<e>.{gate,up,down}_proj.weight``, or the experts stacked as ``mlp.experts.{gate,up,down}_proj
        .weight`` (``[E, out, in]``: a 3-D float tensor, or a stacked GGUF ``QuantTensor``: each expert a view of
        its blocks); with ``spec.shared_expert``, ``mlp.shared_expert.{gate,up,down}_proj.weight`` and
        ``mlp.shared_expert_gate.weight`` ``[1, hidden]``; with ``spec.expert_bias`` (gpt-oss), ``mlp.gate.bias``
        ``[E]`` and ``mlp.experts.{gate,up,down}_proj.bias`` ``[E, out]``. Family modules rename their
        checkpoints' tensors into these names.

        Raises:
            ValueError: a tensor missing (named)."""
        column, row, spec = self.backends.column_linear, self.backends.row_linear, self.spec

        def get(name):
            if name not in weights:
                raise ValueError(f"{self.arch.architecture} needs {name}; missing")
            return weights[name]

        def expert(kind, e):
            w = weights.get(f"{p}mlp.experts.{e}.{kind}_proj.weight")
            if w is not None:
                return w
            w = get(f"{p}mlp.experts.{kind}_proj.weight")
            return w.expert(e) if hasattr(w, "expert") else w[e]

        def bias(kind, e):  # gpt-oss: each expert's biases, stacked [E, out]
            return get(f"{p}mlp.experts.{kind}_proj.bias")[e].float() if spec.expert_bias else None

        def mlp(prefix, gate, up, down, e=None):
            gate_up_bias = None if e is None or not spec.expert_bias else torch.cat([bias("gate", e), bias("up", e)])
            return ExpertMLP(column([gate, up], what=prefix + "gate_up_proj"), row(down, what=prefix + "down_proj"),
                             spec.expert_activation if e is not None else "silu", gate_up_bias,
                             None if e is None else bias("down", e), spec.expert_alpha, spec.expert_limit)

        experts = [mlp(f"{p}mlp.experts.{e}.", expert("gate", e), expert("up", e), expert("down", e), e)
                   for e in range(spec.router.num_experts)]
        shared = gate = None
        if spec.shared_expert:
            q = p + "mlp.shared_expert."
            shared = mlp(q, get(q + "gate_proj.weight"), get(q + "up_proj.weight"), get(q + "down_proj.weight"))
            g = get(p + "mlp.shared_expert_gate.weight")
            gate = column([g.reshape(1, -1) if g.dim() == 1 else g], what=p + "shared_expert_gate")
        router = column([get(p + "mlp.gate.weight")], what=p + "router")
        router_bias = get(p + "mlp.gate.bias").float() if spec.expert_bias else None
        return MoE(router, spec.router, experts, router_bias=router_bias, shared_expert=shared, shared_gate=gate)

    def _sinks(self, weights: dict, p: str) -> torch.Tensor:
        """The attention-sink logits ``self_attn.sinks`` ``[H_q]`` of the layer with prefix ``p``, float32
        contiguous (gpt-oss).

        Raises:
            ValueError: missing, or not one per attention head."""
        name = p + "self_attn.sinks"
        if name not in weights:
            raise ValueError(f"{self.arch.architecture} needs {name}; missing")
        sinks = weights[name].float().contiguous()
        if tuple(sinks.shape) != (self.arch.num_attention_heads,):
            raise ValueError(f"{name} must be [{self.arch.num_attention_heads}], got {list(sinks.shape)}")
        return sinks

    def _norm_names(self, s) -> dict:
        """role -> weight name (after the layer prefix) of the norms layer spec ``s`` reads."""
        roles = (["attn_norm", "mlp_norm"] if s.pre_norms else []) + (
            ["post_attn_norm", "post_mlp_norm"] if s.post_norms else []) + (
            ["q_norm", "k_norm"] if s.qk_norm != "none" else [])
        return {role: self.LAYER_NORMS[role] for role in roles}

    def _check_norms(self, weights: dict) -> None:
        """Raise ``ValueError`` naming the norm weights the spec needs and ``weights`` lacks."""
        missing = [f"model.layers.{i}.{name}" for i, s in enumerate(self.spec.layers)
                   for name in self._norm_names(s).values() if f"model.layers.{i}.{name}" not in weights]
        if missing:
            raise ValueError(f"{self.arch.architecture} needs these norm weights; missing {missing[:4]}")

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        """A norm's scale as the loops use it: ``w``, or ``norm_offset + w`` in float32 (Gemma)."""
        return w.float() + self.spec.norm_offset if self.spec.norm_offset else w

    # ----------------------------------------------------------------------------------------------- KV cache

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the whole pool (this rank's heads): ``[layers, 2, num_blocks, block_size, H_kv, D]``."""
        a = self.arch
        return (a.num_hidden_layers, 2, num_blocks, block_size, self.num_kv_heads, a.head_dim)

    def bytes_per_block(self, block_size: int, kv_cache_dtype: Optional[torch.dtype] = None) -> int:
        """Bytes one KV block takes over all layers, K and V (on this rank), in ``kv_cache_dtype`` (default: the
        model's dtype; ``kv_layout.pool_bytes``: int8 counts its scales)."""
        return pool_bytes(self.kv_cache_shape(1, block_size), kv_cache_dtype or self.dtype)

    # ---------------------------------------------------------------------------------------------- forward

    def ropes(self, batch: InputBatch) -> list:
        """cos and sin of the batch's positions for each RoPE table of the spec, each ``[T, 1, D]``
        (``RopeTable``; no position reaches a request's ``seq_len``), and last the identity rotation (cos 1,
        sin 0: NoPE layers rotate by it, ``x * 1 - y * 0`` is ``x`` bit for bit) when a layer has no RoPE."""
        end = max(batch.context_lens)
        out = [t(batch.positions, end) for t in self.rope_tables]
        if any(s.rope is None for s in self.spec.layers):
            out.append((torch.ones_like(out[0][0]), torch.zeros_like(out[0][1])))
        return out

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
        spec = self.spec
        ropes = self.ropes(batch)
        # one metadata per RoPE table: a backend may cache per-step state keyed on the rope it saw
        metas = [self.attn.build_metadata(batch) for _ in ropes]
        h = self.embed(batch.input_ids)  # the residual stream: a fresh tensor, updated in place by add_rms_norm
        if self.embed_scale != 1.0:
            h = h * self.embed_scale
        x = None  # the final norm of every row, when the fused loop ran the step
        if self.fused_layers is not None and metas[0].whole_step_in_kernel:  # the attention backend's decision
            x = self.fused_layers(h, batch, metas[0], ropes, kv_cache)
        every_row = batch.logits_rows_are_all()  # a decode step: no gather (each torch call costs here)
        if x is None:
            h = self._layer_loop(h, batch, metas, ropes, kv_cache)
            x = self._norm(h if every_row else h[batch.logits_indices], self.final_norm)
        elif not every_row:
            x = x[batch.logits_indices]
        logits = self.lm_head(x)
        if spec.logits_divisor != 1.0:
            logits = logits / spec.logits_divisor
        if spec.final_logit_softcap is not None:
            logits = torch.tanh(logits / spec.final_logit_softcap) * spec.final_logit_softcap
        return logits if logits.dtype == torch.float32 else logits.float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x [N, H]`` with ``weight [H]`` (``ops.rms_norm``; with a ``norm_offset``, outside
        float32: computed in float32 as ``transformers`` computes Gemma's, in ``x``'s dtype)."""
        eps = self.arch.rms_norm_eps
        if x.dtype == torch.float32 or not self.spec.norm_offset:
            return self.ops.rms_norm(x, weight, eps)
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, out: torch.Tensor):
        """``(h + delta, _norm(h + delta))``; ``h`` may be updated in place (``ops.add_rms_norm``)."""
        if h.dtype == torch.float32 or not self.spec.norm_offset:
            return self.ops.add_rms_norm(h, delta, weight, self.arch.rms_norm_eps, out)
        h = h + delta
        return h, self._norm(h, weight)

    def _qk_norm(self, qkv: torch.Tensor, kind: str, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """``qkv [T, (H_q + 2 H_kv) D]`` with the queries and keys RMS-normed -- every head over its ``D`` values
        (``kind`` "head": weights ``[D]``; Qwen3, Gemma 3) or each projection over its ``H D`` (``"proj"``: weights
        ``[H_q D]``, ``[H_kv D]``; OLMo 2) -- values unchanged: a new ``[T, (H_q + 2 H_kv) D]`` tensor."""
        t, d = qkv.shape[0], self.arch.head_dim
        nq, nk = self.num_heads * d, self.num_kv_heads * d
        if kind == "head":  # (contiguous: a single head's slice reshapes to a strided view, which the kernel
            # norm does not take -- PyTorch's would round differently from the C loop's)
            q = self._norm(qkv[:, :nq].reshape(-1, d).contiguous(), q_norm).view(t, nq)
            k = self._norm(qkv[:, nq: nq + nk].reshape(-1, d).contiguous(), k_norm).view(t, nk)
        else:
            q = self._norm(qkv[:, :nq].contiguous(), q_norm)
            k = self._norm(qkv[:, nq: nq + nk].contiguous(), k_norm)
        return torch.cat([q, k, qkv[:, nq + nk:]], dim=1)

    def _sublayer_out(self, y: torch.Tensor, bias: Optional[torch.Tensor], res: float,
                      post_norm: Optional[torch.Tensor]) -> torch.Tensor:
        """A sub-layer's output ``y [T, hidden]`` as it enters the residual stream: plus its bias, times the
        residual multiplier, through its post-norm (each only where the layer has it)."""
        if bias is not None:
            y = y + bias
        if res != 1.0:
            y = y * res
        return y if post_norm is None else self._norm(y, post_norm)

    def _layer_loop(self, h: torch.Tensor, batch: InputBatch, metas: list, ropes: list,
                    kv_cache: torch.Tensor) -> torch.Tensor:
        """Every decoder layer on the residual stream ``h [T, hidden]`` (updated in place where the ops allow), as
        the spec says (``kvserve.model.layer_spec``); returns the last layer's output, before the final norm."""
        a, spec, n_q = self.arch, self.spec, self.num_heads
        scale, res, act = spec.attention_scale, spec.residual_multiplier, spec.activation
        layers, caches = self.layers, kv_cache.unbind(0)  # each layer's [2, num_blocks, block_size, H_kv, D] view
        # Buffers the backends may write each layer's norm, attention and MLP outputs into (each is read only by
        # the projection right after it, so one per step serves every layer; backends that cannot, ignore them).
        t, dt = batch.num_tokens, self.dtype
        x_buf, attn_buf = torch.empty(t, a.hidden_size, dtype=dt), torch.empty(t, n_q * a.head_dim, dtype=dt)
        act_buf = torch.empty(t, self.intermediate_size, dtype=dt)
        x = self._norm(h, layers[0]["attn_norm"]) if spec.layers[0].pre_norms else h
        for i, (w, s) in enumerate(zip(layers, spec.layers)):
            qkv = w["qkv"](x)
            if w["qkv_bias"] is not None:
                qkv = qkv + w["qkv_bias"]
            if s.qk_norm != "none":
                qkv = self._qk_norm(qkv, s.qk_norm, *w["qk_norm"])
            r = len(ropes) - 1 if s.rope is None else s.rope
            attn = self.attn.forward_qkv(qkv, n_q, caches[i], metas[r], ropes[r], batch, scale, attn_buf,
                                         sliding_window=s.window, logit_softcap=s.attn_softcap, sinks=w["sinks"])
            o = self._sublayer_out(w["o"](attn), w["o_bias"], res, w["post_attn_norm"])
            if s.pre_norms:
                h, x = self._add_norm(h, o, w["mlp_norm"], x_buf)
            else:
                h = x = h + o
            if w["moe"] is not None:  # float32 rows in, float32 out (kvserve.layers.moe)
                down = w["moe"](x).to(dt)
            else:
                gate_up = w["gate_up"](x)
                if w["gate_up_bias"] is not None:
                    gate_up = gate_up + w["gate_up_bias"]
                down = w["down"](self.ops.act_mul(gate_up, act, act_buf))
            down = self._sublayer_out(down, w["down_bias"], res, w["post_mlp_norm"])
            if i + 1 < len(layers) and spec.layers[i + 1].pre_norms:
                h, x = self._add_norm(h, down, layers[i + 1]["attn_norm"], x_buf)
            else:
                h = x = h + down
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
