"""Reasoning and tool-call parsers, vLLM's newer request fields, CORS and vLLM's metric names on a live server,
through the ``openai`` client: the model's output is forced to a family's exact text by a regex structured output
(token by token), and the API must return the parsed calls / reasoning, streamed equal to non-streamed."""

import json

import anthropic
import httpx
import openai
import pytest

from kvserve.entrypoints.openai.serving_options import ServingOptions
from tests.entrypoints.conftest import LiveServer
from tests.structured.common import BFCL_DIR, assert_valid, to_json_schema

pytestmark = [pytest.mark.real_model, pytest.mark.server]

KEY = "sk-test"
#: ChatML as SmolLM2 writes it, plus what Qwen3-style templates read: enable_thinking, reasoning_effort
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n"
            "{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris and Rome?"}]


def regex_of(text: str) -> str:
    """A regular expression matching exactly ``text``."""
    return "".join("\\" + ch if ch in ".^$*+?{}[]\\|()" else ch for ch in text)


@pytest.fixture(scope="module")
def features():
    s = LiveServer(num_kv_blocks=256, max_num_seqs=8, max_model_len=2048, chat_template=TEMPLATE, server_kwargs={
        "api_key": KEY, "options": ServingOptions(reasoning_parser="qwen3", enable_auto_tool_choice=True,
                                                  vllm_metric_names=True, allowed_origins=["https://app.example"])})
    yield s.start()
    s.stop()


@pytest.fixture(scope="module")
def client(features):
    return openai.OpenAI(base_url=features.url + "/v1", api_key=KEY, max_retries=0)


