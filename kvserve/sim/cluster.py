"""``kvserve sim --replicas N --router R``: N simulated engines behind one router, on one simulated clock.

Each replica is what ``Simulator`` runs for one engine — the real ``Scheduler`` and ``KVCacheManager`` of the same
``EngineConfig`` and pool size, the model-free runner, the cost model's step time — and a request is routed on
arrival by the same router classes the Ray Serve deployment uses (``kvserve.distributed.router``), fed with each
replica's exact load (running, waiting, KV usage) and the prompt's block hashes (which the replica's KV manager then
reuses instead of hashing again).

Event loop: the next event is the earliest of the next arrival and the replicas' step ends. Steps that end at ``t``
deliver their tokens first; arrivals at or before ``t`` are routed and queued; then every idle replica with work
starts its next step (``schedule()``, ``t + step_time``). One replica behaves exactly as ``Simulator.run``.

Replicas that share a host's CPUs (``contention``): ``contention[k - 1]`` is how much longer a step takes while
``k`` replicas of its host are computing one (``contention[0]`` is normally 1), and replicas fill hosts of
``len(contention)`` in order (replica ``r`` on host ``r // len(contention)``). Each step's cost-model time is work
done at rate ``1 / factor`` for the ``k`` busy at each moment (processor sharing), so a step is re-timed whenever
another replica of its host starts or ends one. A step's factor mixes ``contention[k - 1]`` for its decode and
per-step part with ``prefill_contention[k - 1]`` (default 1) for its prompt chunks' part, weighted by their
cost-model times. ``contention`` is measured by running replicas side by side (docs/scale_out.md); prompt chunks are
left unslowed by default because replays with a measured prompt factor predicted TTFT worse (docs/scale_out.md).
Without ``contention``, replicas are independent machines.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.distributed.router import (PrefixAwareRouter, ReplicaLoad, Router, add_bound_args, block_hash_chain,
                                        bound_kwargs, imbalance)
from kvserve.metrics import RequestResult, summarize
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.core.fake_runner import fake_run
from kvserve.sim.simulator import SIM_TOKEN_ID, Simulator
from kvserve.sim.trace import TraceRequest, prompt_token_ids


@dataclass
class ClusterResult:
    """One simulated cluster run.

    Attributes:
        summary: ``kvserve.metrics.summarize``'s dict over all requests plus ``replicas``, ``router``,
            ``goodput_per_replica`` (req/s), ``prefix_cache_hit_rate`` / ``prefix_cache_queries`` (summed over
            replicas), ``requests_per_replica`` (list), ``request_imbalance`` (max / mean requests per replica),
            ``busy_imbalance`` (max / mean busy time), ``steps``, ``preemptions``, ``rejected``, and for the prefix
            router ``prefix_routed`` / ``fallback_routed`` / ``overridden`` counts; ``sim_wall_s``.
        results: one ``RequestResult`` per trace request, in trace order.
        replica_of: the replica index each request was routed to (-1: rejected before routing).
    """

    summary: dict
    results: list
    replica_of: list = field(default_factory=list)


class _Replica:
    """One simulated engine: its scheduler, KV manager, and the step in flight."""

    def __init__(self, sim: Simulator):
        cc = sim.config.cache_config
        self.kv = KVCacheManager(sim.num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.sched = Scheduler(sim.config.scheduler_config, self.kv, eos_token_ids=())
        self.step = None  # the SchedulerOutput being computed, or None when idle
        self.work_s = 0.0  # cost-model seconds of the step left at ``mark_s``, computed at rate 1 / ``factor``
        self.mark_s = self.start_s = 0.0
        self.factor = 1.0
        self.prefill_frac = 0.0  # the step's prompt-chunk share of its cost-model time
        self.version = 0  # bumped when the step is re-timed: older heap entries are stale
        self.busy_s = 0.0
        self.steps = 0
        self.num_requests = 0

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.sched.num_running, self.sched.num_waiting,
                           self.kv.block_pool.num_used_blocks / self.kv.num_blocks)


class ClusterSimulator:
    """``num_replicas`` copies of ``sim``'s engine behind ``router``.

    Args:
        sim: the single-engine simulator (config, cost model, pool size, ``reject_reason``).
        num_replicas: replicas, >= 1.
        router: a ``kvserve.distributed.router.Router`` (replica ids are 0 .. N-1).
        contention: step-time factors while 1, 2, ... replicas of one host compute a step (the module docstring);
            ``None``: every replica on a machine of its own.
        prefill_contention: the factors for the steps' prompt-chunk part; ``None``: all 1 (not slowed).

    Raises:
        ValueError: ``num_replicas < 1``; a ``contention`` that is empty or has a factor that is not a finite
            number > 0; a ``prefill_contention`` without ``contention`` or of another length.
    """

    def __init__(self, sim: Simulator, num_replicas: int, router: Router, contention: Optional[list] = None,
                 prefill_contention: Optional[list] = None):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {num_replicas!r}")
        self.sim = sim
        self.num_replicas = num_replicas
        self.router = router
        self.contention = check_contention(contention)
        pc = check_contention(prefill_contention, "prefill_contention")
        if pc is not None and len(pc) != len(self.contention or []):
            raise ValueError(f"prefill_contention needs as many factors as contention "
                             f"({len(self.contention or [])}), got {len(pc)}")
        self.prefill_contention = pc or [1.0] * len(self.contention or [])

    def run(self, trace: list[TraceRequest], slos: Optional[dict] = None) -> ClusterResult:
        """Simulate ``trace`` (arrivals in non-decreasing order) to the last request's end.

        Raises:
            ValueError: arrivals out of order.
            RuntimeError: a replica's scheduler makes no progress (a request that can never be admitted).
        """
        wall0 = time.perf_counter()
        if any(trace[k].arrival_s > trace[k + 1].arrival_s for k in range(len(trace) - 1)):
            raise ValueError("trace arrivals must be in non-decreasing order")
        sim, bs = self.sim, self.sim.block_size
        reps = [_Replica(sim) for _ in range(self.num_replicas)]
        results = [RequestResult() for _ in trace]
        replica_of = [-1] * len(trace)
        last_token = [0.0] * len(trace)
        ends: list = []  # heap of (step end time, replica index, the step's version)
        idle_with_work: set = set()
        n, i, t = len(trace), 0, 0.0
        while True:
            t_arr = trace[i].arrival_s if i < n else math.inf
            t_end = ends[0][0] if ends else math.inf
            if t_arr == math.inf and t_end == math.inf:
                break
            t = min(t_arr, t_end)
            if self.contention:
                self._advance(reps, t)
            while ends and ends[0][0] <= t:  # steps ending now deliver their tokens
                _, r, version = heapq.heappop(ends)
                rep = reps[r]
                if version != rep.version:  # re-timed since: a later entry stands for it
                    continue
                so, rep.step = rep.step, None
                rep.busy_s += t - rep.start_s
                out = fake_run(so, SIM_TOKEN_ID)
                rep.sched.update_from_output(so, out)
                for rid in out.sampled_token_ids:
                    k = int(rid)
                    res = results[k]
                    if res.output_tokens == 0:
                        res.ttft = t - trace[k].arrival_s
                    else:
                        res.itl.append(t - last_token[k])
                    last_token[k] = t
                    res.output_tokens += 1
                    if res.output_tokens == sim.output_tokens(trace[k]):
                        res.success, res.e2el = True, t - trace[k].arrival_s
                if rep.sched.has_unfinished_requests():
                    idle_with_work.add(r)
            while i < n and trace[i].arrival_s <= t:  # arrivals up to now are routed and queued
                self._admit(i, trace[i], reps, results, replica_of, bs, idle_with_work)
                i += 1
            for r in sorted(idle_with_work):  # idle replicas with work start a step
                rep = reps[r]
                so = rep.sched.schedule()
                if not so.scheduled:
                    raise RuntimeError(f"replica {r} made no progress at t={t:.3f} s with {rep.sched.num_waiting} "
                                       f"waiting; check the pool size and token budget")
                rep.step, rep.steps, rep.start_s, rep.mark_s = so, rep.steps + 1, t, t
                rep.version += 1
                if self.contention:  # its end is pushed by _retime below, at its host's rate
                    rep.work_s, pre = _split(sim.step_time, so)
                    rep.prefill_frac = pre / rep.work_s if rep.work_s > 0 else 0.0
                    rep.factor = None
                else:
                    rep.work_s, rep.factor = sim.step_time(so), 1.0
                    heapq.heappush(ends, (t + rep.work_s, r, rep.version))
            idle_with_work.clear()
            if self.contention:
                self._retime(reps, t, ends)
        return ClusterResult(self._summary(trace, reps, results, t, slos, wall0), results, replica_of)

    def _advance(self, reps: list, t: float) -> None:
        """Contention: every step in flight has done ``(t - mark) / factor`` of its work by ``t``."""
        for rep in reps:
            if rep.step is not None:
                rep.work_s = max(0.0, rep.work_s - (t - rep.mark_s) / rep.factor)
                rep.mark_s = t

    def _retime(self, reps: list, t: float, ends: list) -> None:
        """Contention: each step in flight continues at its host's present rate; a step whose factor changed gets
        a new end (its older heap entry goes stale)."""
        h = len(self.contention)
        busy = [0] * (-(-len(reps) // h))
        for r, rep in enumerate(reps):
            busy[r // h] += rep.step is not None
        for r, rep in enumerate(reps):
            if rep.step is None:
                continue
            k = busy[r // h] - 1
            factor = self.contention[k] + rep.prefill_frac * (self.prefill_contention[k] - self.contention[k])
            if factor != rep.factor:
                rep.factor, rep.version = factor, rep.version + 1
                heapq.heappush(ends, (t + rep.work_s * factor, r, rep.version))

    def _admit(self, k: int, r: TraceRequest, reps: list, results: list, replica_of: list, bs: int,
               idle_with_work: set) -> None:
        res = results[k]
        res.start_s, res.prompt_tokens = r.arrival_s, r.prompt_len
        why = self.sim.reject_reason(r)
        if why:
            res.error = f"HTTP 400: {why}"
            return
        ids = prompt_token_ids(r, k)
        hashes = block_hash_chain(ids, bs)  # the KV manager's own chain: computed once, for both
        values = [h.value for h in hashes]
        dest = self.router.choose(values, {j: rep.load() for j, rep in enumerate(reps)})
        self.router.on_routed(dest, values)
        req = Request(str(k), ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0),
                      self.sim.max_total_tokens, arrival_time=r.arrival_s, priority=r.priority)
        req.block_hashes = hashes
        rep = reps[dest]
        rep.sched.add_request(req)
        rep.num_requests += 1
        replica_of[k] = dest
        if rep.step is None:
            idle_with_work.add(dest)

    def _summary(self, trace: list, reps: list, results: list, duration: float, slos: Optional[dict],
                 wall0: float) -> dict:
        s = summarize(results, duration, slos or {})
        queries = sum(rep.kv.prefix_cache_queries for rep in reps)
        hits = sum(rep.kv.prefix_cache_hits for rep in reps)
        counts = [rep.num_requests for rep in reps]
        s.update({
            "replicas": self.num_replicas,
            "router": self.router.name,
            "goodput_per_replica": s["goodput"] / self.num_replicas if s["goodput"] is not None else None,
            "prefix_cache_queries": queries,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "requests_per_replica": counts,
            "request_imbalance": imbalance(counts),
            "busy_imbalance": imbalance([rep.busy_s for rep in reps]),
            "steps": sum(rep.steps for rep in reps),
            "preemptions": sum(rep.sched.num_preemptions for rep in reps),
            "rejected": sum(1 for r in results if r.error.startswith("HTTP 400")),
            "truncated": Simulator.num_truncated(trace, results),
            "num_blocks": self.sim.num_blocks,
            "sim_wall_s": time.perf_counter() - wall0,
        })
        if isinstance(self.router, PrefixAwareRouter):
            s.update({"prefix_routed": self.router.num_prefix_routed,
                      "fallback_routed": self.router.num_fallback_routed,
                      "overridden": self.router.num_overridden})
        return s


def _split(step_time, so) -> tuple:
    """``(seconds, of which prompt chunks)`` of a plan: the cost model's ``split``, or all of it not prefill."""
    split = getattr(step_time, "split", None)
    return split(so) if split is not None else (step_time(so), 0.0)


