"""Per-request edits of the logits before sampling, in vLLM's order: ``allowed_token_ids`` (all other tokens
``-inf``), ``bad_words`` (the last token of a banned sequence ``-inf`` where the output ends with the rest of it; unless that
would leave no token at all, e.g. every ``allowed_token_ids`` banned: then the ban is lifted for the step),
``logit_bias`` (OpenAI's: the bias added to the token's logit), then the thinking budget
(``kvserve.sample.thinking``). Each row is edited from its own request's fields and tokens only, so the result
does not depend on the batch.
"""

from __future__ import annotations

import torch

from kvserve.sample.thinking import force_thinking_end
from kvserve.validation import ParamError


def apply_logits_edits(logits: torch.Tensor, states: list) -> None:
    """Apply every row's edits in place.

    Args:
        logits: ``[B, V]`` float32 (a copy the sampler owns), row b of ``states[b]``.
        states: ``SamplingState``s; ``params.logit_bias`` / ``allowed_token_ids`` / ``bad_words`` (with the state's
            ``bad_words_token_ids``) / ``thinking``.
    """
    for i, st in enumerate(states):
        sp = st.params
        if sp.allowed_token_ids is not None:
            keep = logits[i, sp.allowed_token_ids].clone()
            logits[i] = float("-inf")
            logits[i, sp.allowed_token_ids] = keep
        if st.bad_words_token_ids:
            banned = banned_tokens(st.bad_words_token_ids, st.output_token_ids)
            if banned:
                kept = logits[i, banned].clone()
                logits[i, banned] = float("-inf")
                if not torch.isfinite(logits[i]).any():  # every allowed token is banned: the allowed ones win
                    logits[i, banned] = kept
        if sp.logit_bias:
            ids = torch.tensor([int(t) for t in sp.logit_bias], dtype=torch.long)
            logits[i, ids] += torch.tensor(list(sp.logit_bias.values()), dtype=logits.dtype)
    force_thinking_end(logits, states)


def banned_tokens(sequences: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens ``bad_words`` ban next: each sequence's last token where the output ends with the sequence's
    other tokens (a one-token sequence: always)."""
    out = []
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix):] == prefix):
            out.append(seq[-1])
    return out


def check_token_ids(sp, vocab_size: int) -> None:
    """Raises ``ParamError`` naming the field for a ``logit_bias`` or ``allowed_token_ids`` id outside
    ``[0, vocab_size)``."""
    for name, ids in (("logit_bias", list(sp.logit_bias or ())), ("allowed_token_ids", sp.allowed_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ParamError.of(name, f": token ids must be in [0, {vocab_size}), got {bad[:5]}")


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as written and with one leading space (how it is tokenized
    inside a sentence), without special tokens; duplicates dropped."""
    out: list[list[int]] = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def reasoning_open_in_prompt(prompt_token_ids: list[int], markers: tuple[str, str], tokenizer,
                             tail_tokens: int = 64) -> bool:
    """Whether the prompt leaves the reasoning open: in the text of its last ``tail_tokens`` tokens the last start
    marker comes after the last end marker (a chat template that writes ``<think>`` into the generation prompt)."""
    text = tokenizer.decode(prompt_token_ids[-tail_tokens:], skip_special_tokens=False)
    start, end = markers
    i = text.rfind(start)
    return i >= 0 and i > text.rfind(end)
