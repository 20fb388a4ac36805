"""``kvserve serve --data-parallel-size 2`` on a local Ray cluster: replicas (1 CPU each) behind the kvserve
OpenAI server — one at first, scaled to two under load by Serve's autoscaler — the prefix-aware request router, a
replica killed under load. Skipped without the ``ray`` extra."""

import asyncio
import json
import threading
import time

import httpx
import pytest

pytest.importorskip("ray", reason="needs the optional Ray extra: pip install -e '.[ray]'")
pytest.importorskip("ray.serve", reason="needs the optional Ray extra: pip install -e '.[ray]'")

pytestmark = [pytest.mark.real_model, pytest.mark.server, pytest.mark.ray]

import ray  # noqa: E402

from benchmarks.prefix import multiround_waves  # noqa: E402
from kvserve.bench.serve import parse_prefix_counters, run_benchmark
from kvserve.bench.workloads import LoadRequest  # noqa: E402
from kvserve.bench.workloads import default_data_dir  # noqa: E402
from kvserve.distributed.router import make_router, prompt_block_hashes  # noqa: E402
from kvserve.entrypoints.ray import ingress  # noqa: E402
from kvserve.entrypoints.ray.replica import APP_NAME, DEPLOYMENT_NAME  # noqa: E402
from kvserve.entrypoints.ray.router import get_router  # noqa: E402

ENGINE_ARGS = {"max_model_len": 1024}
# one replica at first; Serve adds the second when more than two requests per replica are in flight (the tests
# before the scale-up send one request at a time)
AUTOSCALING = {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 0, "downscale_delay_s": 3600, "metrics_interval_s": 0.5, "look_back_period_s": 1}


@pytest.fixture(scope="module")
def cluster():
    server = ingress.build_server(ENGINE_ARGS, 1, "prefix", port=0, log_level="warning", access_log=False,
                                  autoscaling=AUTOSCALING)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the ingress did not start"
        time.sleep(0.05)
    server.url = f"http://127.0.0.1:{server.port}"
    server.model = server.config.app.state.served_model_name
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(60)
        ingress.shutdown_ray()


def prefix_counters(url: str) -> tuple:
    return parse_prefix_counters(httpx.get(url + "/metrics", timeout=30).text)


def test_greedy_answers_match_a_single_engine(cluster, llm):
    """The greedy tokens of one engine in this process (``LLM(...).generate`` / ``.chat``, max_tokens 8, the
    default quantization like the replicas'), through the ``openai`` client: completions (JSON and streamed) and
    chat."""
    from kvserve import SamplingParams

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=120)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for prompt in ("The capital of France is", "def fibonacci(n):"):
        want = llm.generate(prompt, greedy)[0].outputs[0]
        assert want.text and len(want.token_ids) <= 8
        r = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
        chunks = client.completions.create(model=cluster.model, prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat = client.chat.completions.create(model=cluster.model, max_tokens=8, temperature=0, messages=messages)
    want = llm.chat(messages, greedy)[0].outputs[0]
    assert want.text and chat.choices[0].message.content == want.text
    # the server's validation is kvserve serve's: a 400 naming the field
    bad = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5000}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_scale_from_one_to_two_replicas_under_load(cluster):
    """Streams in flight on the one replica make Serve start a second; every request of the load succeeds while it
    starts, and once it is up the router sends requests to both."""
    router = get_router()
    assert len(router.replica_ids()) == 1
    router.policy = make_router("least-loaded")
    prompts = [f"Count to ten, take {i}:" for i in range(4)]

    async def load():
        async with httpx.AsyncClient(timeout=120) as client:
            deadline = time.monotonic() + 300
            used, rounds = set(), 0  # replicas chosen since both were up (a fast round may fit on one)
            while len(router.replica_ids()) < 2 or (len(used) < 2 and rounds < 10):
                assert time.monotonic() < deadline, "no second replica within 300 s"
                both = len(router.replica_ids()) == 2
                n0 = len(router.decisions)
                outs = [{} for _ in prompts]
                await asyncio.gather(*(_post(client, cluster.url, cluster.model, p, o, 16)
                                       for p, o in zip(prompts, outs)))
                assert all(o["status"] == 200 and o["body"]["usage"]["completion_tokens"] == 16 for o in outs), outs
                if both:
                    rounds += 1
                    used |= {u for _, u, _ in list(router.decisions)[n0:]}
            return used

    used = asyncio.run(load())
    assert used == set(router.replica_ids()) and len(used) == 2
    router.policy = make_router("prefix")


def test_metrics_per_replica(cluster):
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    replicas = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                if line.startswith("kvserve:generation_tokens_total")}
    assert replicas == set(get_router().replica_ids()) and len(replicas) == 2