def stream(client, **kw):
    """``(reasoning, content, {index: [name, arguments]}, finish_reason)`` joined from a streamed chat."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            extra = d.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            reasoning += extra.get("reasoning_content") or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.function.name  # a call's first piece: id and name
                    calls[t.index] = [t.function.name, ""]
                calls[t.index][1] += t.function.arguments or ""
            finish = ch.finish_reason or finish
    return reasoning or None, content or None, calls, finish


# ---------------------------------------------------------------------------------------------------- tools
CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', ["Paris"]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', ["Paris", "Rome"]),
    "pythonic": ('[get_weather(city="Paris"), get_weather(city="Rome")]', ["Paris", "Rome"]),
    "mistral": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
                ["Paris", "Rome"]),
    "granite": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', ["Paris"]),
    "phi4_mini_json": ('functools[{"name": "get_weather", "arguments": {"city": "Rome"}}]', ["Rome"]),
    "openai": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}',
               ["Paris"]),  # gpt-oss's harmony (plain text to SmolLM2's tokenizer)
}


@pytest.fixture(scope="module", params=sorted(CALLS))
def tool_server(request):
    s = LiveServer(num_kv_blocks=64, max_num_seqs=4, max_model_len=1024, server_kwargs={
        "options": ServingOptions(tool_call_parser=request.param, enable_auto_tool_choice=True)})
    yield request.param, s.start()
    s.stop()


def test_each_family_call_text_is_parsed_into_calls(tool_server):
    name, server = tool_server
    text, cities = CALLS[name]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=server.llm_model_name, messages=ASK, tools=WEATHER, temperature=0, max_tokens=120,
              extra_body={"guided_regex": regex_of(text)})
    choice = c.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    got = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
    assert got == [("get_weather", {"city": city}) for city in cities]
    assert all(t.id.startswith("call_") for t in choice.message.tool_calls)
    reasoning, content, calls, finish = stream(c, **kw)
    assert (reasoning, content, finish) == (None, None, "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == got


def test_a_malformed_or_cut_call(tool_server):
    """Broken before its arguments begin, a call stays content; cut inside its arguments (after its name went out
    in the stream), it stays a call with the arguments written so far, and the text after it is content: streamed
    equal to non-streamed either way (docs/server.md, "Tool calls")."""
    name, server = tool_server
    text = CALLS[name][0]
    first = text.index("Paris") if "Paris" in text else text.index("Rome")
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    broken = "<tool_call>{bad" if name == "hermes" else text[:text.index("get_weather") + 3]
    inside = text[:first + 2]  # inside the first call's arguments
    for cut, committed in ((broken, False), (inside, True)):
        kw = dict(model=server.llm_model_name, messages=ASK, tools=WEATHER, temperature=0, max_tokens=120,
                  extra_body={"guided_regex": regex_of(cut)})
        choice = c.chat.completions.create(**kw).choices[0]
        if not committed:
            assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (cut, None, "stop")
            assert stream(c, **kw) == (None, cut, {}, "stop")
            continue
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        if name == "pythonic":  # a pythonic call commits with its first complete keyword argument: not yet
            assert (choice.message.content, calls, choice.finish_reason) == (cut, [], "stop")
        else:
            city = CALLS[name][1][0]
            assert (choice.message.content, calls, choice.finish_reason) == (
                None, [("get_weather", '{"city": "' + city[:2])], "tool_calls")
        assert stream(c, **kw) == (None, choice.message.content, {i: list(t) for i, t in enumerate(calls)},
                                   choice.finish_reason)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_in_the_family_format(tool_server, choice):
    """With --tool-call-parser X, "required" and a named function are grammar-enforced in X's own format
    (``ToolParser.choice_constraint``; pythonic: Python literals) and read back by X: the real model's greedy output
    parses into one call valid under the schema, streamed equal to non-streamed, in chat and in Responses."""
    name, server = tool_server
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    tools = WEATHER + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    kw = dict(model=server.llm_model_name, messages=ASK, tools=tools, temperature=0, max_tokens=200,
              tool_choice=choice, parallel_tool_calls=False)
    ch = c.chat.completions.create(**kw).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]
    assert len(calls) == 1 and ch.message.content is None, (name, ch.message)
    fn = next(t["function"] for t in tools if t["function"]["name"] == calls[0][0])
    assert_valid(json.loads(calls[0][1]), fn["parameters"])
    if isinstance(choice, dict):
        assert calls[0][0] == "get_weather"
    assert ch.finish_reason in ("tool_calls", "stop")
    assert stream(c, **kw) == (None, None, {0: list(calls[0])}, ch.finish_reason)
    r = c.responses.create(model=server.llm_model_name, input=ASK[0]["content"], tools=[
        {"type": "function", **t["function"]} for t in tools], tool_choice=choice if choice == "required" else {
        "type": "function", "name": "get_weather"}, temperature=0, max_output_tokens=200, parallel_tool_calls=False)
    got = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    assert len(got) == 1 and got[0][0] in ("get_weather", "get_time"), (name, r.output)


# ---------------------------------------------------------------------------------------------------- reasoning
def test_reasoning_is_separated_and_streamed_equal(features, client):
    kw = dict(model=features.llm_model_name, messages=ASK, temperature=0, max_tokens=60,
              extra_body={"guided_regex": regex_of("<think>The user wants weather.</think>It is sunny.")})
    msg = client.chat.completions.create(**kw).choices[0].message
    extra = msg.model_extra
    assert (extra["reasoning_content"], extra["reasoning"], msg.content) == (
        "The user wants weather.", "The user wants weather.", "It is sunny.")
    assert stream(client, **kw)[:2] == ("The user wants weather.", "It is sunny.")
    hidden = client.chat.completions.create(**kw, ).choices[0].message  # include_reasoning false drops it
    kw["extra_body"]["include_reasoning"] = False
    hidden = client.chat.completions.create(**kw).choices[0].message
    assert "reasoning_content" not in (hidden.model_extra or {}) and hidden.content == "It is sunny."


def test_reasoning_then_a_tool_call(features, client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kw = dict(model=features.llm_model_name, messages=ASK, tools=WEATHER, temperature=0, max_tokens=80,
              extra_body={"guided_regex": regex_of("<think>Call it.</think>" + call)})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.message.model_extra["reasoning_content"] == "Call it."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    reasoning, content, calls, finish = stream(client, **kw)
    assert (reasoning, content, finish, list(calls.values())[0][0]) == ("Call it.", None, "tool_calls",
                                                                        "get_weather")


def test_enable_thinking_false_reaches_the_template_and_turns_the_parser_off(features, client):
    kw = dict(model=features.llm_model_name, messages=ASK, temperature=0, max_tokens=8)
    on = client.chat.completions.create(**kw)
    off = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the template closed an empty <think> in the prompt
    assert on.choices[0].message.model_extra.get("reasoning_content")  # qwen3: thinking on, no </think>: reasoning
    assert on.choices[0].message.content is None
    assert "reasoning_content" not in off.choices[0].message.model_extra and off.choices[0].message.content
    effort = client.chat.completions.create(**kw, reasoning_effort="low")
    assert effort.usage.prompt_tokens > on.usage.prompt_tokens
    counted = httpx.post(features.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=30, json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()["count"]
    assert counted == off.usage.prompt_tokens  # /tokenize renders the template with the same kwargs


def test_thinking_budget_through_the_api(features, client):
    """The prompt opens ``<think>`` (continue_final_message); after 6 reasoning tokens ``</think>`` is forced, the
    answer follows, and the parser splits there."""
    n = 6
    kw = dict(model=features.llm_model_name, temperature=0, max_tokens=20, logprobs=True,
              messages=ASK + [{"role": "assistant", "content": "<think>"}],
              extra_body={"add_generation_prompt": False, "continue_final_message": True, "thinking_token_budget": n})
    choice = client.chat.completions.create(**kw).choices[0]
    tokens = [bytes(t.bytes) for t in choice.logprobs.content]
    end = next(i for i in range(len(tokens)) if b"".join(tokens[n:i + 1]) == b"</think>")
    assert b"</think>" not in b"".join(tokens[:n]) and end > n
    assert choice.message.model_extra["reasoning_content"] == b"".join(tokens[:n]).decode()
    answer = tokens[end + 1:-1] if choice.finish_reason == "stop" else tokens[end + 1:]  # the end token: no text
    assert choice.message.content == b"".join(answer).decode()
    assert stream(client, **kw)[:2] == (choice.message.model_extra["reasoning_content"], choice.message.content)


# ---------------------------------------------------------------------------------------------------- fields
def test_vllm_request_fields(features, client):
    tok = features.llm.tokenizer
    model = features.llm_model_name
    target = tok.encode(" Banana", add_special_tokens=False)[0]
    r = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=3, logprobs=True,
                                       logit_bias={str(target): 100})
    assert bytes(r.choices[0].logprobs.content[0].bytes) == tok.convert_ids_to_tokens(target).replace(
        "\u0120", " ").encode()
    for so, check in (({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                      ({"regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
                      ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
                       lambda t: isinstance(json.loads(t)["a"], int))):
        t = client.completions.create(model=model, prompt="Answer:", temperature=0, max_tokens=20,
                                      extra_body={"structured_outputs": so}).choices[0].text
        assert check(t), (so, t)
    tag = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}, "end": "</f>"}], "triggers": ["<f>"]}
    r = client.completions.create(model=model, prompt="Call f: <f>", temperature=0, max_tokens=12,
                                  extra_body={"structured_outputs": {"structural_tag": tag}})
    assert r.choices[0].finish_reason in ("stop", "length")
    allowed = [tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no")]
    r = client.completions.create(model=model, prompt="Is it?", temperature=1.0, seed=1, max_tokens=5,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    assert set(tok.encode(r.choices[0].text, add_special_tokens=False)) <= set(allowed)
    plain = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
    banned = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4,
                                       extra_body={"bad_words": ["Paris"]})
    assert "Paris" in plain.choices[0].text and "Paris" not in banned.choices[0].text
    cut = client.completions.create(model=model, prompt="one two three four five six seven", max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3


@pytest.mark.parametrize("body,param,words", [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100.0, 100.0]"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "token ids"),
    ({"allowed_token_ids": [99999999]}, "allowed_token_ids", "token ids"),
    ({"bad_words": [""]}, "bad_words", "non-blank"),
    ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens", "max_model_len"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex", "cannot be combined"),
    ({"structured_outputs": {"whitespace": 1}}, "structured_outputs.whitespace", ""),
    ({"thinking_token_budget": 3, "response_format": {"type": "json_object"}}, "thinking_token_budget",
     "structured_outputs"),
    ({"thinking_token_budget": -2}, "thinking_token_budget", ">= 0"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "set by the server"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message", ""),
    ({"reasoning_effort": "max"}, "reasoning_effort", ""),
])
def test_bad_fields_are_400s_naming_the_field(features, body, param, words):
    r = httpx.post(features.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"messages": ASK, "max_tokens": 2, **body}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err


def test_auto_tool_choice_needs_the_flag(server):
    """The main test server runs without --enable-auto-tool-choice: vLLM's 400 naming it."""
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "tools": WEATHER, "max_tokens": 2},
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]
    assert "--tool-call-parser NAME" not in err["message"]  # the template implies the parser: the flag suffices
    r = httpx.post(server.url + "/v1/messages", json={"model": server.llm_model_name, "max_tokens": 2, "tools": [
        {"name": "get_weather", "input_schema": {"type": "object"}}], "messages": ASK}, timeout=60)
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "--enable-auto-tool-choice" in msg, msg
    assert '{"type": "any"}' in msg and '{"type": "none"}' in msg and '"required"' not in msg, msg
    ok = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "tools": WEATHER, "max_tokens": 2,
                                                                "tool_choice": "none"}, timeout=60)
    assert ok.status_code == 200


