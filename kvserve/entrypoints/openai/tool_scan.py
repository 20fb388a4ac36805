"""Reading tool calls out of a text that grows: the one reader behind both the streamed and the non-streamed
"auto" answer (``tool_parsers.AutoToolStreamer``, ``ToolParser.extract``).

``scan(parser, text, final)`` reads the whole text so far from the start, left to right, and returns its parts in
order: content (``str``) and calls (``ScannedCall``: name and the arguments text read so far). Every decision it
takes depends only on the text before the point where it takes it, and where the text ends before a decision can be
taken the reader stops (``NeedMore``) and holds the rest back. So the parts of a text are a prefix of the parts of
any longer text (the last part possibly shorter), and the streamed pieces (the differences between successive
scans) join to the scan of the whole text: the non-streamed answer (``tests/entrypoints/test_tool_parsers.py``
checks every cut point of every parser's samples).

The rule for a call (docs/server.md, "Tool calls"):

- content flows until one of the parser's markers begins (text that may begin one, and trailing whitespace, is
  held back); a ``lead_markers`` format reads its calls only when the output opens with one;
- a call is *committed* once its name and the start of its arguments are read (the JSON formats: ``{"name": ...,
  "arguments": {``; Mistral's ``name[ARGS]{``; pythonic: its first keyword argument, or its ``)``). From then on it
  is a call, and its arguments stream as the model writes them (pythonic: one JSON fragment per keyword argument);
- text that stops fitting the format before a commit is content (the marker included); after a commit, the
  committed call keeps the arguments read up to that point (a prefix of a JSON object when cut or broken) and
  the text from there on is content again.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvserve.entrypoints.openai.reasoning_parsers import held_suffix


class NeedMore(Exception):
    """The text ends before the reader can decide (a growing text: wait for more)."""


class NoFit(Exception):
    """The text does not fit the format here."""


@dataclass
class ScannedCall:
    """A committed call: ``name`` and its ``arguments`` text so far."""

    name: str
    arguments: str = ""


Part = Union[str, ScannedCall]
_WS = " \t\n\r"


class Reader:
    """A position in the text being scanned, with the parts read so far.

    Attributes:
        text: the whole text so far; ``final``: whether it is complete (the choice finished).
        pos: where reading continues; ``mark``: where content resumes if a committed region stops fitting.
        parts: the scan's parts (calls are appended by ``commit``); ``committed``: whether this region committed.
        cache: per-scan-owner memo (``JsonPrefix`` states by position), so a growing text is checked once.
    """

    def __init__(self, text: str, pos: int, final: bool, parts: list, cache: dict):
        self.text, self.pos, self.final, self.parts, self.cache = text, pos, final, parts, cache
        self.mark = pos
        self.committed = False

    def eof(self) -> bool:
        """True at the end of a final text; raises ``NeedMore`` at the end of a growing one."""
        if self.pos < len(self.text):
            return False
        if self.final:
            return True
        raise NeedMore

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1

    def accept(self, s: str) -> bool:
        """Read ``s`` if the text continues with it; ``NeedMore`` if it may (a growing text ends in its prefix)."""
        if self.text.startswith(s, self.pos):
            self.pos += len(s)
            return True
        rest = self.text[self.pos:]
        if not self.final and len(rest) < len(s) and s.startswith(rest):
            raise NeedMore
        return False

    def expect(self, s: str) -> None:
        if not self.accept(s):
            raise NoFit

    def word(self, ok) -> str:
        """The run of characters ``ok(ch)`` accepts from ``pos`` (``NeedMore`` if it reaches a growing text's
        end); ``NoFit`` if empty."""
        i = self.pos
        while i < len(self.text) and ok(self.text[i]):
            i += 1
        if i == len(self.text) and not self.final:
            raise NeedMore
        if i == self.pos:
            raise NoFit
        out, self.pos = self.text[self.pos:i], i
        return out

    def commit(self, name: str, arguments: str = "") -> ScannedCall:
        call = ScannedCall(name, arguments)
        self.parts.append(call)
        self.committed = True
        return call


def scan(parser, text: str, final: bool, cache: Optional[dict] = None) -> list[Part]:
    """The parts of ``text`` under ``parser``'s format (see the module docstring).

    Args:
        parser: a ``tool_parsers.ToolParser`` (``markers``, ``lead_markers``, ``read_calls(reader)``).
        text: everything generated so far; ``final``: the choice has ended (nothing is held back).
        cache: a dict kept across the scans of one growing text (``None``: a fresh one): JSON checks by position,
            and where settled content ends, so each scan reads only the text after it (linear in all).
    """
    cache = {} if cache is None else cache
    parts: list[Part] = []
    pos, skip, after_call = 0, -1, False
    lead = bool(parser.lead_markers)
    if "resume" in cache:  # a growing text: everything before this point is settled content and calls
        pos, settled = cache["resume"]
        parts, lead = list(settled), False
    while True:
        start = -1
        if lead:
            lead = False
            body = len(text) - len(text.lstrip())
            if body == len(text) and not final:
                return parts  # only whitespace yet: the output may still open with a call
            if body < len(text) and text[body] in parser.lead_markers:
                start = body
        if start < 0:
            hits = [_find(text, m, pos, skip) for m in parser.markers]
            start = min((i for i in hits if i >= 0), default=-1)
        if start < 0:
            if final:
                rest = text[pos:]
                _add_text(parts, "" if after_call and not rest.strip() else rest)
                return parts
            end = len(text) - (held_suffix(text[pos:], parser.markers) if parser.markers else 0)
            cut = pos + len(parser.content_before_call(text[pos:end]))
            _add_text(parts, text[pos:cut])
            if cut > max(pos, skip):  # no marker can begin before ``cut``: a later scan starts there
                cache["resume"] = (cut, list(parts))
            return parts
        seg = pos + len(parser.content_before_call(text[pos:start]))
        _add_text(parts, text[pos:seg])
        reader = Reader(text, start, final, parts, cache)
        n = len(parts)
        try:
            parser.read_calls(reader)
        except NeedMore:
            return parts
        except NoFit:
            if reader.committed:
                pos, skip, after_call = reader.mark, reader.mark, True
            else:  # the region is content (the whitespace before it too); its marker is text
                del parts[n:]
                pos, skip = seg, start
            continue
        pos, skip, after_call = reader.pos, -1, True


def _find(text: str, marker: str, pos: int, skip: int) -> int:
    i = text.find(marker, pos)
    return text.find(marker, skip + 1) if i == skip >= 0 else i


def _add_text(parts: list, text: str) -> None:
    if not text:
        return
    if parts and isinstance(parts[-1], str):
        parts[-1] += text
    else:
        parts.append(text)


# ---------------------------------------------------------------------------------------------------- JSON
_NUM = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUM_PREFIX = re.compile(r"-?(?:0|[1-9]\d*)?(?:\.\d*)?(?:[eE][+-]?\d*)?")
_LITERALS = ("true", "false", "null")


class JsonPrefix:
    """Checks, one character at a time, that a text is a prefix of one JSON value (RFC 8259's grammar, a
    pushdown automaton): ``step(ch)`` is ``False`` at the first character that cannot continue it; ``done`` once the
    value is complete. ``upto``: the absolute position of the next character to check (kept by the caller)."""

    __slots__ = ("stack", "mode", "tok", "esc", "uni", "done", "failed", "upto")

    def __init__(self, upto: int):
        self.stack: list[str] = []
        self.mode, self.tok, self.esc, self.uni = "value", "", False, 0
        self.done = self.failed = False
        self.upto = upto

    def _value_done(self) -> None:
        if self.stack:
            self.mode = "after"
        else:
            self.mode, self.done = "done", True

    def step(self, ch: str) -> bool:
        m = self.mode
        if m in ("string", "key"):
            if self.esc:
                self.esc = False
                if ch == "u":
                    self.uni = 4
                    return True
                return ch in '"\\/bfnrt'
            if self.uni:
                self.uni -= 1
                return ch in "0123456789abcdefABCDEF"
            if ch == "\\":
                self.esc = True
            elif ch == '"':
                if m == "key":
                    self.mode = "colon"
                else:
                    self._value_done()
            elif ord(ch) < 0x20:
                return False
            return True
        if m == "number":
            if ch in "0123456789+-.eE":
                self.tok += ch
                return _NUM_PREFIX.fullmatch(self.tok) is not None
            if not _NUM.fullmatch(self.tok):
                return False
            self._value_done()
            return self.done is False and self.step(ch)
        if m == "literal":
            self.tok += ch
            if self.tok in _LITERALS:
                self._value_done()
                return True
            return any(w.startswith(self.tok) for w in _LITERALS)
        if ch in _WS:
            return m != "done"
        if m in ("value", "value_or_close"):
            if ch == "]" and m == "value_or_close":
                self.stack.pop()
                self._value_done()
            elif ch == "{":
                self.stack.append("{")
                self.mode = "key_or_close"
            elif ch == "[":
                self.stack.append("[")
                self.mode = "value_or_close"
            elif ch == '"':
                self.mode = "string"
            elif ch == "-" or ch.isdigit():
                self.mode, self.tok = "number", ch
            elif ch in "tfn":
                self.mode, self.tok = "literal", ch
            else:
                return False
            return True
        if m in ("key_or_close", "key_expect"):
            if ch == "}" and m == "key_or_close":
                self.stack.pop()
                self._value_done()
                return True
            if ch == '"':
                self.mode = "key"
                return True
            return False
        if m == "colon":
            if ch == ":":
                self.mode = "value"
                return True
            return False
        if m == "after":
            top = self.stack[-1]
            if ch == ",":
                self.mode = "key_expect" if top == "{" else "value"
                return True
            if ch == ("}" if top == "{" else "]"):
                self.stack.pop()
                self._value_done()
                return True
        return False


def json_value(r: Reader, call: Optional[ScannedCall] = None) -> int:
    """Read one JSON value at ``r.pos``; returns its end (and moves there). With ``call``, the value is that call's
    arguments: every character read goes into ``call.arguments`` as it is read (the streamed fragments), and
    ``r.mark`` is where the arguments stop. ``NoFit`` at the first character that cannot continue the value (or at
    the end of a final text); ``NeedMore`` at a growing text's end."""
    start, text = r.pos, r.text
    v = r.cache.get(("json", start))
    if v is None:
        v = r.cache[("json", start)] = JsonPrefix(start)
    while not (v.done or v.failed) and v.upto < len(text):
        if v.step(text[v.upto]):
            v.upto += 1
        else:
            v.failed = True
    if call is not None:
        call.arguments = text[start:v.upto]
        r.mark = v.upto
    if v.done:
        r.pos = v.upto
        return v.upto
    if v.failed or r.final:
        raise NoFit
    raise NeedMore