def check_contention(contention: Optional[list], name: str = "contention") -> Optional[list]:
    """``contention`` as a list of floats (``None`` stays ``None``); ``name`` is the field the messages name.

    Raises:
        ValueError: an empty list, or a factor that is not a finite number > 0 (the message names it).
    """
    if contention is None:
        return None
    try:
        factors = [float(c) for c in contention]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of numbers > 0, got {contention!r}") from None
    if not factors:
        raise ValueError(f"{name} must list at least one factor (1 replica busy), got []")
    for k, c in enumerate(factors):
        if not (c > 0 and math.isfinite(c)):
            raise ValueError(f"{name}[{k}] (the step-time factor with {k + 1} replica(s) of a host busy) must be "
                             f"a finite number > 0, got {c}")
    return factors


# ---------------------------------------------------------------------------------------------------- CLI
def add_args(p) -> None:
    """``kvserve sim`` flags for a simulated cluster (``--replicas``, ``--router``, ``--scale-plot``)."""
    from kvserve.distributed.router import ROUTERS

    g = p.add_argument_group("cluster (data-parallel replicas behind a router)")
    g.add_argument("--replicas", default="1",
                   help="replicas, or a comma list for a sweep (e.g. 1,2,4,8,16,32,64); in a sweep the trace's "
                        "arrivals are sped up N times for N replicas (the same load per replica)")
    g.add_argument("--router", default="prefix",
                   help=f"{', '.join(ROUTERS)}, or a comma list (default prefix)")
    g.add_argument("--scale-plot", default=None, help="sweep: write goodput per replica and hit rate vs N here")
    g.add_argument("--contention", default=None,
                   help="step-time factors while 1, 2, ... replicas of one host compute a step (e.g. 1,1.8: hosts "
                        "of two replicas, each step 1.8x slower while both compute); default: none, every replica on "
                        "a machine of its own")
    add_bound_args(g)


