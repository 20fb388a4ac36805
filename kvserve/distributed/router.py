"""Routing requests across data-parallel replicas: prefix-cache-aware, least-loaded, round-robin.

Pure Python, no Ray: the Ray Serve request router (``kvserve.entrypoints.ray.router``) and the cluster simulator
(``kvserve.sim.cluster``) drive the same classes.

The prefix-aware policy (the idea of SGLang's cache-aware router and Ray Serve LLM's ``PrefixCacheAffinityRouter``,
here on the engine's own block hashes instead of characters): a prompt's leading full blocks get the chained
``BlockHash`` values the block pool keys its prefix cache by (``kvserve.core.block_pool.hash_block``). For each
replica the router keeps the hashes of the prompts it has routed there (an LRU set capped at the replica's pool size,
a model of what that replica's prefix cache holds); a request goes to the replica holding the longest run of its
leading hashes, unless

- the best hit is not useful: fewer than ``min_match_blocks`` blocks, or less than ``min_match_ratio`` of the
  prompt's full blocks (a shared system prompt alone does not pin every request to one replica; SGLang's router has
  the same ``cache_threshold``), or
- that replica is overloaded: its load (running + waiting requests) exceeds the least loaded replica's by more than
  ``balance_abs`` requests AND by more than a factor ``balance_rel`` (SGLang's two-threshold rule), or its KV usage
  is above ``kv_usage_limit``;

then it goes to the least loaded replica (fewest running + waiting, then lowest KV usage, then lowest id). Ties in
match length go to the less loaded replica. Every choice is deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence

from kvserve.core.block_pool import BlockHash, hash_block

ROUTERS = ("prefix", "least-loaded", "round-robin")


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica's load.

    Attributes:
        num_running: requests in its running batch (or in flight to it, as the router counts them).
        num_waiting: requests queued behind them.
        kv_usage: fraction of its KV blocks in use, 0..1.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0

    @property
    def load(self) -> int:
        """``num_running + num_waiting``."""
        return self.num_running + self.num_waiting


def block_hash_chain(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The chained ``BlockHash`` of each full block of ``token_ids``, exactly as ``KVCacheManager.block_hashes``
    computes them for a request with these tokens (``hash_block``, no extra keys), so a simulated request can carry
    them into its KV manager.

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash values (``BlockHash.value``, 32 bytes each) of ``block_hash_chain``: what the routers compare.

    Raises:
        ValueError: ``block_size < 1``.
    """
    return [h.value for h in block_hash_chain(token_ids, block_size)]


def least_loaded(loads: dict) -> Hashable:
    """The replica id with the fewest running + waiting requests, then the lowest KV usage, then the lowest id.

    Raises:
        ValueError: no replicas.
    """
    if not loads:
        raise ValueError("no replicas to route to")
    return min(loads, key=lambda r: (loads[r].load, loads[r].kv_usage, _order_key(r)))


def _order_key(replica_id) -> tuple:
    return (type(replica_id).__name__, replica_id if isinstance(replica_id, (int, float)) else str(replica_id))


class Router:
    """The routing interface: ``choose`` one replica for a request, be told where it went (``on_routed``), forget a
    replica that is gone (``remove_replica``). Subclasses implement ``choose``."""

    name = ""

    def choose(self, block_hashes: Sequence[bytes], loads: dict) -> Hashable:
        """The replica id (a key of ``loads``: ``{replica_id: ReplicaLoad}``, the live replicas) for a request whose
        prompt has these leading block hashes (``prompt_block_hashes``).

        Raises:
            ValueError: ``loads`` is empty.
        """
        raise NotImplementedError

    def on_routed(self, replica_id: Hashable, block_hashes: Sequence[bytes]) -> None:
        """The request with these block hashes was sent to ``replica_id``."""

    def remove_replica(self, replica_id: Hashable) -> None:
        """``replica_id`` is gone (died or scaled down): forget what was learned about it."""


class RoundRobinRouter(Router):
    """Each request to the next live replica in id order (after the one chosen last)."""

    name = "round-robin"

    def __init__(self):
        self._last = None

    def choose(self, block_hashes: Sequence[bytes], loads: dict) -> Hashable:
        if not loads:
            raise ValueError("no replicas to route to")
        ids = sorted(loads, key=_order_key)
        if self._last is None:
            pick = ids[0]
        else:
            later = [r for r in ids if _order_key(r) > _order_key(self._last)]
            pick = later[0] if later else ids[0]
        self._last = pick
        return pick


class LeastLoadedRouter(Router):
    """Each request to ``least_loaded(loads)``."""

    name = "least-loaded"

    def choose(self, block_hashes: Sequence[bytes], loads: dict) -> Hashable:
        return least_loaded(loads)


