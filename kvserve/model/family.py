"""What a model family module declares (``FAMILY``), read by the registry, the config reader and the GGUF loader.

A family is one module (``kvserve/model/<family>.py``) holding its model class (a ``DecoderModel`` with its
``DecoderSpec``: ``kvserve.model.layer_spec``) and one ``Family`` record: its Hugging Face and GGUF architecture
names, the math-changing config fields it implements (every other such field is refused by name:
``hf_config.check_fields``) and its GGUF weight map (llama.cpp's per-layer tensor names -> Hugging Face's, where
they differ from the common table), and the hooks through which the config reader (``hf_config``) and the GGUF
loader (``loader``) read what only this family reads (its windows, RoPE variant, scalars, ``ModelArch`` subclass):
those two readers name no family. ``kvserve.model.registry`` lists the family modules, one line each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from kvserve.model.base import ModelArch
from kvserve.model.layer_spec import ACTIVATIONS


@dataclass(frozen=True)
class Family:
    """One family's declaration.

    Attributes:
        model: the model class (a ``DecoderModel`` subclass).
        config_fields: Hugging Face architecture name -> the math-changing ``config.json`` fields it implements ->
            the values it takes (``None``: any value of the field's type, read by the config reader).
        gguf_architectures: llama.cpp ``general.architecture`` -> the Hugging Face architecture it loads as.
        gguf_layer_names: llama.cpp ``general.architecture`` -> per-layer tensor kinds beyond (or absent from:
            ``None``) the common table (``loader._GGUF_LAYER_NAMES``) -> Hugging Face module names.
        gguf_permuted_qk: the GGUF architectures whose Q/K rows llama.cpp's converter permutes for its
            interleaved RoPE (its rope type "norm"), unpermuted at load.
        experts: a mixture-of-experts family's routing rules (``Experts``); ``None``: a dense family.
        gguf_window_pattern: llama.cpp ``general.architecture`` -> ``n``: its ``<arch>.attention.sliding_window``
            is read instead of refused, and covers every layer but each ``n``-th (llama.cpp's fixed pattern, no GGUF
            key: layer ``i`` is windowed when ``(i + 1) % n``); ``None``: every layer.
        arch_class: the ``ModelArch`` (sub)class both readers build, with the fields only this family reads
            (``GemmaArch``, ``GraniteArch``, ``SmolLM3Arch``).
        config_defaults: Hugging Face architecture -> ``transformers``' defaults of the fields a ``config.json`` may
            leave out where they differ from Llama's (applied under the file's values before anything is read).
        read_config: ``(config, architecture, where) -> dict``: the ``ModelArch`` fields this family reads from a
            Hugging Face config itself (windows, its own fields), over the common reading (``hf_config``); when it
            gives ``rope_theta`` it has read the RoPE too. ``where`` names the file in its errors.
        rope_type_aliases: a config's RoPE type names this family reads as another (Phi-3's ``"su"``).
        text_parts: multimodal Hugging Face architectures whose text model this family runs -> ``TextPart``.
        read_gguf: ``(field, arch, common) -> dict``: the ``ModelArch`` fields this family reads from a GGUF itself
            (``field(key, default)`` reads the metadata; ``arch`` is ``general.architecture``; ``common``: the
            fields read so far, the sizes included), over the common reading (``loader``).
        gguf_keys: llama.cpp ``general.architecture`` -> metadata keys (after ``<arch>.``) the family's
            ``read_gguf`` reads, exempt from the loader's refusal of math-changing keys.
        gguf_model_tensors: llama.cpp ``general.architecture`` -> whole-model tensors beyond the embedding, final
            norm, LM head and ``rope_freqs`` that the loader reads into the RoPE scheme (Phi-3's LongRoPE factors).
        gguf_norms_plus_one: the llama.cpp architectures whose converter stores each RMSNorm weight as ``1 + w``
            (Gemma's): ``w`` is restored at load.
        chat_format: how its conversations become prompts: ``"template"`` (the checkpoint's chat template) or
            ``"harmony"`` (``kvserve.engine.harmony_render``: OpenAI's ``openai-harmony`` package, gpt-oss's).
    """

    model: type
    config_fields: dict
    gguf_architectures: dict = field(default_factory=dict)
    gguf_layer_names: dict = field(default_factory=dict)
    gguf_permuted_qk: tuple = ()
    experts: Optional["Experts"] = None
    gguf_window_pattern: dict = field(default_factory=dict)
    arch_class: type = ModelArch
    config_defaults: dict = field(default_factory=dict)
    read_config: Optional[Callable[[dict, str, str], dict]] = None
    rope_type_aliases: dict = field(default_factory=dict)
    text_parts: dict = field(default_factory=dict)
    read_gguf: Optional[Callable[[Callable, str, dict], dict]] = None
    gguf_keys: dict = field(default_factory=dict)
    gguf_model_tensors: dict = field(default_factory=dict)
    gguf_norms_plus_one: tuple = ()
    chat_format: str = "template"

    def __post_init__(self) -> None:
        unknown = {g: a for g, a in self.gguf_architectures.items() if a not in self.config_fields}
        if unknown:
            raise ValueError(f"GGUF architectures {unknown} load as architectures this family does not declare")
        for name, part in self.text_parts.items():
            if part.architecture not in self.config_fields:
                raise ValueError(f"{name}'s text model {part.architecture} is not an architecture of this family")
        if self.experts is not None and len(self.config_fields) != 1:
            raise ValueError("a mixture-of-experts family declares one Hugging Face architecture")

    @property
    def architectures(self) -> tuple:
        """The Hugging Face architecture names of this family."""
        return tuple(self.config_fields)


@dataclass(frozen=True)
class TextPart:
    """The text model of a multimodal architecture, run on text prompts (the same math as the text model).

    Attributes:
        architecture: the text model's Hugging Face architecture (of the declaring family).
        defaults: ``transformers``' defaults of the fields a Hub ``text_config`` leaves out.
        renames: weight-name prefixes of the text model -> the text model's own (the tensors under none of them,
            the vision tower and projector, are not read).
        ignored: ``text_config`` fields the multimodal class ignores although the text class applies them -> the
            values allowed (a checkpoint setting another is ambiguous, so refused).
    """

    architecture: str
    defaults: dict
    renames: dict
    ignored: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family's router rules, as its reference computes them (read by ``hf_config._moe`` and
    the GGUF loader into ``base.MoEArch``).

    Attributes:
        renormalize: whether the chosen experts' softmax weights are renormalized to sum to 1 (Hugging Face):
            ``True`` / ``False`` always, ``None``: as the config's ``norm_topk_prob`` says (default ``False``).
        gguf: llama.cpp ``general.architecture`` values that, with ``<arch>.expert_count``, load as this family ->
            whether llama.cpp's graph renormalizes (its ``build_moe_ffn`` flag; the file holds no key for it).
        shared_expert: a shared expert every token runs, scaled by a sigmoid gate (Qwen2-MoE's
            ``shared_expert_intermediate_size``).
    """

    renormalize: Optional[bool]
    gguf: dict = field(default_factory=dict)
    shared_expert: bool = False


#: The mixture-of-experts config fields every MoE family reads (``num_experts`` / ``num_local_experts``,
#: ``num_experts_per_tok``); the training-only ones (``router_aux_loss_coef``, ``output_router_logits``,
#: ``router_jitter_noise``) change nothing at inference.
MOE_FIELDS = {"num_experts": None, "num_local_experts": None, "num_experts_per_tok": None}
#: llama.cpp's per-layer mixture-of-experts tensors -> the decoder's names (``*_exps``: the experts stacked,
#: ``[experts, out, in]``); a MoE layer has no dense ``ffn_gate`` / ``ffn_up`` / ``ffn_down``.
GGUF_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                  "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                  "ffn_gate": None, "ffn_up": None, "ffn_down": None}
#: The ``hidden_act`` values every family takes.
ANY_ACTIVATION = {"hidden_act": ACTIVATIONS}
#: Llama's biases (``attention_bias``: Q/K/V and o_proj; ``mlp_bias``), as a config field table.
LLAMA_BIASES = {"attention_bias": (False, True), "mlp_bias": (False, True)}


def layer_types_window(window, types) -> dict:
    """``ModelArch``'s ``sliding_window`` and ``layer_types`` for ``window`` on the ``"sliding_attention"`` layers
    of ``types``; ``{}`` (no window) when ``window`` is 0 / ``None`` or no layer is sliding."""
    if not window or "sliding_attention" not in types:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(types)}


def layer_names(family: Family, gguf_arch: str, common: dict) -> dict:
    """llama.cpp per-layer tensor kind -> Hugging Face module name for ``gguf_arch``: ``common`` with the family's
    own entries over it (``None`` entries removed)."""
    return {k: v for k, v in {**common, **family.gguf_layer_names.get(gguf_arch, {})}.items() if v}

