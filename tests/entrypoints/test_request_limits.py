"""Request bounds (issue 41): each at its limit and just over, model-free where the check is (``RequestLimits``,
``check_json_body``), then over HTTP on the default model: status (400 / 413), ``param`` and the flag named; the
derived prompt bound; text never tokenized or rendered on the engine's thread."""

import json
import threading

import httpx
import pytest

from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai.errors import OpenAIError
from kvserve.entrypoints.openai.limits import RequestLimits, _json_bytes, check_json_body
from tests.entrypoints.conftest import LiveServer

SMOLLM2_LONGEST_TOKEN = 81  # characters: "\n" + 80 spaces
MAX_MODEL_LEN = 64
LIMITS = RequestLimits(max_request_body_bytes=8192, max_stop_strings=4, max_stop_string_chars=16, max_tools=2,
                       max_schema_bytes=512, max_json_depth=8)


def _raises(fn, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        fn(*args)
    return e.value


# ------------------------------------------------------------------------------------------------ model-free
def test_limits_validate_and_derive_the_prompt_bound():
    with pytest.raises(ValueError, match="max_stop_strings"):
        RequestLimits(max_stop_strings=0)
    assert RequestLimits().resolve(8192, 81).max_prompt_chars == 663_552
    assert RequestLimits(max_prompt_chars=10).resolve(8192, 81).max_prompt_chars == 10
    lim = RequestLimits(max_prompt_chars=10)
    lim.check_prompt_chars("x" * 10, "prompt")
    e = _raises(lim.check_prompt_chars, "x" * 11, "prompt[1]")
    assert (e.status, e.param, e.code) == (400, "prompt[1]", "context_length_exceeded")
    assert "11 characters" in e.message and "(10, --max-prompt-chars" in e.message


def test_stop_strings_at_and_over():
    LIMITS.check_request(p.CompletionRequest(prompt="hi", stop=["a", "b", "c", "d"]))
    e = _raises(LIMITS.check_request, p.CompletionRequest(prompt="hi", stop=["a", "b", "c", "d", "e"]))
    assert (e.param, e.code) == ("stop", "limit_exceeded") and "5 stop strings" in e.message
    assert "(4, --max-stop-strings)" in e.message
    LIMITS.check_request(p.CompletionRequest(prompt="hi", stop=["x", "y" * 16]))
    e = _raises(LIMITS.check_request, p.CompletionRequest(prompt="hi", stop=["x", "y" * 17]))
    assert e.param == "stop[1]" and "17 characters" in e.message and "--max-stop-string-chars" in e.message
    e = _raises(LIMITS.check_request, p.CompletionRequest(prompt="hi", stop="y" * 17))
    assert e.param == "stop"


def _tool(name: str, n_props: int = 0) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(n_props)}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}}


def test_tools_and_schemas_at_and_over():
    msgs = [{"role": "user", "content": "hi"}]
    LIMITS.check_request(p.ChatCompletionRequest(messages=msgs, tools=[_tool("a"), _tool("b")]))
    e = _raises(LIMITS.check_request, p.ChatCompletionRequest(messages=msgs, tools=[_tool(c) for c in "abc"]))
    assert e.param == "tools" and "3 tools" in e.message and "--max-tools" in e.message
    big = p.ChatTool.model_validate(_tool("f", 20)).model_dump(exclude_none=True)
    size = _json_bytes(big)
    at = RequestLimits(max_schema_bytes=size)
    at.check_request(p.ChatCompletionRequest(messages=msgs, tools=[big]))
    e = _raises(RequestLimits(max_schema_bytes=size - 1).check_request,
                p.ChatCompletionRequest(messages=msgs, tools=[_tool("g"), big]))
    assert e.param == "tools[1]" and f"{size} bytes of JSON" in e.message and "--max-schema-bytes" in e.message
    schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}}
    e = _raises(LIMITS.check_request, p.CompletionRequest(prompt="hi", guided_json=schema))
    assert e.param == "guided_json"
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    e = _raises(LIMITS.check_request, p.ChatCompletionRequest(messages=msgs, response_format=rf))
    assert e.param == "response_format.json_schema"


def _nested(depth: int) -> bytes:
    """A completions body whose deepest array is ``depth`` levels down (the body object is level 1)."""
    return b'{"prompt": "hi", "stop": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_body_checks_say_what_and_where():
    assert check_json_body(_nested(8), LIMITS) is None
    e = check_json_body(_nested(9), LIMITS)
    assert e.code == "json_too_deep" and "deeper than 8 levels (--max-json-depth), first at stop[0][0][0][0][0][0]" \
        in e.message
    e = check_json_body(b"[" * 100_000, LIMITS)  # deeper than the JSON parser's own recursion limit
    assert e.code == "json_too_deep" and "first at character 8" in e.message
    e = check_json_body(b'{"prompt": "caf\xe9"}', LIMITS)  # Latin-1, not UTF-8
    assert e.code == "invalid_utf8" and "byte 0xe9 at byte offset 15" in e.message
    e = check_json_body(b'{"prompt": "hi",\n "n": 1,}', LIMITS)
    assert e.code == "json_invalid" and "at line 2, column 9 (character 25)" in e.message
    assert check_json_body(b'"just a string"', LIMITS) is None  # the route's model refuses it, naming the field


