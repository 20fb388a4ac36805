"""Structured outputs offline (``SamplingParams(structured_outputs=...)``) on the real model: every output parses and
validates; json_object / regex / choice / grammar texts are exactly what they allow; speculative decoding verifies
drafts against the grammar and gives the same greedy tokens; matchers follow appended tokens exactly once; bad
constraints are ``ValueError``s with nothing queued."""

import json
import re

import pytest

from kvserve import LLM, SamplingParams
from kvserve.structured import StructuredOutputsParams as SO
from tests.conftest import assert_pool_clean
from tests.structured.common import assert_valid, bfcl_tools

pytestmark = pytest.mark.real_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

#: one request per BFCL function in ``common.BFCL_FUNCTIONS``
ASKS = ["Send the message 'Meeting at 3pm' to user USR002.",
        "Tweet 'Loving the sunshine' with the tag #sun.",
        "Add 3.5 and 4.",
        "Lock the driver and passenger doors.",
        "Buy 10 shares of AAPL at 150.5."]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(num_kv_blocks=256, max_num_seqs=16, speculative_config=SPEC)


def _prompts(llm):
    tools = bfcl_tools()
    out = []
    for tool, ask in zip(tools, ASKS):
        f = tool["function"]
        msg = f"{ask} Answer with the JSON arguments of {f['name']}."
        out.append((llm.apply_chat_template([{"role": "user", "content": msg}]), f["parameters"]))
    return out


@pytest.fixture(scope="module")
def bfcl_greedy(llm):
    items = _prompts(llm)
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=SO(json=schema)) for _, schema in items]
    return items, params, llm.generate([p for p, _ in items], params)


def test_bfcl_schemas_greedy_and_sampled_outputs_validate(llm, bfcl_greedy):
    items, _, greedy = bfcl_greedy
    sampled = llm.generate([p for p, _ in items[:3]], [
        SamplingParams(temperature=0.7, seed=7, max_tokens=64, structured_outputs=SO(json=schema))
        for _, schema in items[:3]])
    outs = [(schema, o.outputs[0]) for (_, schema), o in zip(items, greedy)]
    outs += [(schema, o.outputs[0]) for (_, schema), o in zip(items, sampled)]
    for schema, out in outs:
        assert out.finish_reason == "stop", out.text
        assert_valid(json.loads(out.text), schema)
    assert json.loads(greedy[2].outputs[0].text) == {"a": 3.5, "b": 4}
    assert_pool_clean(llm.llm_engine)


def test_speculation_gives_the_same_greedy_tokens(spec_llm, bfcl_greedy):
    items, params, greedy = (x[:3] for x in bfcl_greedy)
    got = spec_llm.generate([p for p, _ in items], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in greedy]
    stats = spec_llm.llm_engine.stats.spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert_pool_clean(spec_llm.llm_engine)


def test_json_object_regex_choice_grammar_exact(llm, spec_llm):
    chat = lambda q: llm.apply_chat_template([{"role": "user", "content": q}])  # noqa: E731
    cases = [
        (chat("Give a JSON object with a name and an age."), SO(json_object=True)),
        (chat("Phone number:"), SO(regex=r"\d{3}-\d{4}")),
        (chat("What is the capital of France?"), SO(choice=["Paris", "London", "Berlin"])),
        (chat("Answer yes or no: is the sky blue?"), SO(grammar='root ::= "yes" | "no"')),
    ]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so) for _, so in cases]
    outs = [o.outputs[0] for o in llm.generate([p for p, _ in cases], params)]
    assert all(o.finish_reason == "stop" for o in outs)
    assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].text)
    assert outs[2].text in ("Paris", "London", "Berlin") and outs[3].text in ("yes", "no")  # (which: the model's)
    spec = [o.outputs[0].token_ids for o in spec_llm.generate([p for p, _ in cases], params)]
    assert spec == [o.token_ids for o in outs]


def test_parallel_samples_each_follow_their_own_matcher(llm):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "maximum": 30}},
              "required": ["city", "days"]}
    prompt = llm.apply_chat_template([{"role": "user", "content": "Plan a trip as JSON."}])
    out = llm.generate(prompt, SamplingParams(n=2, temperature=0.7, seed=5, max_tokens=40,
                                              structured_outputs=SO(json=schema)))[0]
    assert len(out.outputs) == 2 and out.outputs[0].text != out.outputs[1].text
    for c in out.outputs:
        assert c.finish_reason == "stop"
        assert_valid(json.loads(c.text), schema)


def test_matcher_advances_once_per_appended_token(llm):
    """``GrammarState.sync`` consumes each output token once (a preemption appends nothing, so re-syncing is a
    no-op), rolls back a cut list, and draft masks leave the matcher where it was."""
    backend = llm.llm_engine.grammar_backend
    tok = llm.get_tokenizer()
    state = backend.new_state(backend.compile(SO(regex=r"\d{3}-\d{4}")))
    ids = tok.encode("123-45")
    out = list(ids)
    state.sync(out)
    state.sync(out)
    assert state.num_consumed == len(ids) and not state.failed
    import torch

    before = torch.empty(1, 49152 // 32, dtype=torch.int32)
    state.fill(before, 0)
    drafts = tok.encode("67")
    masks = torch.empty(len(drafts) + 1, 49152 // 32, dtype=torch.int32)
    state.fill_drafts(masks, drafts)
    assert torch.equal(masks[0], before[0])  # row 0: the state before any draft
    after = torch.empty(1, 49152 // 32, dtype=torch.int32)
    state.fill(after, 0)
    assert torch.equal(after, before)  # drafts rolled back
    del out[-1]
    state.sync(out)
    assert state.num_consumed == len(ids) - 1


def test_bad_constraints_are_value_errors(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        SO()
    with pytest.raises(ValueError, match="exactly one of.*json, regex"):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match=r"properties\.x: unsupported JSON schema feature 'not'"):
        SO(json={"type": "object", "properties": {"x": {"not": {"type": "string"}}}})
    with pytest.raises(ValueError, match="uniqueItems"):
        SO(json={"type": "array", "uniqueItems": True})
    with pytest.raises(ValueError, match="not valid JSON"):
        SO(json="{nope")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        SO(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    engine = llm.llm_engine
    for so, match in ((SO(regex="(ab"), "structured_outputs.regex cannot be compiled: .*parenthesis"),
                      (SO(grammar="root ::= x"), "structured_outputs.grammar cannot be compiled: .*x")):
        with pytest.raises(ValueError, match=match):
            llm.generate("Hi", SamplingParams(max_tokens=2, structured_outputs=so))
    assert_pool_clean(engine)


def test_preemption_does_not_double_advance_the_matchers(bfcl_greedy):
    """A starved pool preempts (recompute) mid-generation; each matcher still sees every token once, so the
    greedy outputs equal the roomy pool's."""
    items, params, greedy = (x[:3] for x in bfcl_greedy)
    starved = LLM(num_kv_blocks=10, block_size=16, max_num_seqs=3)
    outs = starved.generate([p for p, _ in items], params)
    assert starved.llm_engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]
    assert_pool_clean(starved.llm_engine)