class PrefixAwareRouter(Router):
    """Longest cached run of leading block hashes wins, within a load-imbalance bound (see the module docstring).

    Args:
        cache_blocks: blocks remembered per replica (LRU); the replica's pool size (``num_blocks``) models its
            prefix cache.
        min_match_blocks: the fewest leading blocks that make a hit worth following (>= 1) ...
        min_match_ratio: ... and the least fraction of the prompt's full blocks (0..1).
        balance_abs: the prefix choice is overridden when its load exceeds the least loaded replica's by more than
            this many requests ...
        balance_rel: ... and is more than ``balance_rel`` times it.
        kv_usage_limit: ... or when its KV usage is above this fraction.

    Raises:
        ValueError: a bound out of range.

    Attributes:
        num_prefix_routed, num_fallback_routed: choices made by prefix match / by load (no hit or over the bound).
        num_overridden: prefix choices overridden by the imbalance or KV bound (included in ``num_fallback_routed``).
    """

    name = "prefix"

    def __init__(self, cache_blocks: int = 1 << 20, min_match_blocks: int = 1, min_match_ratio: float = 0.3,
                 balance_abs: int = 8, balance_rel: float = 1.5, kv_usage_limit: float = 0.95):
        if cache_blocks < 1:
            raise ValueError(f"cache_blocks must be >= 1, got {cache_blocks}")
        if min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be >= 1, got {min_match_blocks}")
        if not 0.0 <= min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {min_match_ratio}")
        if balance_abs < 0 or not balance_rel >= 1.0:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got {balance_abs}, {balance_rel}")
        if not 0.0 < kv_usage_limit <= 1.0:
            raise ValueError(f"kv_usage_limit must be in (0, 1], got {kv_usage_limit}")
        self.cache_blocks = cache_blocks
        self.min_match_blocks = min_match_blocks
        self.min_match_ratio = min_match_ratio
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.kv_usage_limit = kv_usage_limit
        self._cached: dict = {}  # replica id -> OrderedDict(hash value -> None), LRU order
        self.num_prefix_routed = self.num_fallback_routed = self.num_overridden = 0

    def match_length(self, replica_id: Hashable, block_hashes: Sequence[bytes]) -> int:
        """How many leading ``block_hashes`` the router believes ``replica_id`` holds."""
        cached = self._cached.get(replica_id)
        if not cached:
            return 0
        n = 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n

    def overloaded(self, replica_id: Hashable, loads: dict) -> bool:
        """Whether ``replica_id`` is past the imbalance bound or the KV usage limit."""
        mine = loads[replica_id]
        lowest = min(x.load for x in loads.values())
        return (mine.kv_usage > self.kv_usage_limit
                or (mine.load - lowest > self.balance_abs and mine.load > self.balance_rel * lowest))

    def choose(self, block_hashes: Sequence[bytes], loads: dict) -> Hashable:
        if not loads:
            raise ValueError("no replicas to route to")
        best, best_len = None, 0
        for r in sorted(loads, key=lambda r: (loads[r].load, loads[r].kv_usage, _order_key(r))):
            n = self.match_length(r, block_hashes)
            if n > best_len:
                best, best_len = r, n
        if best is not None and best_len >= max(self.min_match_blocks, self.min_match_ratio * len(block_hashes)):
            if not self.overloaded(best, loads):
                self.num_prefix_routed += 1
                return best
            self.num_overridden += 1
        self.num_fallback_routed += 1
        return least_loaded(loads)

    def on_routed(self, replica_id: Hashable, block_hashes: Sequence[bytes]) -> None:
        cached = self._cached.setdefault(replica_id, OrderedDict())
        for h in reversed(block_hashes):  # leading blocks most recent: evicted last, as the pool frees tail-first
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.cache_blocks:
            cached.popitem(last=False)

    def remove_replica(self, replica_id: Hashable) -> None:
        self._cached.pop(replica_id, None)


def make_router(name: str, **prefix_kwargs) -> Router:
    """A router by ``--router`` name (``ROUTERS``); ``prefix_kwargs`` go to ``PrefixAwareRouter``.

    Raises:
        ValueError: an unknown name.
    """
    if name == "prefix":
        return PrefixAwareRouter(**prefix_kwargs)
    if name == "least-loaded":
        return LeastLoadedRouter()
    if name == "round-robin":
        return RoundRobinRouter()
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")


def imbalance(counts: Iterable[int]) -> Optional[float]:
    """max / mean of per-replica counts (1.0 = perfectly even); ``None`` when the mean is 0."""
    counts = list(counts)
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean else None


def add_bound_args(g) -> None:
    """``--router-balance-abs`` / ``--router-balance-rel``: the prefix router's imbalance bound (also on ``kvserve
    serve``)."""
    g.add_argument("--router-balance-abs", type=int, default=8,
                   help="prefix router: a hit is not followed when its replica has more than this many requests "
                        "(running + waiting) above the least loaded one ... (default 8)")
    g.add_argument("--router-balance-rel", type=float, default=1.5,
                   help="... and more than this factor times its load (default 1.5)")


def bound_kwargs(args) -> dict:
    """``PrefixAwareRouter`` keywords from ``--router-balance-abs`` / ``--router-balance-rel``."""
    return {"balance_abs": args.router_balance_abs, "balance_rel": args.router_balance_rel}
