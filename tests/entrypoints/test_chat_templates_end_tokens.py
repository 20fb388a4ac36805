"""Chat templates and end tokens per family (issue 40, item 6), on tiny models built from SmolLM2's own tokenizer
(``chat_families``): Llama 3 (``<|eot_id|>`` from ``generation_config.json``'s eos list, ``chat_template.jinja``),
Qwen (``<|im_end|>``, template in ``tokenizer_config.json``) and Gemma (``<end_of_turn>``), each as a Hugging Face
directory and as a GGUF (``tokenizer.ggml.eos/eot/eom_token_id``, ``tokenizer.chat_template``). The rendered prompt
ids are exact; the greedy answer ends on the family's end token with ``finish_reason`` "stop", the token kept in
``token_ids`` and left out of the text, offline and through the OpenAI server."""

import json
import shutil

import httpx
import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.chat_utils import NoChatTemplateError
from tests.entrypoints.chat_families import CONVERSATION, FAMILIES, LLAMA3_TEMPLATE, build, gguf_vocab
from tests.entrypoints.conftest import LiveServer

pytestmark = pytest.mark.real_model  # SmolLM2's tokenizer

#: The chat prompt of ``CONVERSATION`` under each family's template, as token ids (BOS once: the template writes
#: it and the text is tokenized without the tokenizer's own, as vLLM's chat does).
PROMPT_IDS = {
    "llama3": [49152, 49154, 4093, 49155, 198, 198, 26843, 17, 49157, 49154, 520, 9531, 49155, 1116],
    "qwen": [1, 9690, 198, 2683, 359, 1606, 30219, 28, 2312, 411, 1065, 505, 20534, 14698, 30, 1206, 359, 253, 5356,
             11173, 30, 2, 198, 1, 4093, 198, 26843, 17, 2, 198, 1, 520, 9531, 198],
    "gemma": [49152, 49154, 4093, 198, 26843, 17, 49155, 198, 49154, 3980, 198],
}
#: (every end token, the primary EOS) per family and format: the tokenizer's EOS plus generation_config.json's list
#: (Hugging Face), or the GGUF's eos / eot / eom ids.
END_TOKENS = {
    ("llama3", "hf"): ((49153, 49156, 49157), 49153), ("llama3", "gguf"): ((49153, 49156, 49157), 49153),
    ("qwen", "hf"): ((0, 2), 0), ("qwen", "gguf"): ((2,), 2),
    ("gemma", "hf"): ((49153, 49155), 49153), ("gemma", "gguf"): ((49153, 49155), 49153),
}
CASES = list(END_TOKENS)
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("chat_families")
    base = root / "smollm2"
    tokenizer.save_pretrained(str(base))
    vocab = gguf_vocab(base)
    return {name: build(root, base, vocab, fam) for name, fam in FAMILIES.items()}


@pytest.fixture(scope="module")
def engines(models):
    cache = {}

    def get(name: str, fmt: str) -> LLM:
        if (name, fmt) not in cache:
            m = models[name]
            cache[name, fmt] = LLM(model=str(m.hf_dir if fmt == "hf" else m.gguf), quantization="fp32",
                                   num_kv_blocks=32, max_model_len=128)
        return cache[name, fmt]

    return get


@pytest.mark.parametrize("name,fmt", CASES)
def test_the_family_template_renders_the_exact_prompt_ids(engines, models, name, fmt):
    llm, m = engines(name, fmt), models[name]
    assert m.prompt_ids == PROMPT_IDS[name]  # transformers' own rendering of the family's template
    out = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=1))[0]
    assert out.prompt_token_ids == PROMPT_IDS[name]
    bos = m.tokenizer.bos_token_id
    if m.family.add_bos:  # the tokenizer adds BOS to plain text; the chat prompt still has exactly one
        assert llm.llm_engine.tokenize("Hi")[0] == bos and out.prompt_token_ids.count(bos) == 1


@pytest.mark.parametrize("name,fmt", CASES)
def test_generation_ends_on_the_family_end_token(engines, models, name, fmt):
    llm, m = engines(name, fmt), models[name]
    eos_ids, primary = END_TOKENS[name, fmt]
    assert (llm.llm_engine.eos_token_ids, llm.llm_engine.eos_token_id) == (eos_ids, primary)
    c = llm.chat(CONVERSATION, GREEDY)[0].outputs[0]
    assert c.token_ids == m.answer + [m.end_id] and c.finish_reason == "stop"
    # vLLM: the tokenizer's EOS ends with stop_reason None; the other end tokens as its merged stop_token_ids
    assert c.stop_reason == (None if m.end_id == primary else m.end_id)
    assert c.text == m.tokenizer.decode(m.answer).rstrip("\ufffd") and m.family.end not in c.text


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ignore_eos_runs_past_every_end_token_and_stop_token_ids_still_stop(engines, models, name):
    llm, m = engines(name, "hf"), models[name]
    n = len(m.answer)
    c = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=n + 3, ignore_eos=True))[0].outputs[0]
    assert c.token_ids[: n + 1] == m.answer + [m.end_id] and len(c.token_ids) == n + 3
    assert c.finish_reason == "length" and c.stop_reason is None
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[m.answer[1]])
    c = llm.chat(CONVERSATION, sp)[0].outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (m.answer[:2], "stop", m.answer[1])