#: ``{"name": "...", "arguments" | "parameters": {`` — the part of a JSON call object that commits it
_HEADER = re.compile(r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*("(?:[^"\\]|\\.)*")[ \t\n\r]*,[ \t\n\r]*'
                     r'"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*\{')


def json_call(r: Reader) -> None:
    """One ``{"name": str, "arguments": object}`` call object (``parameters`` accepted too). When the name comes
    first and the arguments are an object, the call commits at the arguments' ``{`` and they stream; otherwise the
    whole object is read first and committed whole if it is a call (``call_from_obj``)."""
    if r.eof() or r.text[r.pos] != "{":
        raise NoFit
    start = r.pos
    if _recall(r, start):
        return
    m = _HEADER.match(r.text, r.pos)
    if m is not None:
        try:
            name = json.loads(m.group(1))
        except ValueError:
            raise NoFit from None
        r.pos = m.end() - 1
        call = r.commit(name)
        json_value(r, call)
        r.ws()
        if not r.accept("}"):
            raise NoFit
    else:
        end = json_value(r)
        found = call_from_obj(json.loads(r.text[start:end]))
        if found is None:
            raise NoFit
        call = r.commit(*found)
    r.mark = r.pos
    r.cache[("call", start)] = (call.name, call.arguments, r.pos)