def _run_rounds(cluster, waves: list, marker: int) -> tuple:
    """Send the conversations' rounds wave by wave, in order, one at a time (``marker`` token first, so the two
    routers' runs share no blocks). Returns ``(hit rate over the run, {user: replicas of its rounds})``."""
    router = get_router()
    before = prefix_counters(cluster.url)
    placed: dict = {}
    for wave in waves:
        for req in wave:
            prompt = [marker] + req.prompt_token_ids
            results, _ = asyncio.run(run_benchmark(cluster.url, cluster.model, [LoadRequest(prompt, 2)], [0.0]))
            assert results[0].success, results[0].error
            first = prompt_block_hashes(prompt, 16)[0]
            uid = next(u for _, u, h in reversed(router.decisions) if h == first)
            placed.setdefault(req.request_id.split("-")[0], []).append(uid)
    after = prefix_counters(cluster.url)
    return (after[1] - before[1]) / (after[0] - before[0]), placed


def test_multiround_conversations_stay_on_their_replica(cluster):
    """ShareGPT multi-round (3 users, rounds 2 and 3, sent one by one): the prefix router keeps each conversation on
    one replica; round-robin alternates them (3 users on 2 replicas), so the prefix router finds at least twice its
    prefix hits on the same prompts (behind a different first token, so the two runs share no blocks)."""
    if not (default_data_dir() / "sharegpt_multiround").is_dir():
        pytest.skip("../shared/data/sharegpt_multiround is not next to this clone")
    waves = multiround_waves(cluster.llm.tokenizer, default_data_dir(), 3, max_input_tokens=512, output_len=2)[:2]
    assert [len(w) for w in waves] == [3, 3]
    router = get_router()
    router.policy = make_router("prefix")
    prefix_rate, placed = _run_rounds(cluster, waves, 1000)
    assert all(len(set(uids)) == 1 for uids in placed.values()), placed
    router.policy = make_router("round-robin")
    rr_rate, rr_placed = _run_rounds(cluster, waves, 2000)
    assert all(len(set(uids)) == 2 for uids in rr_placed.values()), rr_placed
    print(json.dumps({"prefix_hit_rate": prefix_rate, "round_robin_hit_rate": rr_rate}))
    assert prefix_rate >= 2 * rr_rate and prefix_rate > 0.3
    router.policy = make_router("prefix")


async def _stream(client, url, model, prompt, out: dict) -> None:
    payload = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
               "stream": True}
    out["events"] = []
    async with client.stream("POST", url + "/v1/completions", json=payload) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out["events"].append(json.loads(line[6:]))


async def _post(client, url, model, prompt, out: dict, max_tokens: int = 32) -> None:
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post(url + "/v1/completions", json=payload)
    out["status"], out["body"] = r.status_code, r.json()


def test_replica_killed_under_load(cluster):
    """4 requests in flight (2 per replica, least-loaded), one replica killed: its streamed request ends with an
    error event and its JSON request is a 503; the survivor's finish; a new request is served by the survivor."""
    router = get_router()
    router.policy = make_router("least-loaded")
    tok = cluster.llm.tokenizer
    prompts = [tok.encode(f"Story number {i}: " + "once upon a time " * 8) for i in range(4)]
    outs = [{} for _ in prompts]

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            n0 = len(router.decisions)
            tasks = [asyncio.ensure_future((_stream if i % 2 == 0 else _post)(client, cluster.url, cluster.model,
                                                                                 p, outs[i]))
                     for i, p in enumerate(prompts)]
            while len(router.decisions) < n0 + 4 or not all(outs[i].get("events") for i in (0, 2)):
                await asyncio.sleep(0.05)
            placed = {h: u for _, u, h in list(router.decisions)[n0:]}
            where = [placed[prompt_block_hashes(p, 16)[0]] for p in prompts]
            victim = where[0]
            ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#{victim}", namespace="serve"),
                     no_restart=True)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            after = {}
            await asyncio.wait_for(_post(client, cluster.url, cluster.model, "Hello there", after), 120)
            return where, victim, after

    where, victim, after = asyncio.run(scenario())
    assert len(set(where)) == 2, where  # least-loaded: both replicas busy
    for i, (out, uid) in enumerate(zip(outs, where)):
        if i % 2 == 0:  # streamed: 200, then tokens, then (killed) an error event
            assert out["status"] == 200
            last = out["events"][-1]
            if uid == victim:
                assert last["error"]["code"] == "aborted" and "replica" in last["error"]["message"], last
            else:
                assert last["choices"][0]["finish_reason"] == "length"
        elif uid == victim:
            assert out["status"] == 503 and out["body"]["error"]["type"] == "server_shutdown", out
        else:
            assert out["status"] == 200 and out["body"]["usage"]["completion_tokens"] == 32
    assert after["status"] == 200 and after["body"]["usage"]["completion_tokens"] == 32
    assert router.decisions[-1][1] != victim
