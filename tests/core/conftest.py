"""Shared helpers of the model-free core tests: a scheduler over a small pool and a fake model runner."""

from kvserve.config import SchedulerConfig
from kvserve.core.fake_runner import fake_run  # noqa: F401 (the tests' runner)
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

EOS = 2


def make_sched(num_blocks=64, block_size=4, enable_prefix_caching=False, **cfg):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(SchedulerConfig(**cfg), kv, eos_token_ids=[EOS]), kv


def add(sched, rid, prompt_len, max_tokens, **sp):
    req = Request(str(rid), list(range(3, 3 + prompt_len)),
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp), max_total_tokens=10**6)
    sched.add_request(req)
    return req


def run_to_end(sched, kv, max_steps=10_000, check=None):
    steps = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        if check:
            check(so)
        sched.update_from_output(so, fake_run(so))
        kv.check_integrity()
        steps += 1
        assert steps < max_steps, "scheduler did not drain"
    return steps