def _recall(r: Reader, start: int) -> bool:
    """Commit the call completed at ``start`` in an earlier scan of the same growing text (its end is settled),
    if there is one; ``True`` if so."""
    done = r.cache.get(("call", start))
    if done is None:
        return False
    r.commit(done[0], done[1])
    r.pos = r.mark = done[2]
    return True


def call_from_obj(obj: Any) -> Optional[tuple[str, str]]:
    """``{"name": str, "arguments": object}`` (``arguments`` may be a JSON text of an object; ``parameters``, Llama
    3's key, accepted too) -> ``(name, arguments JSON)``, else ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def json_call_list(r: Reader) -> None:
    """``[call, call, ...]`` (``json_call`` each; at least one)."""
    r.ws()
    r.expect("[")
    while True:
        r.ws()
        json_call(r)
        if not _list_goes_on(r):
            return


def _list_goes_on(r: Reader) -> bool:
    """After a list's element: ``True`` past a ``,`` (and whitespace), ``False`` past the closing ``]``;
    ``r.mark`` moves past either. ``NoFit`` on anything else."""
    r.ws()
    if r.accept(","):
        r.ws()
        r.mark = r.pos
        return True
    r.expect("]")
    r.mark = r.pos
    return False


# ---------------------------------------------------------------------------------------------------- pythonic
def python_call_list(r: Reader) -> None:
    """``[f(a=1, b="x"), g()]``: keyword arguments whose values are Python literals. A call commits with its first
    keyword argument (``{"a": 1``) or its ``)`` (``{}``); each later argument adds ``, "b": "x"`` and the ``)``
    adds ``}`` (values converted to JSON, ``json.dumps``)."""
    r.ws()
    r.expect("[")
    while True:
        r.ws()
        start = r.pos
        if _recall(r, start):
            if not _list_goes_on(r):
                return
            continue
        name = r.word(lambda ch: ch.isalnum() or ch == "_")
        if not name.isidentifier():
            raise NoFit
        r.ws()
        r.expect("(")
        call, keys = None, set()
        while True:
            r.ws()
            if r.accept(")"):
                if call is None:
                    call = r.commit(name, "{}")
                else:
                    call.arguments += "}"
                r.cache[("call", start)] = (call.name, call.arguments, r.pos)
                break
            key = r.word(lambda ch: ch.isalnum() or ch == "_")
            if not key.isidentifier() or key in keys:
                raise NoFit
            keys.add(key)
            r.ws()
            r.expect("=")
            value = _python_literal(r)
            piece = json.dumps(key) + ": " + value
            if call is None:
                call = r.commit(name, "{" + piece)
            else:
                call.arguments += ", " + piece
            if r.accept(","):
                r.ws()
                r.mark = r.pos
        r.mark = r.pos
        if not _list_goes_on(r):
            return


def _python_literal(r: Reader) -> str:
    """The literal at ``r.pos`` up to the ``,`` or ``)`` that ends it (left unread), as JSON."""
    text = r.text
    i, depth, quote, esc = r.cache.get(("literal", r.pos), (r.pos, 0, None, False))
    while i < len(text):
        ch = text[i]
        if quote:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                if ch != ")":
                    raise NoFit
                break
            depth -= 1
        elif ch == "," and depth == 0:
            break
        i += 1
    else:
        if not r.final:
            r.cache[("literal", r.pos)] = (i, depth, quote, esc)  # the next scan goes on from here
            raise NeedMore
        raise NoFit
    try:
        value = json.dumps(ast.literal_eval(text[r.pos:i].strip()), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise NoFit from None
    r.pos = i
    return value
