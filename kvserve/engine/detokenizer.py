"""Incremental detokenization with stop strings.

Decoding one token at a time breaks multi-byte UTF-8 characters (an emoji is often 2-4 byte-level BPE tokens)
and tokenizers that merge across tokens. So, as in vLLM, two offsets into the output ids are kept: the text of
``ids[prefix_offset:]`` minus the text of ``ids[prefix_offset:read_offset]`` is the new text, and it is taken
only when it does not end in U+FFFD (an incomplete character); otherwise the token waits for the next one.

Stop strings are searched in the text only around the newly added part (a match may span token boundaries).
While a request runs, the last ``max(len(stop)) - 1`` characters are held back from the deltas, so a stream never
shows the beginning of a stop string that is cut later. The deltas concatenate exactly to the final text.
"""

from __future__ import annotations

from typing import Optional

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens as they arrive.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        stop: stop strings (may be empty).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer, stop=(), include_stop_str_in_output=False, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.num_emitted_chars = 0
        self.stopped = False

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> Optional[str]:
        """Append one token; returns the stop string if one now appears in the text (the text is cut there)."""
        if self.stopped:
            return None
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._append_text(full[len(prefix) :])

    def flush(self) -> None:
        """At the end of the request: take any text still waiting for more bytes (it may contain U+FFFD)."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            self.read_offset = len(self.token_ids)
            if len(full) > len(prefix):
                self._append_text(full[len(prefix) :])

    def _append_text(self, new: str) -> Optional[str]:
        start = max(0, len(self.text) - self.holdback)
        self.text += new
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped = True
        return s

    def take_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless ``finished``."""
        end = len(self.text) if finished or self.stopped else max(self.num_emitted_chars, len(self.text) - self.holdback)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