# ---------------------------------------------------------------------------------------------------- BFCL
def test_bfcl_multi_turn_tools_go_through_the_chat_tool_path(features, client):
    """Every function of every BFCL multi-turn API: accepted and rendered by the chat template (the prompt grows
    by the tools), and a named tool_choice enforced on one function per API (its arguments validate)."""
    if not BFCL_DIR.is_dir():
        pytest.skip(f"BFCL tool schemas not found at {BFCL_DIR}")
    headers = {"Authorization": f"Bearer {KEY}"}
    bare = httpx.post(features.url + "/tokenize", headers=headers, json={"messages": ASK}, timeout=60).json()["count"]
    for path in sorted(BFCL_DIR.glob("*.json")):
        funcs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        tools = [{"type": "function", "function": {"name": f["name"], "description": f["description"][-200:],
                                                   "parameters": to_json_schema(f["parameters"])}} for f in funcs]
        r = httpx.post(features.url + "/tokenize", headers=headers, json={"messages": ASK, "tools": tools},
                       timeout=60)
        assert r.status_code == 200 and r.json()["count"] > bare + 10 * len(tools), (path.name, r.text[:300])
        first = tools[0]["function"]
        choice = client.chat.completions.create(
            model=features.llm_model_name, messages=ASK, tools=tools[:4], temperature=0, max_tokens=64,
            tool_choice={"type": "function", "function": {"name": first["name"]}}).choices[0]
        call = choice.message.tool_calls[0]
        assert call.function.name == first["name"]
        if choice.finish_reason != "length":
            assert_valid(json.loads(call.function.arguments), first["parameters"])


