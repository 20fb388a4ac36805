"""Engine-level counters over a run: steps, batch occupancy, KV usage and waste, naive reservation, preemptions."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.core.kv_cache_manager import KVCacheStats


@dataclass
class EngineStats:
    """Accumulated per step by ``LLMEngine.step``.

    Attributes:
        num_steps: steps that ran the model.
        num_preemptions: preemptions so far.
        sum_running: sum over steps of requests scheduled (mean batch size = sum_running / num_steps).
        peak_used_blocks: most blocks in use after any step; ``num_blocks`` the pool size.
        sum_allocated_tokens, sum_stored_tokens: slots held vs tokens with K/V, summed over steps (KV waste =
            1 - stored / allocated, averaged over the run).
        peak_naive_reserved_tokens: most tokens that reserving prompt + max_tokens per running request would
            have needed at once; ``peak_allocated_tokens`` is what paging actually held at its peak.
        prompt_tokens, generation_tokens: tokens of finished-or-running requests' prompts and outputs.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found in the prefix cache at
            admission (hit rate = hits / queries).
        spec_decode: the scheduler's ``SpecDecodeStats`` (drafts, draft / accepted tokens, acceptance per
            position, mean accepted length) when speculative decoding is on, else ``None``.
        kv_tier: the disk tier's ``KVTierStats`` (blocks looked up / loaded, bytes read / written, load time) when
            ``kv_disk_cache_dir`` is set, else ``None``.
    """

    num_blocks: int = 0
    block_size: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    sum_running: int = 0
    peak_used_blocks: int = 0
    peak_allocated_tokens: int = 0
    sum_allocated_tokens: int = 0
    sum_stored_tokens: int = 0
    peak_naive_reserved_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_computed_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode: object = None
    kv_tier: object = None

    def record_step(self, num_scheduled_reqs: int, num_scheduled_tokens: int, kv: KVCacheStats) -> None:
        self.num_steps += 1
        self.sum_running += num_scheduled_reqs
        self.num_computed_tokens_total += num_scheduled_tokens
        self.peak_used_blocks = max(self.peak_used_blocks, kv.used_blocks)
        self.peak_allocated_tokens = max(self.peak_allocated_tokens, kv.tokens_allocated)
        self.sum_allocated_tokens += kv.tokens_allocated
        self.sum_stored_tokens += kv.tokens_stored
        self.peak_naive_reserved_tokens = max(self.peak_naive_reserved_tokens, kv.naive_reserved_tokens)

    @property
    def mean_batch_size(self) -> float:
        return self.sum_running / self.num_steps if self.num_steps else 0.0

    @property
    def kv_waste(self) -> float:
        """(allocated - used) / allocated over the run, 0..1."""
        a = self.sum_allocated_tokens
        return (a - self.sum_stored_tokens) / a if a else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens found in the prefix cache, 0..1."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        spec = self.spec_decode
        if spec is not None:
            d["spec_decode"].update(acceptance_rate=spec.acceptance_rate, mean_accepted_length=spec.mean_accepted_length)
        tier = self.kv_tier
        if tier is not None:
            d["kv_tier"].update(misses=tier.misses, hit_rate=tier.hit_rate)
            del d["kv_tier"]["load_seconds_samples"]
        d.update(mean_batch_size=self.mean_batch_size, kv_waste=self.kv_waste,
                 prefix_cache_hit_rate=self.prefix_cache_hit_rate)
        return d