def contention_arg(text: Optional[str]) -> tuple:
    """``--contention`` as ``(contention, prefill_contention)``: ``None`` or ``"none"`` -> ``(None, None)``, else
    the comma list as floats for the decode part (prompt chunks unslowed).

    Raises:
        ValueError: a bad list (the message names the flag).
    """
    if text is None or text.strip().lower() == "none":
        return None, None
    try:
        factors = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--contention must be a comma list of numbers > 0 (e.g. 1,1.6), got {text!r}") from None
    return check_contention(factors, "--contention"), None


def parse_list(text: str, name: str, kind, allowed=None) -> list:
    """``"1,2,4"`` -> ``[1, 2, 4]``.

    Raises:
        ValueError: an empty list, a bad item, or one outside ``allowed`` (the message names the flag).
    """
    out = []
    for item in str(text).split(","):
        try:
            value = kind(item.strip())
        except ValueError:
            raise ValueError(f"--{name} must be a comma list of {kind.__name__}, got {text!r}") from None
        if allowed is not None and value not in allowed:
            raise ValueError(f"--{name} must be in {', '.join(map(str, allowed))}, got {value!r}")
        if kind is int and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
        out.append(value)
    return out


def wants_cluster(args) -> bool:
    """Whether ``kvserve sim`` was asked for more than one replica or router.

    Raises:
        ValueError: a bad ``--router``, or ``--contention`` without a cluster (one engine shares its host with no
            other replica).
    """
    from kvserve.distributed.router import ROUTERS

    parse_list(getattr(args, "router", "prefix"), "router", str, ROUTERS)
    cluster = str(getattr(args, "replicas", "1")) != "1" or "," in str(getattr(args, "router", ""))
    if not cluster and getattr(args, "contention", None) is not None:
        raise ValueError("--contention needs --replicas N > 1 (or a list): a single engine shares its host with no "
                         "other replica")
    return cluster


