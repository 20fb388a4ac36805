"""The OpenAI output and input contract, point by point (issue 13, failures 1, 2, 4, 5, 6, 7), on the live server
with the real model; plus the tokenizer routes and ``/version``."""

import json

import httpx
import openai
import pytest

import kvserve

pytestmark = [pytest.mark.real_model, pytest.mark.server]

CHAT = [{"role": "user", "content": "Name a color."}]
EMOJI_CHAT = [{"role": "user", "content": "Write three food emoji."}]
PARIS = "The capital of France is"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def _events(server, path, body) -> list:
    """The JSON objects of a streamed response, in order (``[DONE]`` checked and dropped)."""
    with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


# ------------------------------------------------------------------------------ 1. required-but-nullable fields
@pytest.mark.parametrize("path,body,choice_keys", [
    ("/v1/completions", {"prompt": PARIS, "max_tokens": 5, "temperature": 0, "n": 2},
     {"index", "text", "logprobs", "finish_reason"}),
    ("/v1/completions", {"prompt": PARIS, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": False},
     {"index", "text", "logprobs", "finish_reason"}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "temperature": 0, "n": 2},
     {"index", "delta", "logprobs", "finish_reason"}),
])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunks_carry_finish_reason_null_until_the_last(server, path, body, choice_keys, include_usage):
    body = dict(body, stream=True, **({"stream_options": {"include_usage": True}} if include_usage else {}))
    events = _events(server, path, body)
    per_choice: dict = {}
    for ev in events:
        assert {"id", "object", "created", "model", "choices"} <= set(ev)
        # OpenAI: with include_usage every chunk has "usage" (null but on the last); without it, no usage key
        assert ("usage" in ev) == include_usage
        for c in ev["choices"]:
            assert set(c) == choice_keys, c
            per_choice.setdefault(c["index"], []).append(c["finish_reason"])
            if "delta" in c:
                assert set(c["delta"]) <= {"role", "content"}
    assert sorted(per_choice) == list(range(body.get("n", 1)))
    for reasons in per_choice.values():
        assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1]) and len(reasons) >= 2
    if include_usage:
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1
        assert all(ev["usage"] is None for ev in events[:-1])


def test_non_streamed_choices_carry_nullable_fields(server):
    r = _post(server, "/v1/completions", {"prompt": PARIS, "max_tokens": 3, "temperature": 0}).json()
    assert set(r["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert r["choices"][0]["logprobs"] is None and set(r["usage"]) == {"prompt_tokens", "completion_tokens",
                                                                      "total_tokens"}
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0}).json()
    choice = r["choices"][0]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason"} and choice["logprobs"] is None
    assert choice["message"] == {"role": "assistant", "content": choice["message"]["content"], "refusal": None}


