"""``kvserve sim`` without a model: trace readers and their errors, the cost model fit, and the simulator (the real
Scheduler + KVCacheManager on a simulated clock) with exact times under a constant step cost."""

import json
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.sim import trace as tr
from kvserve.sim.cost_model import FEATURES, CostModel, fit, step_features
from kvserve.sim.profile import PROFILE_FORMAT, load
from kvserve.sim.simulator import Simulator

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def const(seconds):
    return CostModel(seconds, {f: 0.0 for f in FEATURES})


def sim_for(cost, num_blocks=256, **engine):
    return Simulator(EngineConfig.from_kwargs(**engine), cost, num_blocks, max_model_len=4096)


def test_constant_cost_gives_exact_latencies():
    trace = [tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.0, 4, 3), tr.TraceRequest(0.5, 4, 2)]
    res = sim_for(const(1.0), block_size=4).run(trace, {"ttft": 1.2})
    r = res.results
    # step 1 [0, 1]: both prompts, first tokens; the third arrives at 0.5, joins step 2 [1, 2]
    assert [x.ttft for x in r] == [1.0, 1.0, 1.5]
    assert [x.e2el for x in r] == [3.0, 3.0, 2.5]
    assert [x.itl for x in r] == [[1.0, 1.0], [1.0, 1.0], [1.0]]
    assert [x.tpot for x in r] == [1.0, 1.0, 1.0]
    s = res.summary
    assert (s["completed"], s["failed"], s["steps"], s["duration_s"]) == (3, 0, 3, 3.0)
    assert s["output_throughput"] == pytest.approx(8 / 3)
    assert s["goodput"] == pytest.approx(2 / 3)  # the third misses ttft <= 1.2 s
    assert s["median_ttft_ms"] == pytest.approx(1000.0)


def test_idle_engine_waits_for_the_next_arrival():
    trace = [tr.TraceRequest(0.0, 2, 1), tr.TraceRequest(10.0, 2, 2)]
    res = sim_for(const(0.5)).run(trace)
    assert [x.ttft for x in res.results] == [0.5, 0.5]
    assert res.summary["duration_s"] == 11.0


def test_token_budget_and_chunked_prefill_are_the_schedulers():
    # a 10-token prompt with a budget of 4 takes 3 steps to its first token
    res = sim_for(const(1.0), max_num_batched_tokens=4, block_size=4).run([tr.TraceRequest(0.0, 10, 2)])
    assert res.results[0].ttft == 3.0 and res.summary["steps"] == 4


def test_preemptions_on_a_small_pool():
    trace = [tr.TraceRequest(0.0, 4, 12) for _ in range(4)]
    res = sim_for(const(1.0), num_blocks=8, block_size=4).run(trace)
    assert res.summary["preemptions"] == 2 and res.summary["completed"] == 4
    assert res.summary["kv_usage_max"] == 1.0


def test_rejections_are_counted_like_http_400():
    trace = [tr.TraceRequest(0.0, 4000, 200), tr.TraceRequest(0.0, 4, 2)]
    res = sim_for(const(1.0)).run(trace)
    assert res.summary["rejected"] == 1 and res.summary["completed"] == 1
    assert "max_model_len" in res.results[0].error


def test_prefix_hit_rate_matches_the_trace_hash_ids():
    # block_size 4, prefix blocks of 8 tokens: request 2 shares its first prefix id with request 1
    trace = [tr.TraceRequest(0.0, 16, 1, (1, 2), 8), tr.TraceRequest(5.0, 16, 1, (1, 3), 8),
             tr.TraceRequest(10.0, 16, 1, (1, 2), 8)]
    res = sim_for(const(1.0), block_size=4, enable_prefix_caching=True).run(trace)
    # hits: 0, then 8 tokens (id 1), then 12 (ids 1, 2 but the last block is recomputed: capped at 15 // 4 = 3 blocks)
    assert res.summary["prefix_cache_hit_rate"] == pytest.approx((0 + 8 + 12) / 48)
    assert tr.prefix_share(trace) == pytest.approx(3 / 6)


def test_prompt_token_ids_share_exactly_the_prefix_ids():
    a = tr.prompt_token_ids(tr.TraceRequest(0, 20, 1, (5, 6), 8), 0)
    b = tr.prompt_token_ids(tr.TraceRequest(0, 20, 1, (5, 7), 8), 1)
    c = tr.prompt_token_ids(tr.TraceRequest(0, 20, 1, (), 8), 2)
    assert len(a) == len(b) == len(c) == 20
    assert a[:8] == b[:8] and a[8] != b[8]
    assert not set(c) & set(a) and not set(a[16:]) & set(b[16:])


