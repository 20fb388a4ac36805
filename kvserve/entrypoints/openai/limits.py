"""Request bounds of the server (issue 41): what one request may ask of it, checked before any costly work, so
one huge request cannot stall the other streams.

``RequestLimits`` holds the bounds (each a ``kvserve serve`` flag: ``add_args``); ``RequestBodyMiddleware`` (pure
ASGI) reads a body up to ``max_request_body_bytes`` (a 413 past it) and refuses, with a 400 that says what and
where, a body that is not UTF-8, not JSON, or nests deeper than ``max_json_depth``; ``check_request`` bounds the
fields (stop strings, tools, schemas) and ``check_prompt_chars`` a prompt's characters before it is tokenized
(both ``RequestLimits`` methods, called by ``serving_engine.OpenAIServing``).

The prompt bound is derived from ``max_model_len``: every token of the vocabulary stands for at most
``longest_token_chars`` characters (81 for SmolLM2), so a text longer than ``max_model_len`` times that has more
than ``max_model_len`` tokens whatever it says, and is refused without tokenizing it; no prompt that fits is ever
refused. The stop-string count follows vLLM (``VLLM_MAX_STOP_STRINGS``, 4, OpenAI's limit too) and the tool count
OpenAI (128).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, field, fields
from typing import Optional

from kvserve.entrypoints.openai.errors import OpenAIError, content_type_hint, error_response
from kvserve.validation import check_int


def _bound(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class RequestLimits:
    """Bounds on one HTTP request (every field is a ``kvserve serve`` flag of the same name).

    Attributes:
        max_request_body_bytes: largest request body, bytes (413 past it).
        max_prompt_chars: longest prompt text, characters, checked before tokenizing (a completions prompt, each
            of a list; a chat conversation's content and its rendered template). ``None``: ``max_model_len`` x the
            vocabulary's longest token (``resolve``).
        max_stop_strings: most ``stop`` strings in a request (vLLM's and OpenAI's 4).
        max_stop_string_chars: longest ``stop`` string, characters.
        max_tools: most ``tools`` in a chat request (OpenAI's 128).
        max_schema_bytes: largest tool definition, JSON schema, regex, grammar or choice list, as compact JSON
            bytes (each is compiled or rendered per request).
        max_json_depth: deepest nesting of arrays and objects in a body.
    """

    max_request_body_bytes: int = _bound(16 * 2**20, "largest request body in bytes; larger: 413 (default: 16 MiB)")
    max_prompt_chars: Optional[int] = _bound(None, "longest prompt in characters, checked before tokenizing (default: "
                                                   "max_model_len x the vocabulary's longest token)")
    max_stop_strings: int = _bound(4, "most stop strings in a request (default: 4, as vLLM and OpenAI)")
    max_stop_string_chars: int = _bound(1024, "longest stop string in characters (default: 1024)")
    max_tools: int = _bound(128, "most tools in a chat request (default: 128, as OpenAI)")
    max_schema_bytes: int = _bound(64 * 1024, "largest tool, JSON schema, regex, grammar or choice list, in bytes of "
                                              "compact JSON (default: 65536)")
    max_json_depth: int = _bound(64, "deepest nesting of arrays and objects in a request body (default: 64)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                check_int(f.name, value, 1)

    def resolve(self, max_model_len: int, longest_token_chars: int) -> "RequestLimits":
        """A copy with ``max_prompt_chars`` derived when unset: ``max_model_len * longest_token_chars``."""
        if self.max_prompt_chars is not None:
            return self
        return RequestLimits(**{**vars(self), "max_prompt_chars": max_model_len * longest_token_chars})

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Raises ``OpenAIError`` (400, ``param``) if ``text`` is longer than ``max_prompt_chars``: it has more
        tokens than ``max_model_len`` (see the module's docstring), so it is refused before it is tokenized."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise OpenAIError(f"{param}: the prompt has {len(text)} characters, more than this server reads "
                              f"({limit}, --max-prompt-chars: more tokens than max_model_len whatever the text)",
                              param=param, code="context_length_exceeded")

    def check_request(self, req) -> None:
        """The bounds on a completions or chat request's fields: ``stop`` (count, length), ``tools`` (count, size
        of each), and the size of ``response_format``'s schema and of each ``guided_*`` value.

        Raises:
            OpenAIError: 400 naming the field (``param``: ``stop``, ``stop[2]``, ``tools[0]``, ...) and the limit.
        """
        self.check_stop(getattr(req, "stop", None))
        tools = getattr(req, "tools", None) or []
        if len(tools) > self.max_tools:
            raise _too_many("tools", len(tools), self.max_tools, "max-tools", "tools")
        specs = [(f"tools[{i}]", t.model_dump(exclude_none=True)) for i, t in enumerate(tools)]
        rf = getattr(req, "response_format", None)
        if rf is not None and rf.json_schema is not None:
            specs.append(("response_format.json_schema", rf.json_schema.model_dump(exclude_none=True)))
        specs += [(name, getattr(req, name)) for name in ("guided_json", "guided_regex", "guided_choice",
                                                          "guided_grammar") if getattr(req, name, None) is not None]
        for param, value in specs:
            size = _json_bytes(value)
            if size > self.max_schema_bytes:
                raise _too_many("bytes of JSON", size, self.max_schema_bytes, "max-schema-bytes", param)

    def check_stop(self, given, param: str = "stop") -> None:
        """The stop-string bounds (count, length) of ``given`` (a string, a list or ``None``). Raises
        ``OpenAIError`` (400, ``param`` / ``param[i]``)."""
        stop = [given] if isinstance(given, str) else (given or [])
        if len(stop) > self.max_stop_strings:
            raise _too_many("stop strings", len(stop), self.max_stop_strings, "max-stop-strings", param)
        for i, s in enumerate(stop):
            if len(s) > self.max_stop_string_chars:
                at = param if isinstance(given, str) else f"{param}[{i}]"
                raise _too_many("characters", len(s), self.max_stop_string_chars, "max-stop-string-chars", at)

    def check_tools(self, tools: list, param: str = "tools") -> None:
        """The ``tools`` bounds for an API whose tools are plain JSON (Responses, Messages): count and each one's
        size. Raises ``OpenAIError`` (400, ``param`` / ``param[i]``)."""
        if len(tools) > self.max_tools:
            raise _too_many("tools", len(tools), self.max_tools, "max-tools", param)
        for i, t in enumerate(tools):
            self.check_schema(t, f"{param}[{i}]")

    def check_schema(self, value, param: str) -> None:
        """Raises ``OpenAIError`` (400, ``param``) if ``value`` (a tool, schema, grammar...) is larger than
        ``max_schema_bytes`` as compact JSON."""
        size = _json_bytes(value)
        if size > self.max_schema_bytes:
            raise _too_many("bytes of JSON", size, self.max_schema_bytes, "max-schema-bytes", param)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RequestLimits":
        """The limits given on the command line (``add_args``)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_args(parser: argparse.ArgumentParser) -> None:
    """One ``kvserve serve`` flag per ``RequestLimits`` field (``--max-request-body-bytes``, ...)."""
    g = parser.add_argument_group("request bounds")
    for f in fields(RequestLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                       help=f.metadata["help"].replace("%", "%%"))


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token stands for: the longest piece of the vocabulary (added tokens included).
    A piece is never shorter than its text (byte-level pieces have one character per byte, SentencePiece pieces
    write a space as one character and a fallback byte as six)."""
    return max(map(len, tokenizer.get_vocab()))


def _too_many(what: str, n: int, limit: int, flag: str, param: str) -> OpenAIError:
    return OpenAIError(f"{param}: {n} {what}, more than this server allows ({limit}, --{flag})", param=param,
                       code="limit_exceeded")


def _json_bytes(value) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))


# ------------------------------------------------------------------------------------------------ the body
def _path(parts: list) -> str:
    out = ""
    for x in parts:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out or "the top level"


def _too_deep_at(value, limit: int) -> Optional[str]:
    """The path of the first array or object nested deeper than ``limit`` levels in ``value``, else ``None``
    (an explicit stack: no recursion)."""
    stack = [(value, 1, [])]
    while stack:
        node, depth, path = stack.pop()
        if depth > limit:
            return _path(path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, path + [key]))
    return None


def _offset_too_deep(text: str, limit: int) -> int:
    """The character offset where brackets (outside strings) first nest deeper than ``limit`` in ``text``."""
    depth = 0
    for m in re.finditer(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return m.start()
        elif c in "]}":
            depth -= 1
    return len(text)


def check_json_body(body: bytes, limits: RequestLimits, content_type: Optional[str] = None) -> Optional[OpenAIError]:
    """What is wrong with a JSON request body, and where, as a 400; ``None`` if it is UTF-8 JSON nested at most
    ``max_json_depth`` deep (its meaning is checked later, by the route's model). Text that is not JSON, sent
    without a JSON ``content_type``, gets a hint to send one."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return OpenAIError(f"the request body is not valid UTF-8: byte 0x{body[e.start]:02x} at byte offset {e.start} "
                           f"({e.reason}); send JSON encoded as UTF-8", code="invalid_utf8")
    limit = limits.max_json_depth
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return OpenAIError(f"the request body is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno} "
                           f"(character {e.pos}){content_type_hint(content_type)}", code="json_invalid")
    except RecursionError:
        return OpenAIError(f"the request body nests arrays and objects deeper than {limit} levels (--max-json-depth), "
                           f"first at character {_offset_too_deep(text, limit)}", code="json_too_deep")
    if isinstance(value, (dict, list)):
        where = _too_deep_at(value, limit)
        if where is not None:
            return OpenAIError(f"the request body nests arrays and objects deeper than {limit} levels "
                               f"(--max-json-depth), first at {where[:200]}", code="json_too_deep")
    return None


def _content_type(scope) -> str:
    return next((v for k, v in scope["headers"] if k == b"content-type"), b"").decode("latin-1")


def _wants_json(content_type: str) -> bool:
    """Whether FastAPI will parse a body of this ``Content-Type`` as JSON: none, or a JSON one."""
    return not content_type or not content_type_hint(content_type)


class RequestBodyMiddleware:
    """ASGI middleware: reads the body of every request that has one (``POST``) before the app does, up to
    ``limits.max_request_body_bytes`` (a declared ``Content-Length`` over it is refused before a byte is read):
    413 past it; a JSON body that ``check_json_body`` refuses is a 400. The app then gets the same body.

    Args:
        app: the ASGI app.
        limits: the bounds.
    """

    def __init__(self, app, limits: RequestLimits):
        self.app = app
        self.limits = limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_request_body_bytes
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(int(declared), scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(size, scope, receive, send, at_least=True)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        content_type = _content_type(scope)
        err = check_json_body(body, self.limits, content_type) if body and _wants_json(content_type) else None
        if err is not None:
            await error_response(err, path=scope["path"])(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope, receive, send, at_least: bool = False) -> None:
        limit = self.limits.max_request_body_bytes
        err = OpenAIError(f"the request body has {'at least ' if at_least else ''}{size} bytes, more than this server reads ({limit}, --max-request-body-bytes)", status=413,
                          code="request_too_large")
        await error_response(err, {"Connection": "close"}, path=scope["path"])(scope, receive, send)