def sweep(sim: Simulator, trace: list, replicas: list, routers: list, slos: Optional[dict] = None,
          scale_load: bool = True, router_kwargs: Optional[dict] = None, contention: Optional[list] = None,
          prefill_contention: Optional[list] = None) -> list:
    """Summaries of ``trace`` on every (replica count, router) pair; with ``scale_load`` the arrival times are
    divided by the replica count (N replicas get N times the load); ``contention`` and ``prefill_contention`` as in
    ``ClusterSimulator``. Returns the summaries in order."""
    from kvserve.distributed.router import make_router
    from kvserve.sim.trace import TraceRequest as _TR

    out = []
    for n in replicas:
        scaled = [_TR(r.arrival_s / n if scale_load else r.arrival_s, r.prompt_len, r.output_len, r.prefix_ids,
                      r.prefix_block_tokens, r.priority, r.token_ids) for r in trace]
        for name in routers:
            router = make_router(name, **(router_kwargs or {})) if name == "prefix" else make_router(name)
            if name == "prefix" and not (router_kwargs or {}).get("cache_blocks"):
                router.cache_blocks = sim.num_blocks  # the replica's pool models its prefix cache
            out.append(ClusterSimulator(sim, n, router, contention, prefill_contention).run(scaled, slos).summary)
    return out