# ------------------------------------------------------------------------------ 2. min_tokens holds stop strings
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_stop_strings(server, client, model_name, stream):
    kw = dict(model=model_name, prompt=PARIS, max_tokens=8, temperature=0, stop=["."])
    stopped = client.completions.create(**kw)
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (" Paris", "stop")
    plain = client.completions.create(**dict(kw, stop=None))  # the same request without the stop string
    free = plain.choices[0]
    assert free.text.startswith(" Paris.") and len(free.text) > len(" Paris.")
    held = dict(kw, extra_body={"min_tokens": 3})
    if stream:
        chunks = list(client.completions.create(**held, stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**held)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens == plain.usage.completion_tokens
    # the "." is the 2nd token, before min_tokens: the free greedy text, to max_tokens or EOS alike
    assert (text, reason) == (free.text, free.finish_reason)


# ------------------------------------------------------------------------------ 4. logprob bytes and names
def _split_character(token_bytes: list) -> bool:
    """Whether some token holds part of a character only (what these tests are about: the greedy answer to
    EMOJI_CHAT has an emoji spread over several tokens)."""
    return any(b and b"".join(bytes(x) for x in token_bytes[:k + 1]).decode("utf-8", errors="ignore")
               == b"".join(bytes(x) for x in token_bytes[:k]).decode("utf-8", errors="ignore")
               for k, b in enumerate(token_bytes))


def _names(token_bytes: list) -> list:
    """OpenAI's token names: the bytes as UTF-8, bytes of no complete character written ``\\xNN``."""
    return [bytes(b).decode("utf-8", errors="backslashreplace") for b in token_bytes]


def _offsets(token_bytes: list) -> list:
    """Each token's offset: the index of the character its first byte is in."""
    return [len(b"".join(bytes(x) for x in token_bytes[:k]).decode("utf-8", errors="ignore"))
            for k in range(len(token_bytes))]


def test_chat_logprob_bytes_are_raw_token_bytes(client, model_name):
    kw = dict(model=model_name, messages=EMOJI_CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].message.content
    lps = r.choices[0].logprobs.content
    token_bytes = [t.bytes for t in lps]
    assert len(lps) == r.usage.completion_tokens and _split_character(token_bytes), token_bytes
    assert [t.token for t in lps] == _names(token_bytes) and any("\\x" in t.token for t in lps)
    assert b"".join(bytes(b) for b in token_bytes) == content.encode("utf-8")
    for t in lps:
        alts = t.top_logprobs
        assert len(alts) == 3 and len({a.token for a in alts}) == 3 and len({bytes(a.bytes) for a in alts}) == 3
        assert all(a.token.encode("utf-8") == bytes(a.bytes) or "\\x" in a.token for a in alts)
    # streamed: the same entries, chunk by chunk
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.model_dump() for t in streamed] == [t.model_dump() for t in lps]


def test_completion_logprob_names_keys_and_text_offsets(client, model_name, tokenizer):
    chat = client.chat.completions.create(model=model_name, messages=EMOJI_CHAT, max_tokens=6, temperature=0,
                                          logprobs=True)
    token_bytes = [t.bytes for t in chat.choices[0].logprobs.content]
    assert _split_character(token_bytes), token_bytes
    prompt = tokenizer.apply_chat_template(EMOJI_CHAT, add_generation_prompt=True, tokenize=False)
    kw = dict(model=model_name, prompt=prompt, max_tokens=6, temperature=0, logprobs=5)
    r = client.completions.create(**kw)
    c = r.choices[0]
    # the same greedy tokens as the chat request's: the same names; an emoji's tokens share its character's offset
    assert c.text == chat.choices[0].message.content and c.logprobs.tokens == _names(token_bytes)
    assert c.logprobs.text_offset == _offsets(token_bytes) and len(set(c.logprobs.text_offset)) < len(token_bytes)
    for name, top in zip(c.logprobs.tokens, c.logprobs.top_logprobs):
        assert name in top and len(top) in (5, 6)  # 5 alternatives (+ the sampled token if not among them)
    chunks = list(client.completions.create(**kw, stream=True))
    lp = [x for ch in chunks for x in zip(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.text_offset)]
    assert lp == list(zip(c.logprobs.tokens, c.logprobs.text_offset))
    echoed = client.completions.create(model=model_name, prompt=PARIS, max_tokens=3, temperature=0, logprobs=0)
    assert echoed.choices[0].logprobs.text_offset == [0, 6, 7] and echoed.choices[0].text.startswith(" Paris.")


def test_token_names_are_distinct_over_the_whole_vocabulary(server):
    from kvserve.engine.detokenizer import TokenVocab

    tok = server.llm.tokenizer
    vocab = TokenVocab(tok)
    names = [vocab.token_name(i) for i in range(len(tok))]
    assert len(set(names)) == len(names) == 49152
    assert vocab.token_bytes(tok.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


# ------------------------------------------------------------------------------ 5. text that cannot be encoded
SURROGATE = "hi \ud800"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", SURROGATE], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": [SURROGATE]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": SURROGATE}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SURROGATE}] + CHAT},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
     "messages[0].name"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["x", SURROGATE]}, "stop"),
    ("/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
])
def test_lone_surrogates_are_400_and_the_connection_lives_on(server, path, body, param):
    with httpx.Client(base_url=server.url, timeout=120) as http:  # one keep-alive connection
        # ASCII JSON: the surrogate travels as the (valid JSON) escape \ud800
        r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "surrogate" in err["message"], err
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200