def test_fit_recovers_a_known_linear_model():
    truth = CostModel(0.03, {"prefill_tokens": 0.002, "decode_tokens": 0.003, "logit_rows": 0.004,
                             "decode_ctx": 0.001, "prefill_attn": 0.05, "rows": 0.0})
    feats = [(0, 1, 1, 0.1, 0, 1), (0, 8, 8, 2.0, 0, 8), (512, 0, 1, 0, 0.13, 1), (248, 8, 9, 1.0, 0.03, 9),
             (0, 32, 32, 30.0, 0, 32), (128, 0, 1, 0, 0.5, 1), (60, 4, 4, 0.3, 0.002, 5), (0, 4, 4, 4.0, 0, 4),
             (300, 2, 3, 0.5, 0.05, 3)]
    model = fit([(f, truth.step_time(f)) for f in feats])
    assert model.intercept == pytest.approx(0.03, rel=1e-6)
    for k, v in truth.coef.items():
        assert model.coef[k] == pytest.approx(v, rel=1e-6, abs=1e-9)
    assert model.prefill_time((512, 0, 1, 0, 0.13, 1)) == pytest.approx(512 * 0.002 + 0.13 * 0.05)


def test_fit_of_noisy_steps_is_not_biased_low():
    """Steps measured with +-30% multiplicative noise: plain relative-error least squares (one solve) predicts the
    total time several percent short, the reweighted fit (``nnls_relative``'s default) within about a percent, and
    both recover exact data exactly."""
    import torch

    from kvserve.sim.cost_model import nnls_relative

    g = torch.Generator().manual_seed(0)
    x = [[1.0, float(b), float(b * c) / 1e3] for b in (1, 2, 4, 8, 16, 32) for c in (64, 256, 1024)] * 40
    true = [0.006, 0.002, 0.003]
    mean = [sum(a * b for a, b in zip(true, r)) for r in x]
    noisy = [m * (1 + 0.3 * (2 * float(torch.rand(1, generator=g)) - 1)) for m in mean]

    def total(c):
        return sum(sum(a * b for a, b in zip(c, r)) for r in x) / sum(noisy) - 1  # against the measured total

    assert total(nnls_relative(x, noisy, iterations=1)) < -0.03  # seeds 0-4: -4.8% to -6.9%
    assert abs(total(nnls_relative(x, noisy))) < 0.015  # seeds 0-4: -0.6% to +1.1%
    assert nnls_relative(x, mean) == pytest.approx(true, rel=1e-9)
    assert nnls_relative(x, mean, iterations=1) == pytest.approx(true, rel=1e-9)