def format_sweep(rows: list) -> str:
    """A text table of ``sweep`` summaries."""
    head = (f"{'replicas':>8} {'router':>13} {'goodput/s':>10} {'per replica':>11} {'hit rate':>9} "
            f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'TPOT p50 ms':>11} {'req max/mean':>12} {'overridden':>10} "
            f"{'rejected/cut':>12}")
    lines = [head]
    for s in rows:
        gp = s["goodput"] if s["goodput"] is not None else s["request_throughput"]
        per = gp / s["replicas"]
        lines.append(f"{s['replicas']:>8} {s['router']:>13} {gp:>10.3f} {per:>11.3f} "
                     f"{100 * s['prefix_cache_hit_rate']:>8.1f}% {s['median_ttft_ms'] or 0:>11.0f} "
                     f"{s['p99_ttft_ms'] or 0:>11.0f} {s['median_tpot_ms'] or 0:>11.1f} "
                     f"{s['request_imbalance'] or 0:>12.2f} {s.get('overridden', '-'):>10} "
                     f"{str(s['rejected']) + '/' + str(s.get('truncated', 0)):>12}")
    return "\n".join(lines)


def plot_sweep(rows: list, path) -> None:
    """Goodput per replica and prefix hit rate against the replica count, one line per router."""
    from kvserve.sim.plots import pyplot, save, style

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(s["router"] for s in rows):
        mine = [s for s in rows if s["router"] == name]
        xs = [s["replicas"] for s in mine]
        a.plot(xs, [(s["goodput"] if s["goodput"] is not None else s["request_throughput"]) / s["replicas"]
                    for s in mine], marker="o", label=name)
        b.plot(xs, [100 * s["prefix_cache_hit_rate"] for s in mine], marker="o", label=name)
    for ax, y in ((a, "goodput per replica (req/s)"), (b, "prefix cache hit rate (%)")):
        ax.set_xscale("log", base=2)
        style(ax, "replicas", y)
        ax.legend(fontsize=8)
    save(plt, fig, path)


def run_cli(args, sim: Simulator, trace: list, slos: dict) -> int:
    """``kvserve sim --replicas ... --router ...``: print the sweep table; returns 0 (1 if requests failed).

    Raises:
        ValueError: bad ``--replicas`` / ``--router``.
    """
    import json

    from kvserve.distributed.router import ROUTERS

    replicas = parse_list(args.replicas, "replicas", int)
    routers = parse_list(args.router, "router", str, ROUTERS)
    contention, prefill_contention = contention_arg(getattr(args, "contention", None))
    rows = sweep(sim, trace, replicas, routers, slos, scale_load=len(replicas) > 1, router_kwargs=bound_kwargs(args),
                 contention=contention, prefill_contention=prefill_contention)
    hosts = (f"hosts of {len(contention)} replica{'s' if len(contention) > 1 else ''}, step-time factors {contention}"
             f"{f' (prompt chunks {prefill_contention})' if prefill_contention else ''}; " if contention else
             "no contention between replicas (each on a machine of its own); ")
    if not args.quiet:
        print(f"simulated {len(trace)} requests ({args.dataset}) on {replicas} replicas x {routers}; "
              f"{'arrivals sped up N times for N replicas; ' if len(replicas) > 1 else ''}"
              f"{hosts}"
              f"{sum(s['sim_wall_s'] for s in rows):.1f} s wall")
        print(format_sweep(rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.scale_plot:
        plot_sweep(rows, args.scale_plot)
        print(f"wrote {args.scale_plot}")
    return 1 if any(s["failed"] for s in rows) else 0