def test_the_start_up_log_names_the_end_tokens(models, caplog):
    with caplog.at_level("INFO", logger="kvserve.engine.llm_engine"):
        LLM(model=str(models["llama3"].hf_dir), quantization="fp32", num_kv_blocks=8, max_model_len=64)
    assert ("generation ends on token ids 49153 (<|end_of_text|>), 49156 (<|eom_id|>), 49157 (<|eot_id|>) unless "
            "ignore_eos; chat prompts: the model's chat template") in caplog.text


def test_a_gguf_named_tool_use_template_renders_tools(engines):
    llm = engines("llama3", "gguf")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = llm.apply_chat_template(CONVERSATION, tools=tools)
    assert with_tools.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                                 "Tools: get_weather<|eot_id|><|start_header_id|>user")
    assert llm.apply_chat_template(CONVERSATION) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                                                     "Hi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.fixture(scope="module")
def untemplated(models, tmp_path_factory):
    """The Llama 3 model without its chat template, and the template as a file beside it."""
    path = tmp_path_factory.mktemp("untemplated") / "llama3-no-template"
    shutil.copytree(models["llama3"].hf_dir, path)
    template = path.parent / "llama3.jinja"
    (path / "chat_template.jinja").rename(template)
    return path, template


def test_a_model_without_a_template_says_how_to_pass_one(untemplated):
    path, template = untemplated
    llm = LLM(model=str(path), quantization="fp32", num_kv_blocks=8, max_model_len=64)
    with pytest.raises(NoChatTemplateError, match="has no chat template.*--chat-template FILE"):
        llm.chat(CONVERSATION, GREEDY)
    out = llm.chat(CONVERSATION, GREEDY, chat_template=LLAMA3_TEMPLATE)[0]  # per call (vLLM's LLM.chat argument)
    assert out.prompt_token_ids == PROMPT_IDS["llama3"]
    flagged = LLM(model=str(path), quantization="fp32", num_kv_blocks=8, max_model_len=64,
                  chat_template=str(template))  # --chat-template FILE
    assert flagged.chat(CONVERSATION, GREEDY)[0].prompt_token_ids == PROMPT_IDS["llama3"]


def test_the_default_model_still_ends_on_its_own_im_end(llm):
    assert (llm.llm_engine.eos_token_ids, llm.llm_engine.eos_token_id) == ((2,), 2)
    sp = SamplingParams(temperature=0, max_tokens=64)
    c = llm.chat([{"role": "user", "content": "Say hello."}], sp)[0].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == 2 and c.stop_reason is None
    assert 2 not in c.token_ids[:-1] and "<|im_end|>" not in c.text and c.text


# --------------------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def llama3_server(models):
    s = LiveServer(model=str(models["llama3"].hf_dir), quantization="fp32", num_kv_blocks=32, max_model_len=128)
    yield s.start()
    s.stop()


@pytest.mark.server
def test_the_server_ends_a_chat_on_the_end_token(llama3_server, models):
    m = models["llama3"]
    body = {"messages": CONVERSATION, "temperature": 0, "max_tokens": 12, "logprobs": True}
    r = httpx.post(llama3_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    choice = r["choices"][0]
    text = m.tokenizer.decode(m.answer)
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == text
    assert r["usage"] == {"prompt_tokens": len(PROMPT_IDS["llama3"]), "completion_tokens": len(m.answer) + 1,
                          "total_tokens": len(PROMPT_IDS["llama3"]) + len(m.answer) + 1}
    assert [t["token"] for t in choice["logprobs"]["content"]][-1] == "<|eot_id|>"
    with httpx.stream("POST", llama3_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as s:
        chunks = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [json.loads(c)["choices"][0] for c in chunks]
    assert "".join(c["delta"].get("content") or "" for c in choices) == text
    assert choices[-1]["finish_reason"] == "stop"
    body = {**body, "ignore_eos": True, "stop_token_ids": [m.answer[1]]}
    choice = httpx.post(llama3_server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == m.tokenizer.decode(m.answer[:1])


@pytest.mark.server
def test_the_server_answers_400_for_a_model_without_a_template_and_takes_the_flag(untemplated):
    path, template = untemplated
    plain = LiveServer(model=str(path), quantization="fp32", num_kv_blocks=8, max_model_len=64).start()
    try:
        r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "has no chat template" in message and "--chat-template FILE" in message
        r = httpx.post(plain.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        plain.stop()
    flagged = LiveServer(model=str(path), quantization="fp32", num_kv_blocks=8, max_model_len=64,
                         chat_template=str(template)).start()
    try:
        r = httpx.post(flagged.url + "/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(PROMPT_IDS["llama3"])
    finally:
        flagged.stop()