def test_step_features_of_a_plan():
    from kvserve.core.sched_output import ScheduledRequest, SchedulerOutput

    so = SchedulerOutput([ScheduledRequest("a", [1], 99, [0], samples=True, sampling_states=[object()]),
                          ScheduledRequest("b", [1] * 4, 8, [0], samples=False)])
    # the decode row reads its 100 keys; a 4-token chunk at position 8 has 4 * (8 + 2.5) causal pairs
    assert step_features(so) == (4, 1, 1, 100 / 1e3, 4 * (8 + 2.5) / 1e6, 2)
    so = SchedulerOutput([ScheduledRequest("c", [1] * 33, 64, [0], samples=False),
                          ScheduledRequest("d", [1] * 32, 0, [0], samples=False)])
    assert step_features(so) == (65, 0, 0, 0.0, (33 * (64 + 17) + 32 * 16.5) / 1e6, 2)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_trace_errors_name_line_and_field(tmp_path):
    p = _write(tmp_path, "t.jsonl", '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 1}\n'
                                     '{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 1, "color": 1}\n')
    with pytest.raises(ValueError, match=r"line 2: .*unknown field\(s\) \['color'\]"):
        tr.read_jsonl(p)
    p = _write(tmp_path, "t2.jsonl", '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 1}\n{"arrival_s": 1,\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        tr.read_jsonl(p)
    p = _write(tmp_path, "t3.jsonl", '{"arrival_s": 0, "prompt_tokens": 0, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match="line 1: field 'prompt_tokens' must be an integer >= 1"):
        tr.read_jsonl(p)
    for line, field in (('{"arrival_s": 0, "prompt_tokens": "10", "output_tokens": 1}', "prompt_tokens"),
                        ('{"arrival_s": "0", "prompt_tokens": 10, "output_tokens": 1}', "arrival_s")):
        p = _write(tmp_path, "q.jsonl", line + "\n")  # a quoted number is a JSON string, not a number
        with pytest.raises(ValueError, match=f"line 1: field '{field}' must be an? (integer|number) >= "):
            tr.read_jsonl(p)
    p = _write(tmp_path, "t4.jsonl", '{"arrival_s": 2, "prompt_tokens": 3, "output_tokens": 1}\n'
                                      '{"arrival_s": 1, "prompt_tokens": 3, "output_tokens": 1}\n')
    with pytest.raises(ValueError, match="line 2: field 'arrival_s' goes back in time"):
        tr.read_jsonl(p)
    p = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"
                                   "2023-11-16 18:15:47.00,abc,44\n")
    with pytest.raises(ValueError, match="line 3: field 'ContextTokens' must be an integer"):
        tr.read_azure(p)
    p = _write(tmp_path, "b.csv", "TIMESTAMP,Context,GeneratedTokens\n")
    with pytest.raises(ValueError, match=r"line 1: .*missing \['ContextTokens'\], unknown \['Context'\]"):
        tr.read_azure(p)
    p = _write(tmp_path, "m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    with pytest.raises(ValueError, match=r"line 1: missing field\(s\) \['hash_ids'\]"):
        tr.read_mooncake(p)


def test_jsonl_trace_reads_prefix_ids_and_priority(tmp_path):
    p = _write(tmp_path, "t.jsonl", '{"arrival_s": 0.5, "prompt_tokens": 30, "output_tokens": 4, '
                                     '"prefix_block_ids": [1, 2], "priority": 3}\n\n')
    [r] = tr.read_jsonl(p, prefix_block_tokens=16)
    assert (r.arrival_s, r.prompt_len, r.output_len, r.prefix_ids, r.prefix_block_tokens, r.priority) == \
        (0.5, 30, 4, (1, 2), 16, 3)


def test_profile_errors(tmp_path):
    with pytest.raises(ValueError, match="profile not found"):
        load(tmp_path / "none.json")
    p = _write(tmp_path, "p.json", json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a kvserve sim profile"):
        load(p)
    good = {"format": PROFILE_FORMAT, "model": "A.gguf", "kv_bytes_per_token": 100, "max_position_embeddings": 8,
            "cost_model": const(0.1).to_dict()}
    p = _write(tmp_path, "q.json", json.dumps(good))
    with pytest.raises(ValueError, match="profile field 'model' is 'A.gguf', measured on another model than 'B.gguf'"):
        load(p, "B.gguf")
    prof, cost = load(p, "A.gguf")
    assert cost.intercept == 0.1


@pytest.mark.skipif(not (DATA / "azure_llm_2023").exists(), reason="needs ../shared/data")
def test_real_traces_read():
    az = tr.read_azure(DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv", 3)
    assert [(r.prompt_len, r.output_len) for r in az] == [(374, 44), (396, 109), (879, 55)]
    assert az[0].arrival_s == 0.0 and az[1].arrival_s == pytest.approx(4.314578, abs=1e-5)
    mc = tr.read_mooncake(DATA / "mooncake" / "conversation_trace.jsonl", 200, length_scale=16)
    assert mc[0].prefix_block_tokens == 32 and mc[0].prompt_len == 423  # ceil(6758 / 16)
    assert 0 < tr.prefix_share(mc) < 1


@pytest.mark.real_model
def test_unchunked_budget_caps_the_output_as_the_engine_does():
    """Without chunked prefill no sequence outgrows the token budget: the real engine ends a 12-token prompt with
    ``max_tokens=10`` after 4 tokens (``finish_reason`` "length") under a 16-token budget, the server's client
    counts it as completed, and so does the simulator (single engine and cluster), at its 4th token."""
    from kvserve import LLM, SamplingParams
    from kvserve.config import EngineConfig
    from kvserve.distributed.router import RoundRobinRouter
    from kvserve.sim.cluster import ClusterSimulator
    from kvserve.sim.cost_model import FEATURES, CostModel
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.trace import TraceRequest

    engine = dict(block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=16)
    out = LLM(num_kv_blocks=64, **engine).generate([list(range(1000, 1012))],
                                                  SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (4, "length")
    sim = Simulator(EngineConfig.from_kwargs(**engine), CostModel(1.0, {f: 0.0 for f in FEATURES}), 64, 4096)
    trace = [TraceRequest(0.0, 12, 10), TraceRequest(0.0, 16, 10), TraceRequest(0.0, 4, 3)]
    assert [sim.output_tokens(r) for r in trace] == [4, 1, 3]
    for res in (sim.run(trace).results, ClusterSimulator(sim, 1, RoundRobinRouter()).run(trace).results):
        assert [(r.success, r.output_tokens) for r in res] == [(True, 4), (True, 1), (True, 3)]
        assert res[0].ttft == 1.0 and res[0].e2el == 4.0  # one token per 1 s step after the prefill step


def test_a_profiles_old_server_calibration_is_ignored_with_a_warning(tmp_path, caplog):
    """The server calibration is gone: a profile that still carries one loads as its plain cost model, and the
    log says the field is not applied."""
    prof = json.loads((Path(__file__).resolve().parents[2] / "docs" / "simulator_profile.json").read_text())
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(prof))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**prof, "server_calibration": {"offset_s": 0.01, "scale": 2.0}}))
    with caplog.at_level("WARNING"):
        _, cost = load(old)
    assert "'server_calibration' is no longer applied" in caplog.text
    _, expected = load(plain)
    assert isinstance(cost, CostModel) and cost.to_dict() == expected.to_dict()
