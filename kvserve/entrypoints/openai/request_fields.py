"""vLLM's and OpenAI's newer request fields, from the HTTP request to the engine: ``logit_bias``,
``allowed_token_ids``, ``bad_words``, ``thinking_token_budget`` (``sampling_fields``), ``truncate_prompt_tokens``
(``truncate_prompt``), and the chat template's keyword arguments (``template_kwargs``: ``chat_template_kwargs``,
``reasoning_effort``). Each bad value is an ``OpenAIError`` (400) naming the field.
"""

from __future__ import annotations

from typing import Optional

from kvserve.entrypoints.openai.errors import OpenAIError

#: ``chat_template_kwargs`` keys that the server itself passes to the template (a request cannot override them).
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                            "chat_template", "documents", "return_dict")


def sampling_fields(req, vocab_size: int, default_budget: Optional[int] = None,
                    reasoning_markers: Optional[tuple[str, str]] = None,
                    reasoning_open: Optional[bool] = None) -> dict:
    """``SamplingParams`` keyword arguments of the request's token controls (only those it sets).

    Args:
        req: a completions or chat request (``protocol._SamplingRequest``).
        vocab_size: token ids must be below it.
        default_budget: the server's ``--thinking-token-budget`` for a request that sets none.
        reasoning_markers: the server's reasoning parser's ``(start, end)`` texts (default: ``<think>``'s).
        reasoning_open: the request's parser reads the output as reasoning from its first token
            (``SamplingParams.reasoning_open``); ``None``: the prompt decides.

    Raises:
        OpenAIError: a ``logit_bias`` key that is not a token id of this vocabulary (OpenAI's keys are decimal
            strings), an ``allowed_token_ids`` id outside it (``param`` the field). Value ranges are checked by
            ``SamplingParams``.
    """
    kw: dict = {}
    if req.logit_bias:
        bias = {}
        for key, value in req.logit_bias.items():
            if not key.strip().isdigit() or not 0 <= int(key) < vocab_size:
                raise OpenAIError(f"logit_bias: keys must be token ids in [0, {vocab_size}) as strings, got {key!r}",
                                  param="logit_bias")
            bias[int(key)] = value
        kw["logit_bias"] = bias
    if req.allowed_token_ids is not None:
        bad = [t for t in req.allowed_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"allowed_token_ids must be token ids in [0, {vocab_size}), got {bad[:5]}",
                              param="allowed_token_ids")
        kw["allowed_token_ids"] = req.allowed_token_ids
    if req.bad_words:
        kw["bad_words"] = req.bad_words
    budget = req.thinking_token_budget if req.thinking_token_budget is not None else default_budget
    if budget is not None:
        kw["thinking_token_budget"] = budget
        if reasoning_markers is not None:
            kw["reasoning_markers"] = reasoning_markers
        if reasoning_open is not None:
            kw["reasoning_open"] = reasoning_open
    return kw


def truncate_prompt(token_ids: list[int], k: Optional[int], max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``k`` tokens of the prompt (-1: the last ``max_model_len``);
    ``None`` keeps it whole.

    Raises:
        OpenAIError: ``k`` below -1, 0, or above ``max_model_len``.
    """
    if k is None:
        return token_ids
    if k == -1:
        k = max_model_len
    if not 1 <= k <= max_model_len:
        raise OpenAIError(f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (max_model_len), got {k}",
                          param="truncate_prompt_tokens")
    return token_ids[-k:]


def template_kwargs(req) -> dict:
    """The chat template's extra keyword arguments: ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``)
    and ``reasoning_effort`` (what gpt-oss-style templates read).

    Raises:
        OpenAIError: a key the server passes itself (``RESERVED_TEMPLATE_KWARGS``), or both
            ``add_generation_prompt`` and ``continue_final_message``.
    """
    if req.add_generation_prompt and req.continue_final_message:
        raise OpenAIError("continue_final_message cannot be used with add_generation_prompt=true (the default); set "
                          "add_generation_prompt to false", param="continue_final_message")
    kw = checked_template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    return kw


def checked_template_kwargs(kwargs: Optional[dict]) -> dict:
    """A copy of a request's ``chat_template_kwargs`` (``None``: empty).

    Raises:
        OpenAIError: a key the server passes itself (``RESERVED_TEMPLATE_KWARGS``).
    """
    kw = dict(kwargs or {})
    reserved = sorted(k for k in kw if k in RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise OpenAIError(f"chat_template_kwargs: {reserved[0]!r} is set by the server, not by chat_template_kwargs",
                          param="chat_template_kwargs")
    return kw
