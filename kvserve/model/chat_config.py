"""What a model's files say about chat: its chat template(s) and the tokens that end generation.

End tokens (vLLM's rule, plus the GGUF end-of-turn keys llama.cpp reads):

- a Hugging Face directory: the tokenizer's EOS, and ``eos_token_id`` (an int or a list) of
  ``generation_config.json`` -- or of ``config.json`` when there is no ``generation_config.json``, as
  ``transformers``' ``GenerationConfig.from_model_config`` does (Llama 3.x Instruct lists ``<|end_of_text|>``,
  ``<|eom_id|>`` and ``<|eot_id|>`` there; Gemma ``<eos>`` and ``<end_of_turn>``; Qwen2.5 ``<|im_end|>`` and
  ``<|endoftext|>``);
- a GGUF file: ``tokenizer.ggml.eos_token_id``, ``tokenizer.ggml.eot_token_id`` (end of turn) and
  ``tokenizer.ggml.eom_token_id`` (end of message, Llama 3.1's tool turns) -- ``gguf.Keys.Tokenizer.EOS_ID``,
  ``EOT_ID``, ``EOM_ID`` -- and the converted tokenizer's EOS.

Each id ends a request (``finish_reason`` ``"stop"``, the token kept in ``token_ids`` and left out of the text)
unless ``SamplingParams.ignore_eos``. The tokenizer's own EOS is the primary one (``stop_reason`` ``None``); the
others end it as vLLM's merged ``stop_token_ids`` do (``stop_reason`` = the token id).

Chat templates: ``transformers`` reads a directory's (``tokenizer_config.json``'s ``chat_template``, the
``chat_template.jinja`` file transformers 5 writes, ``chat_templates/*.jinja``) and a GGUF's default
``tokenizer.chat_template``; the GGUF's named ones (``tokenizer.chat_template.<name>``, e.g. ``tool_use``) are added
here. ``load_chat_template`` reads vLLM's ``--chat-template`` value (a file or the template itself).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

#: The GGUF metadata keys whose token ids end generation (``gguf.Keys.Tokenizer`` EOS_ID, EOT_ID, EOM_ID).
GGUF_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
GGUF_CHAT_TEMPLATE = "tokenizer.chat_template"
#: Characters that make a ``--chat-template`` value a template rather than a file name (vLLM's rule).
_TEMPLATE_CHARS = ("{", "}", "\n")


def gguf_declared_end_tokens(fields: dict) -> dict:
    """``{metadata key: token id}`` of the end-token keys a GGUF's (scalar) metadata ``fields`` carries."""
    return {k: fields[k] for k in GGUF_END_KEYS if fields.get(k) is not None}


def hf_declared_end_tokens(path: Path, cfg: dict) -> dict:
    """``{"<file> eos_token_id": int | list}`` from ``generation_config.json`` in ``path``, else from the
    model's ``config.json`` (``cfg``); empty when neither declares one.

    Raises:
        ValueError: ``generation_config.json`` exists and is not a JSON object.
    """
    gen_path = path / "generation_config.json"
    if gen_path.exists():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {str(gen_path)!r}: {e}") from e
        if not isinstance(gen, dict):
            raise ValueError(f"{str(gen_path)!r} must hold a JSON object, got {type(gen).__name__}")
        source, value = "generation_config.json eos_token_id", gen.get("eos_token_id")
    else:
        source, value = "config.json eos_token_id", cfg.get("eos_token_id")
    return {} if value is None else {source: value}


def end_tokens(declared: dict, tokenizer, vocab_size: int, where: str) -> tuple:
    """The primary EOS and every end token, from the files' ``declared`` ids and the tokenizer's EOS.

    Args:
        declared: ``{source: int | list[int]}`` (``gguf_declared_end_tokens`` / ``hf_declared_end_tokens``).
        tokenizer: the model's tokenizer, or ``None`` (a weights-only load: the files' ids alone).
        vocab_size: the model's vocabulary (logit rows); every id must be below it.
        where: the model path, for messages.

    Returns:
        ``(eos_token_id, eos_token_ids)``: the tokenizer's EOS (else the first declared id; ``None`` when there is
        none), and the sorted tuple of every end token (the primary included).

    Raises:
        ValueError: a declared id that is not an integer in ``[0, vocab_size)`` (the message names its source).
    """
    ids = {}
    tok_eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    sources = ({"the tokenizer's eos_token": tok_eos} if tok_eos is not None else {}) | declared
    for source, value in sources.items():
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"{source} in {where}: {t!r} is not a token id in [0, {vocab_size})")
            ids.setdefault(t, source)
    primary = next(iter(ids), None)  # the tokenizer's EOS when there is a tokenizer
    return primary, tuple(sorted(ids))


def describe_end_tokens(eos_token_ids: tuple, tokenizer) -> str:
    """``"2 (<|im_end|>)"``-style text naming each end token, for the start-up log."""
    if not eos_token_ids:
        return "none (only max_tokens, stop strings and stop_token_ids end a request)"
    names = tokenizer.convert_ids_to_tokens(list(eos_token_ids)) if tokenizer is not None else [None] * len(
        eos_token_ids)
    return ", ".join(f"{t} ({n})" if n else str(t) for t, n in zip(eos_token_ids, names))


def gguf_chat_templates(fields: dict):
    """A GGUF's chat template: its ``tokenizer.chat_template`` string, or, when it also carries named ones
    (``tokenizer.chat_template.<name>``), ``{"default": ..., name: ...}`` -- the form ``transformers`` keeps a
    directory's several templates in (``apply_chat_template`` picks ``tool_use`` when given tools and the file has
    one). ``None`` when the file has none."""
    prefix = GGUF_CHAT_TEMPLATE + "."
    named = {k[len(prefix):]: v for k, v in fields.items() if k.startswith(prefix) and isinstance(v, str)}
    default = fields.get(GGUF_CHAT_TEMPLATE)
    if not named:
        return default if isinstance(default, str) else None
    return ({"default": default} if isinstance(default, str) else {}) | named


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """vLLM's ``--chat-template``: the text of the file ``value`` names, or ``value`` itself when it is a template
    (holds ``{``, ``}`` or a newline); ``None`` stays ``None`` (the model's own template is used).

    Raises:
        ValueError: ``value`` names no readable file and is no template, or the template's Jinja syntax is wrong
            (the message names ``chat_template`` and the line).
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template must be a file path or a Jinja template string, got {value!r}")
    path = Path(value).expanduser()
    text = value
    if not any(c in value for c in _TEMPLATE_CHARS):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template {value!r} looks like a file path, but the file cannot be read ({e}); "
                             f"pass a Jinja template file or the template text itself") from None
    import jinja2

    try:  # the syntax only: filters and globals are transformers' own, bound when it renders
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text