def test_surrogate_in_an_unknown_field_name_is_a_400(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi", "\\ud800": 1}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------ 6. strict JSON types
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": ["2"]}, "stop_token_ids[0]"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": "8"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "ignore_eos": "false"}, "ignore_eos"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens"),
])
def test_wrong_json_types_are_400_not_coerced(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_integers_are_numbers(server):
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "top_p": 1,
                                          "presence_penalty": 0, "repetition_penalty": 1})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ 7. smaller contract points
def test_text_part_without_text_says_so(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages[0].content"
    assert "needs a 'text' string" in err["message"] and "got type 'text'" not in err["message"]


def test_non_json_content_type_gets_a_hint(server):
    r = httpx.post(server.url + "/v1/completions", content=b"prompt=hi", timeout=60,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"not json", timeout=60)
    assert r.status_code == 400 and "Content-Type" in r.json()["error"]["message"]


def test_null_content_only_for_assistant_messages_same_rule_offline(server, llm):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": None}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}, CHAT[0]]
    r = _post(server, "/v1/chat/completions", {"messages": convo, "max_tokens": 2})
    assert r.status_code == 200, r.text
    with pytest.raises(ValueError, match=r"messages\[0\]\.content"):
        llm.apply_chat_template([{"role": "user", "content": None}])
    offline = llm.apply_chat_template(convo)
    tokenized = _post(server, "/tokenize", {"messages": convo}).json()
    assert tokenized["tokens"] == llm.get_tokenizer().encode(offline, add_special_tokens=False)


def test_every_get_route_answers_head(server):
    for path in ("/health", "/v1/models", "/version", "/metrics"):
        r = httpx.head(server.url + path, timeout=30)
        assert r.status_code == 200 and r.content == b"", path
    app = server.server.config.app
    get_paths = {r.path for r in app.routes if "GET" in getattr(r, "methods", ()) and r.include_in_schema}
    head_paths = {r.path for r in app.routes if "HEAD" in getattr(r, "methods", ())}
    assert get_paths <= head_paths, get_paths - head_paths


# ------------------------------------------------------------------------------ tokenizer routes, version
def test_tokenize_detokenize_version(server, client, model_name):
    r = _post(server, "/tokenize", {"prompt": PARIS, "return_token_strs": True}).json()
    assert r == {"count": 5, "max_model_len": 256, "tokens": [504, 3575, 282, 4649, 314],
                 "token_strs": ["The", "\u0120capital", "\u0120of", "\u0120France", "\u0120is"]}
    assert _post(server, "/tokenize", {"prompt": PARIS, "model": model_name}).json()["token_strs"] is None
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PARIS}
    # the chat form counts exactly the prompt tokens the chat endpoint runs
    chat = _post(server, "/tokenize", {"messages": CHAT}).json()
    used = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used == len(chat["tokens"])
    cont = _post(server, "/tokenize", {"messages": CHAT + [{"role": "assistant", "content": "Blue"}],
                                       "add_generation_prompt": False, "continue_final_message": True}).json()
    assert _post(server, "/detokenize", {"tokens": cont["tokens"]}).json()["prompt"].endswith("assistant\nBlue")
    assert httpx.get(server.url + "/version").json() == {"version": kvserve.__version__}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [49152]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenizer_routes_bad_input(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_an_unknown_model_is_404(server):
    r = _post(server, "/tokenize", {"prompt": "hi", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "a string or a list of"),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}, "messages[0].role", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo",
     "unrecognized"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name", "pattern"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools[0].function.name", "pattern"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "x" * 65}}]},
     "tools[0].function.name", "pattern"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     "max_completion_tokens must be"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be"),
])
def test_nested_and_renamed_fields_are_named_exactly(server, path, body, param, words):
    """``param`` is the full path of the offending field (as offline ``ValueError``s spell it), and the message
    names the same field the request used."""
    r = _post(server, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert err["message"].startswith(param) or "unrecognized" in err["message"], err
