"""Incremental detokenization with stop strings.

Decoding one token at a time breaks multi-byte UTF-8 characters (an emoji is often 2-4 byte-level BPE tokens)
and tokenizers that merge across tokens. So, as in vLLM, two offsets into the output ids are kept: the text of
``ids[prefix_offset:]`` minus the text of ``ids[prefix_offset:read_offset]`` is the new text, and it is taken
only when it does not end in U+FFFD (an incomplete character); otherwise the token waits for the next one.

Stop strings are searched in the text only around the newly added part (a match may span token boundaries).
With ``min_tokens``, a stop string counts only if a token after the first ``min_tokens`` completes it (vLLM's rule,
the same as for EOS and ``stop_token_ids``, which the sampler suppresses until then): the match must end in text
that those later tokens produced. While a request runs, the last ``max(len(stop)) - 1`` characters are held back
from the deltas, so a stream never shows the beginning of a stop string that is cut later. The deltas concatenate
exactly to the final text. A request that ends inside a multi-byte character (cut by ``max_tokens``, say) drops that
incomplete character from its text, as vLLM's detokenizer does; its token ids and logprobs keep the token.
"""

from __future__ import annotations

import json
import re
from typing import Optional

REPLACEMENT_CHAR = "\ufffd"


def rust_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a ``transformers`` fast tokenizer when decoding through it gives the same
    text as ``tokenizer.decode`` (it does unless ``clean_up_tokenization_spaces`` is set), else ``None``.

    ``tokenizer.decode`` spends about 2.5 us per call in Python (argument handling, the clean-up check) around the
    same Rust call; a request decodes twice per token (``add_token``), so at batch 64 that was ~0.3 ms per step.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - transformers' fast tokenizers need it
        return None
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False:
        return None
    return backend


class IncrementalDetokenizer:
    """Detokenizes one request's output tokens as they arrive.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        stop: stop strings (may be empty).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.
        min_tokens: a stop string must be completed by a token after the first ``min_tokens``.
    """

    def __init__(self, tokenizer, stop=(), include_stop_str_in_output=False, skip_special_tokens=True,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.stop_floor = 0  # characters produced by the first min_tokens tokens: no stop string may end there
        self.num_emitted_chars = 0
        self.stopped = False
        self._backend = rust_backend(tokenizer)

    def _decode(self, ids) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
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

    def flush(self) -> Optional[str]:
        """At the end of the request: take the complete characters of any text still waiting for more bytes (an
        incomplete character at the very end, decoded as U+FFFD, is dropped: its bytes never arrived); returns the
        stop string if that text completes one."""
        if not self.stopped and self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :]).rstrip(REPLACEMENT_CHAR)
            self.read_offset = len(self.token_ids)
            if len(full) > len(prefix):
                return self._append_text(full[len(prefix) :])
        return None

    def _append_text(self, new: str) -> Optional[str]:
        old_len = len(self.text)
        self.text += new
        if len(self.token_ids) <= self.min_tokens:  # text of the first min_tokens tokens: never a stop
            self.stop_floor = len(self.text)
            return None
        best = None
        for s in self.stop:
            # the match must end in the new text and after the first min_tokens tokens' text
            i = self.text.find(s, max(0, old_len - len(s) + 1, self.stop_floor - len(s) + 1))
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


# ---------------------------------------------------------------------------------------------------- single tokens
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character that stands for each byte -> the byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (control characters, space, ...) are shifted to
    U+0100 upwards in byte order (so a space is "Ġ", a newline "Ċ").
    """
    printable = [b for b in range(256) if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF]
    shifted = [b for b in range(256) if b not in set(printable)]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenVocab:
    """What one token is, on its own: its raw bytes and a printable name, without decoding it alone.

    Decoding a single byte-level token that holds part of a UTF-8 character gives U+FFFD, so every such token
    would look alike; here the bytes come from the vocabulary itself: byte-level BPE pieces through GPT-2's byte
    alphabet, SentencePiece byte-fallback pieces ``<0xNN>`` as that byte (and "▁" as a space), added and special
    tokens as their UTF-8 text. Distinct ids have distinct bytes, hence distinct names.

    Args:
        tokenizer: a ``transformers`` tokenizer.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        kinds = json.dumps(decoder or {})
        self.byte_level = '"ByteLevel"' in kinds
        self.metaspace = '"Metaspace"' in kinds or '"ByteFallback"' in kinds
        self._alphabet = _byte_level_alphabet()
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes (UTF-8 fragments included); an added or special token's UTF-8 text."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._compute_bytes(token_id)
        return b

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_level and all(ch in self._alphabet for ch in piece):
            return bytes(self._alphabet[ch] for ch in piece)
        if self.metaspace:
            m = _HEX_BYTE.match(piece)
            return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def token_name(self, token_id: int) -> str:
        """The token as text: its bytes decoded as UTF-8, bytes that are no complete character written ``\\xNN``
        (as OpenAI does), e.g. ``"\\xf0\\x9f"`` for the first half of an emoji."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def text_offsets(self, token_ids: list[int], start: int = 0,
                     skip_special_tokens: bool = True) -> tuple[list[int], int]:
        """Character offsets of ``token_ids`` in the text they decode to, counted from ``start``.

        A token's offset is the index of the character its first byte belongs to (a token that continues a
        character started by the previous token shares that character's offset). Special tokens add no text when
        ``skip_special_tokens``. The text is the tokens' own (before any stop string is cut from it).

        Returns:
            ``(offsets, end)``: one offset per token, and the offset after the last one (pass it as ``start`` to
            continue with the next tokens).
        """
        offsets, pos = [], start
        for t in token_ids:
            b = b"" if skip_special_tokens and t in self.special_ids else self.token_bytes(t)
            continues = bool(b) and 0x80 <= b[0] <= 0xBF  # first byte in the middle of a character
            offsets.append(pos - 1 if continues and pos > 0 else pos)
            pos += sum(1 for x in b if not 0x80 <= x <= 0xBF)  # one character starts at each non-continuation byte
        return offsets, pos
