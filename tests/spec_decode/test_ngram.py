"""N-gram (prompt lookup) proposer: exact proposals on hand-made sequences, a brute-force reference, validation."""

import random

import pytest

from kvserve.spec_decode import NgramProposer, Proposer


@pytest.mark.parametrize(
    "lookup, tokens, k, expected",
    [
        # the 3-token suffix 1 2 3 occurred at the start: propose what followed, cut at the end of the sequence
        ((1, 3), [1, 2, 3, 4, 1, 2, 3], 5, [4, 1, 2, 3]),
        # ... and cut at max_num_tokens
        ((1, 3), [1, 2, 3, 4, 1, 2, 3], 2, [4, 1]),
        # no earlier occurrence of any suffix
        ((1, 3), [5, 6, 7, 8], 3, []),
        # longest first: "1 2 3" -> 10 11 ...; the 1-gram "3" alone would have given 20 5 (more recent)
        ((1, 3), [1, 2, 3, 10, 11, 9, 3, 20, 5, 1, 2, 3], 3, [10, 11, 9]),
        ((1, 1), [1, 2, 3, 10, 11, 9, 3, 20, 5, 1, 2, 3], 3, [20, 5, 1]),
        # most recent earlier occurrence of the same n-gram wins
        ((1, 3), [1, 2, 7, 1, 2, 8, 1, 2], 2, [8, 1]),
        # min bound: only a 1-gram matches, so min=2 finds nothing
        ((2, 3), [4, 9, 5, 6, 9], 2, []),
        ((1, 3), [4, 9, 5, 6, 9], 2, [5, 6]),
        # max bound: the 4-gram "1 2 3 4" would match at 0, but max=2 uses the 2-gram "3 4" (most recent at 5)
        ((1, 2), [1, 2, 3, 4, 7, 3, 4, 8, 1, 2, 3, 4], 2, [8, 1]),
        ((1, 4), [1, 2, 3, 4, 7, 3, 4, 8, 1, 2, 3, 4], 2, [7, 3]),
        # an earlier occurrence may overlap the suffix, not be it
        ((1, 3), [1, 1, 1, 1], 3, [1]),
        ((1, 3), [2, 1, 1, 1], 3, [1]),
        # too short to contain an earlier occurrence, empty, nothing wanted
        ((1, 3), [7], 3, []),
        ((1, 3), [], 3, []),
        ((1, 3), [1, 2, 3, 4, 1, 2, 3], 0, []),
    ],
)
def test_exact_proposals(lookup, tokens, k, expected):
    assert NgramProposer(*lookup).lookup(tokens, k) == expected


def reference(tokens, k, lo, hi):
    """Brute force, straight from the definition."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    proposers = {(lo, hi): NgramProposer(lo, hi) for lo in (1, 2, 3) for hi in (lo, lo + 1, 5)}
    hits = 0
    for _ in range(300):
        tokens = [rng.randrange(rng.choice([2, 4, 30])) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(0, 6)
        for (lo, hi), proposer in proposers.items():
            got = proposer.lookup(tokens, k)
            assert got == reference(tokens, k, lo, hi), (tokens, k, lo, hi)
            hits += bool(got)
    assert hits > 500  # the random sequences exercise matches, not only misses


def test_long_context_lookup():
    """A match far back in a 4,000-token context (its speed is a benchmark's business: benchmarks/spec.py)."""
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(4000)]
    tokens += tokens[1000:1010]  # the last 3 tokens occurred at 1007..1009
    proposer = NgramProposer(1, 3)
    assert proposer.lookup(tokens, 5) == tokens[1010:1015]


def test_is_a_proposer():
    assert isinstance(NgramProposer(), Proposer)
    with pytest.raises(TypeError):
        Proposer()


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 3), r"prompt_lookup_min must be an integer >= 1, got 0"),
        ((2, 1), r"prompt_lookup_max must be an integer >= prompt_lookup_min \(2\), got 1"),
        ((1.5, 3), r"prompt_lookup_min must be an integer >= 1, got 1.5"),
    ],
)
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(*args)


def test_negative_max_num_tokens():
    with pytest.raises(ValueError, match="max_num_tokens must be >= 0, got -1"):
        NgramProposer().lookup([1, 2, 1], -1)
