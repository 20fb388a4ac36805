"""The disk tier's block store without a model: exact round trips, every kind of bad entry is a logged miss, LRU by
bytes with exact victims, two processes writing and evicting one directory, and a full disk (ENOSPC) turning writes
off with one warning."""

import errno
import logging
import multiprocessing
import os

import pytest

from kvserve.core import kv_disk_store
from kvserve.core.block_pool import hash_block
from kvserve.core.kv_disk_store import ENTRY_HEADER, DiskBlockStore
from kvserve.core.kv_disk_tier import KVDiskTier

FP = bytes(range(32))
OTHER_FP = bytes(range(1, 33))
PAYLOAD = 4096


def chain(n, base=0, bs=4):
    """``n`` chained block hashes of blocks of ``bs`` token ids."""
    out, parent = [], None
    for i in range(n):
        parent = hash_block(parent, [base + i * bs + j for j in range(bs)])
        out.append(parent)
    return out


def payload_of(h, n=PAYLOAD):
    return [(h.value * (n // 32 + 1))[:n]]


def entry_size(n_tokens=4, n=PAYLOAD):
    return ENTRY_HEADER.size + 8 * n_tokens + n


def test_round_trip_and_exact_verification(tmp_path):
    store = DiskBlockStore(tmp_path, FP, 10**9)
    hs = chain(3)
    for h in hs:
        assert store.put(h, payload_of(h)) == entry_size()
    assert store.put(hs[0], payload_of(hs[0])) == 0  # exists: not written again
    for h in hs:
        assert bytes(store.get(h, PAYLOAD)) == payload_of(h)[0]
    # the same key with other token ids (a forged collision) or another parent is refused
    forged = type(hs[1])(hs[1].value, hs[1].parent, tuple(t + 1 for t in hs[1].token_ids))
    assert store.get(forged, PAYLOAD) is None
    assert store.num_bad_entries == 1 and not store.contains(hs[1])  # (deleted)
    assert store.get(chain(1, base=100)[0], PAYLOAD) is None  # absent: a plain miss
    assert store.num_bad_entries == 1


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "foreign fingerprint", "empty", "other size"])
def test_a_bad_entry_is_a_logged_miss_and_deleted(tmp_path, caplog, damage):
    store = DiskBlockStore(tmp_path, FP, 10**9)
    [h] = chain(1)
    path = store.path(h.value)
    if damage == "foreign fingerprint":  # another model's entry for the same tokens, moved into this one's place
        other = DiskBlockStore(tmp_path, OTHER_FP, 10**9)
        other.put(h, payload_of(h))
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(other.path(h.value), path)
    else:
        store.put(h, payload_of(h))
        data = bytearray(path.read_bytes())
        if damage == "flipped byte":
            data[-100] ^= 0x10
        elif damage == "truncated":
            data = data[: len(data) // 2]
        elif damage == "empty":
            data = bytearray()
        path.write_bytes(bytes(data))
    size = PAYLOAD // 2 if damage == "other size" else PAYLOAD
    with caplog.at_level(logging.WARNING, logger="kvserve.core.kv_disk_store"):
        assert store.get(h, size) is None
    assert store.num_bad_entries == 1
    assert not path.exists()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert store.put(h, payload_of(h)) > 0 and bytes(store.get(h, PAYLOAD)) == payload_of(h)[0]  # rewritten


def test_lru_by_bytes_evicts_the_least_recently_used(tmp_path):
    size = entry_size()
    store = DiskBlockStore(tmp_path, FP, int(3.5 * size))
    a, b, c, d = chain(4)
    for i, h in enumerate((a, b, c)):
        store.put(h, payload_of(h))
        os.utime(store.path(h.value), ns=(10**18 + i, 10**18 + i))  # written in this order
    assert store.get(a, PAYLOAD) is not None  # a hit makes a the most recently used
    store.put(d, payload_of(d))  # 4 entries > 3.5: down to 0.9 * 3.5 = 3.15 entries, oldest first: b
    assert [store.contains(h) for h in (a, b, c, d)] == [True, False, True, True]
    assert store.num_evicted == 1 and store.bytes_evicted == size
    assert store.bytes_estimate == 3 * size
    # a restarted process sees the same directory and budget (the estimate comes from a listing)
    assert DiskBlockStore(tmp_path, FP, int(3.5 * size)).bytes_estimate == 3 * size


def test_the_budget_covers_every_fingerprint_in_the_directory(tmp_path):
    size = entry_size()
    old = DiskBlockStore(tmp_path, OTHER_FP, 10**9)
    for i, h in enumerate(chain(3, base=50)):
        old.put(h, payload_of(h))
        os.utime(old.path(h.value), ns=(10**18 + i, 10**18 + i))
    store = DiskBlockStore(tmp_path, FP, int(3.5 * size))
    [h] = chain(1)
    store.put(h, payload_of(h))  # the other fingerprint's oldest entry goes
    assert store.bytes_estimate == 3 * size and store.contains(h)


def _writer(root, capacity, base, n, errors):
    store = DiskBlockStore(root, FP, capacity)
    for h in chain(n, base=base):
        store.put(h, payload_of(h))
        got = store.get(h, PAYLOAD)  # may have been evicted by the other process: then None, never wrong bytes
        if got is not None and bytes(got) != payload_of(h)[0]:
            errors.put(f"wrong bytes for block {h.token_ids}")
    for h in chain(n, base=0):  # the blocks both write
        got = store.get(h, PAYLOAD)
        if got is not None and bytes(got) != payload_of(h)[0]:
            errors.put(f"wrong bytes for shared block {h.token_ids}")
    errors.put(("done", store.num_bad_entries))


def test_two_processes_share_one_directory(tmp_path):
    size = entry_size()
    capacity = 40 * size
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    # each writes 120 blocks (60 of them the same: the same chain) into a budget of 40 entries
    procs = [ctx.Process(target=_writer, args=(tmp_path, capacity, base, 120, errors)) for base in (0, 0)]
    procs += [ctx.Process(target=_writer, args=(tmp_path, capacity, 10_000, 120, errors))]
    for p in procs:
        p.start()
    results = [errors.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results == [("done", 0)] * 3  # no wrong bytes, no torn entry seen
    entries = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"]
    assert all(p.suffix == ".kvb" for p in entries)  # no temporary file left behind
    # over the budget by at most what each process wrote since its last pass (the rescan interval and one entry)
    assert len(entries) * size <= capacity * (1 + 3 * kv_disk_store.RESCAN_FRACTION) + 3 * size
    store = DiskBlockStore(tmp_path, FP, capacity)  # its own pass: under the budget now
    entries = [p for p in tmp_path.rglob("*.kvb")]
    assert store.bytes_estimate == len(entries) * size <= capacity
    for p in entries:  # every entry left is whole and verifies
        h = next(h for h in chain(120) + chain(120, base=10_000) if p.name.startswith(h.value.hex()))
        assert bytes(store.get(h, PAYLOAD)) == payload_of(h)[0]


def test_a_full_disk_turns_writes_off_with_one_warning(tmp_path, monkeypatch, caplog):
    store = DiskBlockStore(tmp_path, FP, 10**9)
    tier = KVDiskTier(store, PAYLOAD)
    a, b, c = chain(3)
    store.put(a, payload_of(a))

    def full(fd, chunks):
        os.write(fd, b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_disk_store, "_write_all", full)
    with caplog.at_level(logging.WARNING, logger="kvserve.core.kv_disk_store"):
        assert tier.wants(b)
        tier.save(b, payload_of(b))
        tier.flush()
        assert not tier.wants(c)  # writes are off now
        assert store.put(c, payload_of(c)) == 0
    assert not store.write_enabled
    assert len(caplog.records) == 1 and "disk is full" in caplog.records[0].getMessage()
    assert not store.contains(b) and not list(tmp_path.rglob("*.tmp"))  # no partial entry, no temporary file
    assert bytes(store.get(a, PAYLOAD)) == payload_of(a)[0]  # entries already there are still read
    assert tier.stats.writes_dropped == 1 and tier.stats.blocks_written == 0
    tier.close()


def test_an_unusable_directory_is_refused_by_name(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="kv_disk_cache_dir .*file"):
        DiskBlockStore(blocker / "sub", FP, 10**9)


def test_a_load_split_over_threads_stops_at_the_first_bad_entry(tmp_path):
    store = DiskBlockStore(tmp_path, FP, 10**9)
    tier = KVDiskTier(store, PAYLOAD, num_threads=2)
    hs = chain(20)
    for h in hs:
        store.put(h, payload_of(h))
    result = tier.load(hs).result(timeout=60)  # two parts of 10
    assert [bytes(p) for p in result.payloads] == [payload_of(h)[0] for h in hs]
    path = store.path(hs[4].value)
    path.write_bytes(path.read_bytes()[:100])  # a torn entry in the first part: the second part is not used
    result = tier.load(hs).result(timeout=60)
    assert [bytes(p) for p in result.payloads] == [payload_of(h)[0] for h in hs[:4]]
    assert store.num_bad_entries == 1
    tier.close()
