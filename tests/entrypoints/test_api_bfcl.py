"""Real tool definitions through the Responses and Messages tool paths: the BFCL multi-turn tool schemas
(../shared/data) are accepted, rendered by the chat template, and enforced when the choice names one (its
arguments valid under the tool's schema), on a server with room for their ~1,000-token prompt."""

import json

import anthropic
import openai
import pytest

from kvserve.entrypoints.openai.serving_options import ServingOptions
from tests.entrypoints.conftest import LiveServer
from tests.structured.common import assert_valid, bfcl_tools

pytestmark = [pytest.mark.real_model, pytest.mark.server]


@pytest.fixture(scope="module")
def tools():
    return bfcl_tools()


@pytest.fixture(scope="module")
def bfcl_server(tools):
    s = LiveServer(num_kv_blocks=160, max_num_seqs=4, max_model_len=2048,
                   server_kwargs={"options": ServingOptions(enable_auto_tool_choice=True)}).start()
    yield s
    s.stop()


def test_responses_named_choice(bfcl_server, tools):
    client = openai.OpenAI(base_url=bfcl_server.url + "/v1", api_key="unused")
    flat = [{"type": "function", **t["function"]} for t in tools]
    for t in flat[:3]:
        r = client.responses.create(model=bfcl_server.llm_model_name, input="Go ahead.", tools=flat, temperature=0,
                                    tool_choice={"type": "function", "name": t["name"]}, max_output_tokens=120)
        calls = [o for o in r.output if o.type == "function_call"]
        assert [c.name for c in calls] == [t["name"]]
        assert r.status == "completed"
        assert_valid(json.loads(calls[0].arguments), t["parameters"])


def test_messages_named_choice(bfcl_server, tools):
    client = anthropic.Anthropic(base_url=bfcl_server.url, api_key="unused")
    anth = [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"]} for t in tools]
    for t in anth[:3]:
        m = client.messages.create(model=bfcl_server.llm_model_name, max_tokens=120, tools=anth, temperature=0,
                                   messages=[{"role": "user", "content": "Go ahead."}],
                                   tool_choice={"type": "tool", "name": t["name"]})
        uses = [b for b in m.content if b.type == "tool_use"]
        assert [u.name for u in uses] == [t["name"]] and m.stop_reason == "tool_use"
        assert_valid(uses[0].input, t["input_schema"])
