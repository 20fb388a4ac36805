"""The in-memory store of ``/v1/responses`` answers (``store: true``): what ``GET /v1/responses/{id}`` returns and
what ``previous_response_id`` continues. Bounded three ways, each a ``kvserve serve`` flag: entries
(``--responses-store-max-entries``), bytes (``--responses-store-max-bytes``, the stored JSON's size) and age
(``--responses-store-ttl``, seconds); past a bound the oldest entries go first. A process restart forgets them
all (as vLLM's in-memory store).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Optional

from kvserve.validation import check_int


@dataclass
class StoreLimits:
    """The store's bounds (each a flag of the same name, ``--responses-store-...``)."""

    responses_store_max_entries: int = field(default=1000, metadata={
        "help": "most /v1/responses answers kept for GET and previous_response_id (default: 1000)"})
    responses_store_max_bytes: int = field(default=64 * 2**20, metadata={
        "help": "most bytes of stored /v1/responses answers and their conversations (default: 64 MiB)"})
    responses_store_ttl: int = field(default=3600, metadata={
        "help": "seconds a stored /v1/responses answer is kept (default: 3600)"})

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f.name, getattr(self, f.name), 1)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "StoreLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_args(parser: argparse.ArgumentParser) -> None:
    """The store's flags (``--responses-store-max-entries``, ``--responses-store-max-bytes``,
    ``--responses-store-ttl``)."""
    g = parser.add_argument_group("/v1/responses store")
    for f in fields(StoreLimits):
        g.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default, help=f.metadata["help"])


@dataclass
class StoredResponse:
    """A stored answer: ``response`` (the Responses object, JSON types), ``conversation`` (the chat messages it
    continued from plus its own output, what a ``previous_response_id`` continues), its size and time, and
    ``input_items`` (its request's input as items: ``responses_items.input_items_of``)."""

    response: dict
    conversation: list
    nbytes: int
    created: float
    input_items: list = field(default_factory=list)


class ResponseStore:
    """Bounded in-memory map of response id -> ``StoredResponse`` (insertion order = eviction order).

    Args:
        limits: the bounds; ``clock``: seconds (``time.monotonic``; tests pass their own).
    """

    def __init__(self, limits: Optional[StoreLimits] = None, clock=time.monotonic):
        self.limits = limits or StoreLimits()
        self.clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response: dict, conversation: list, input_items: Optional[list] = None) -> bool:
        """Store (or replace) ``response`` under its ``id`` (with its ``input_items``); returns False if it alone
        exceeds the byte bound (it is then not kept). Older entries go while a bound is exceeded."""
        rid = response["id"]
        self.delete(rid)
        input_items = input_items or []
        size = sum(len(json.dumps(x, separators=(",", ":"))) for x in (response, conversation, input_items))
        if size > self.limits.responses_store_max_bytes:
            return False
        self._items[rid] = StoredResponse(response, conversation, size, self.clock(), input_items)
        self.nbytes += size
        while (len(self._items) > self.limits.responses_store_max_entries
               or self.nbytes > self.limits.responses_store_max_bytes):
            self._pop_oldest()
        return True

    def get(self, rid: str) -> Optional[StoredResponse]:
        """The entry, or ``None`` (unknown, evicted or expired)."""
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; True if it was stored."""
        item = self._items.pop(rid, None)
        if item is None:
            return False
        self.nbytes -= item.nbytes
        return True

    def _pop_oldest(self) -> None:
        _, item = self._items.popitem(last=False)
        self.nbytes -= item.nbytes

    def _expire(self) -> None:
        deadline = self.clock() - self.limits.responses_store_ttl
        while self._items and next(iter(self._items.values())).created < deadline:
            self._pop_oldest()
