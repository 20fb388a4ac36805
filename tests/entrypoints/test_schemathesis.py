"""Property-based API fuzzing with schemathesis against the server's own OpenAPI schema: no 5xx, no hang.

A dedicated server with ``max_model_len`` 48 keeps every accepted request short: a larger ``max_tokens`` is a 400
(context length), so whatever hypothesis generates finishes in a few decode steps.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.entrypoints.conftest import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.server]


@pytest.fixture(scope="module")
def fuzz_server():
    s = LiveServer(num_kv_blocks=64, max_num_seqs=8, max_model_len=48).start()
    yield s
    s.stop()


OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
              ("GET", "/v1/responses/{response_id}/input_items"),
              ("POST", "/v1/responses/{response_id}/cancel"), ("POST", "/v1/messages"),
              ("POST", "/v1/messages/count_tokens")]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def test_schema_lists_every_operation(api_schema):
    ops = {(r.ok().method.upper(), r.ok().path) for r in api_schema.get_all_operations()}
    assert ops == set(OPERATIONS)


CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS
    if m == "POST" and not p.endswith("/cancel")]  # the others have no body to break


# parameters the server rejects by design: dropped from half the generated bodies so that more of them generate
UNSUPPORTED = ("n", "best_of", "logit_bias", "suffix", "tools", "tool_choice", "parallel_tool_calls", "functions",
               "function_call", "response_format", "stream_options", "background", "include", "truncation",
               "top_logprobs", "previous_response_id", "thinking", "text", "reasoning")


@pytest.mark.parametrize("method,path,mode", CASES, ids=lambda v: getattr(v, "value", v))
def test_no_server_error_no_hang(api_schema, fuzz_server, method, path, mode):
    """Valid (positive) and invalid (negative) requests generated from the schema never get a 5xx, and every
    request is answered within 60 s."""
    operation = api_schema[path][method]
    examples = 25 if method == "POST" and "{" not in path else 5
    model = fuzz_server.llm_model_name

    @given(case=operation.as_strategy(generation_mode=mode), tidy=st.booleans())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case, tidy):
        if tidy and mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body = {k: v for k, v in case.body.items() if k not in UNSUPPORTED} | {"model": model}
        case.call_and_validate(base_url=fuzz_server.url, checks=[not_a_server_error], timeout=60)

    run()


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.floats(0, 3), st.sampled_from([0, 1e-30, 1e4, -0.5])),
    "top_p": st.one_of(st.floats(1e-9, 1), st.sampled_from([0, 1.5])),
    "top_k": st.one_of(st.integers(-2, 60_000), st.just(2**70)),
    "min_p": st.floats(-0.1, 1.1),
    "min_tokens": st.integers(0, 10),
    "presence_penalty": st.floats(-2.5, 2.5),
    "frequency_penalty": st.floats(-2.5, 2.5),
    "repetition_penalty": st.floats(0, 2.5),
    "seed": st.one_of(st.integers(-1, 2**64), st.none()),
    "stop": _maybe(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3))),
    "stop_token_ids": st.lists(st.integers(0, 60_000), max_size=3),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stream": st.booleans(),
    "n": st.integers(0, 3),
})


@given(body=SAMPLING, prompt=st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 49_151),
                                                                                  min_size=1, max_size=20)),
       max_tokens=st.integers(1, 6), logprobs=_maybe(st.integers(0, 21)), echo=st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_fuzz_sampling_parameters(fuzz_server, body, prompt, max_tokens, logprobs, echo):
    """Well-typed completions with sampling values in and around the engine's ranges: 200 or 400, never a 5xx,
    and a 200 is a complete response (streamed ones end with [DONE])."""
    body = {**body, "prompt": prompt, "max_tokens": max_tokens, "logprobs": logprobs, "echo": echo}
    r = httpx.post(fuzz_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"
    elif body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason"' in r.text
    else:
        assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"])


def test_fuzzed_server_is_idle_and_clean(fuzz_server):
    r = httpx.get(fuzz_server.url + "/health")
    assert r.status_code == 200
    m = fuzz_server.wait_idle()
    assert m["kvserve:kv_cache_usage_perc"] == 0 and m["kvserve:num_requests_running"] == 0
    fuzz_server.llm.engine.kv_cache_manager.check_integrity()