# ---------------------------------------------------------------------------------------------------- CORS, metrics
def test_cors_preflight_passes_and_the_key_still_guards(features, server):
    origin = {"Origin": "https://app.example"}
    pre = httpx.options(features.url + "/v1/chat/completions", timeout=10, headers={
        **origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    no_key = httpx.post(features.url + "/v1/chat/completions", headers=origin, json={"messages": ASK}, timeout=10)
    assert no_key.status_code == 401 and no_key.headers["access-control-allow-origin"] == "https://app.example"
    assert httpx.get(features.url + "/v1/models", headers=origin, timeout=10).status_code == 401
    ok = httpx.get(features.url + "/v1/models", headers={**origin, "Authorization": f"Bearer {KEY}"}, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(features.url + "/v1/models", timeout=10, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers
    off = httpx.options(server.url + "/v1/models", timeout=10, headers={**origin, "Access-Control-Request-Method":
                                                                        "GET"})
    assert "access-control-allow-origin" not in off.headers  # CORS is off by default


VLLM_NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
              "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
              "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_sum",
              "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
              "vllm:request_inference_time_seconds_sum", "vllm:request_success_total",
              "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
              "vllm:request_max_num_generation_tokens_sum", "vllm:prefix_cache_queries_total"]


def _series(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_vllm_metric_names_with_the_same_values(features, client, server):
    client.completions.create(model=features.llm_model_name, prompt="Hello", max_tokens=3, temperature=0)
    series = _series(httpx.get(features.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"},
                               timeout=10).text)
    label = f'model_name="{features.llm_model_name}"'
    for name in VLLM_NAMES:
        assert any(k.startswith(name + "{") and label in k for k in series), name
    for k, v in series.items():
        if k.startswith("kvserve:"):
            assert series["vllm:" + k.removeprefix("kvserve:")] == v, k
    assert series[f"vllm:generation_tokens_total{{{label}}}"] >= 3
    plain = httpx.get(server.url + "/metrics", timeout=10).text
    assert "vllm:" not in plain  # off by default


# ---------------------------------------------------------------------------------------------------- <think> token
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def think_model(tmp_path_factory, tokenizer):
    """A tiny Qwen3-style model (``chat_families``: SmolLM2's tokenizer, random weights) whose vocabulary has
    ``<think>`` and ``</think>`` as added tokens and whose template opens ``<think>`` in the prompt."""
    from tests.entrypoints.chat_families import Family, build, gguf_vocab

    root = tmp_path_factory.mktemp("think_family")
    base = root / "smollm2"
    tokenizer.save_pretrained(str(base))
    fam = Family("qwen3think", (), None, "<|endoftext|>", False, ("<|im_end|>", "<|endoftext|>"), {"eos": "<|im_end|>"},
                 "<|im_end|>", QWEN3_TEMPLATE, "jinja", added_text=("<think>", "</think>"))
    return build(root, base, gguf_vocab(base), fam)


def test_thinking_budget_forces_the_think_token_and_the_parser_splits_there(think_model):
    end_id = think_model.tokenizer.convert_tokens_to_ids("</think>")
    assert think_model.tokenizer.encode("</think>", add_special_tokens=False) == [end_id]  # one token
    s = LiveServer(model=str(think_model.hf_dir), quantization="fp32", num_kv_blocks=64, max_num_seqs=8,
                   max_model_len=256, server_kwargs={"options": ServingOptions(reasoning_parser="qwen3")}).start()
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        for n in (0, 2, 5):
            kw = dict(model=s.llm_model_name, messages=[{"role": "user", "content": "Hi!"}], temperature=0,
                      max_tokens=n + 4, logprobs=True, extra_body={"thinking_token_budget": n, "ignore_eos": True})
            choice = c.chat.completions.create(**kw).choices[0]
            tokens = [t.token for t in choice.logprobs.content]
            assert tokens[n] == "</think>" and "</think>" not in tokens[:n]
            specials = set(think_model.tokenizer.all_special_tokens)  # left out of the text
            assert choice.message.model_extra.get("reasoning_content") == (b"".join(
                bytes(t.bytes) for t in choice.logprobs.content[:n] if t.token not in specials).decode() or None)
            assert stream(c, **kw)[:2] == (choice.message.model_extra.get("reasoning_content"),
                                           choice.message.content)
        off = c.chat.completions.create(model=s.llm_model_name, messages=[{"role": "user", "content": "Hi!"}],
                                        temperature=0, max_tokens=4, extra_body={
                                            "chat_template_kwargs": {"enable_thinking": False}}).choices[0]
        assert "reasoning_content" not in off.message.model_extra  # the template closed the think: all content
        # the other APIs take the same path (the prompt that opened <think> reaches their parser): Messages'
        # thinking.budget_tokens is the budget, Responses' reasoning item is chat's reasoning_content
        hi = [{"role": "user", "content": "Hi!"}]
        ref = c.chat.completions.create(model=s.llm_model_name, messages=hi, temperature=0, max_tokens=6, extra_body={
            "thinking_token_budget": 2, "chat_template_kwargs": {"enable_thinking": True}}).choices[0].message
        m = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0).messages.create(
            model=s.llm_model_name, messages=hi, temperature=0, max_tokens=6,
            thinking={"type": "enabled", "budget_tokens": 2})
        assert "".join(b.thinking for b in m.content if b.type == "thinking") == ref.model_extra["reasoning_content"]
        assert "".join(b.text for b in m.content if b.type == "text") == (ref.content or "")
        no = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0).messages.create(
            model=s.llm_model_name, messages=hi, temperature=0, max_tokens=4)  # no thinking: the prompt closes it
        assert [b.type for b in no.content] == ["text"] and no.content[0].text == off.message.content
        plain = c.chat.completions.create(model=s.llm_model_name, messages=hi, temperature=0,
                                          max_tokens=6).choices[0].message
        r = c.responses.create(model=s.llm_model_name, input="Hi!", temperature=0, max_output_tokens=6)
        assert "".join(part.text for item in r.output if item.type == "reasoning" for part in item.content) == (
            plain.model_extra.get("reasoning_content") or "")
        assert r.output_text == (plain.content or "")
    finally:
        s.stop()
