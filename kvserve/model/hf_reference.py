"""A Hugging Face ``transformers`` model over the same (dequantized) weights: the reference for parity tests and
the ``--compare transformers`` baseline of ``kvserve bench throughput``."""

from __future__ import annotations

from kvserve.model.loader import LoadedModel


def to_hf_model(loaded: LoadedModel):
    """``LlamaForCausalLM`` (eval mode) holding ``loaded``'s weights and architecture."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a = loaded.arch
    cfg = LlamaConfig(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta, max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings, bos_token_id=1, eos_token_id=list(loaded.eos_token_ids),
    )
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(loaded.weights, strict=not a.tie_word_embeddings)
    if a.tie_word_embeddings:
        model.tie_weights()
    return model.to(next(iter(loaded.weights.values())).dtype).eval()