# ------------------------------------------------------------------------------------------------ over HTTP



@pytest.fixture(scope="module")
def server():
    s = LiveServer(server_kwargs={"limits": LIMITS}, num_kv_blocks=8, max_num_seqs=2,
                   max_model_len=MAX_MODEL_LEN).start()
    yield s
    s.stop()


def _post(server, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) or hasattr(body, "__iter__") and not isinstance(body, dict) \
        else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60,
                      **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.real_model
@pytest.mark.server
def test_body_bytes_at_and_over(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    at = body + b" " * (LIMITS.max_request_body_bytes - len(body))  # JSON allows trailing whitespace
    assert _post(server, "/v1/completions", at).status_code == 200
    err = _error(_post(server, "/v1/completions", at + b" "), 413)
    assert err["code"] == "request_too_large" and "8193 bytes" in err["message"]
    assert "(8192, --max-request-body-bytes)" in err["message"]

    def chunks():  # no Content-Length: counted as it arrives
        yield at
        yield b" "
    err = _error(_post(server, "/v1/completions", chunks()), 413)
    assert "at least 8193 bytes" in err["message"]
    server.llm.engine.kv_cache_manager.check_integrity()


@pytest.mark.real_model
@pytest.mark.server
def test_prompt_chars_derived_from_max_model_len(server):
    limit = MAX_MODEL_LEN * SMOLLM2_LONGEST_TOKEN
    assert server.server.config.app.state.limits.max_prompt_chars == limit == 5184
    at = _error(_post(server, "/v1/completions", {"prompt": "a" * limit}), 400)  # read, tokenized, too many tokens
    assert at["code"] == "context_length_exceeded" and "tokens" in at["message"] and "characters" not in at["message"]
    over = _error(_post(server, "/v1/completions", {"prompt": ["hi", "a" * (limit + 1)]}), 400)
    assert over["param"] == "prompt[1]" and f"{limit + 1} characters" in over["message"]
    assert "--max-prompt-chars" in over["message"]
    chat = _error(_post(server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "a" * (limit + 1)}]}), 400)
    assert chat["param"] == "messages" and "--max-prompt-chars" in chat["message"]
    resp = _error(_post(server, "/v1/responses", {"input": "a" * (limit + 1)}), 400)  # the Responses API's name
    assert resp["param"] == "input" and resp["message"].startswith("input") and "--max-prompt-chars" in resp["message"]
    tok = _error(_post(server, "/tokenize", {"prompt": "a" * (limit + 1)}), 400)
    assert tok["param"] == "prompt"


@pytest.mark.real_model
@pytest.mark.server
def test_field_bounds_over_http(server):
    ok = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "stop": ["a", "b", "c", "d"]})
    assert ok.status_code == 200
    err = _error(_post(server, "/v1/completions", {"prompt": "hi", "stop": list("abcde")}), 400)
    assert err["param"] == "stop" and "--max-stop-strings" in err["message"]
    tools = [_tool(c) for c in "abc"]
    err = _error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": tools}), 400)
    assert err["param"] == "tools" and "--max-tools" in err["message"]


@pytest.mark.real_model
@pytest.mark.server
def test_unparseable_bodies_say_what_and_where(server):
    err = _error(_post(server, "/v1/completions", b'{"prompt": "caf\xe9"}'), 400)
    assert err["code"] == "invalid_utf8" and "byte 0xe9 at byte offset 15" in err["message"]
    err = _error(_post(server, "/v1/completions", _nested(9)), 400)
    assert err["code"] == "json_too_deep" and "first at stop[0]" in err["message"]
    err = _error(_post(server, "/v1/chat/completions", b'{"messages": [}'), 400)
    assert err["code"] == "json_invalid" and "line 1, column 15" in err["message"]


@pytest.mark.real_model
@pytest.mark.server
def test_text_is_never_tokenized_or_rendered_on_the_engine_thread(server):
    tok = server.llm.tokenizer
    threads = []

    def spy(name):
        original = getattr(tok, name)

        def wrapper(*a, **kw):
            threads.append(threading.current_thread().name)
            return original(*a, **kw)
        return wrapper

    tok.encode, tok.apply_chat_template = spy("encode"), spy("apply_chat_template")
    try:
        assert _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1}).status_code == 200
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert r.status_code == 200
    finally:
        del tok.encode, tok.apply_chat_template
    assert len(threads) >= 3 and not [t for t in threads if t.startswith("kvserve-engine")], threads
