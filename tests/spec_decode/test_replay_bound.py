"""``replay_passes``: target passes greedy n-gram speculation needs for a known output (no model)."""

from benchmarks.spec import replay_passes
from kvserve.spec_decode.ngram import NgramProposer


def test_replay_passes_counts_accepted_prefixes():
    proposer = NgramProposer(1, 3)
    prompt = [1, 2, 3, 4, 5]
    output = [9, 1, 2, 3, 4, 5, 7]
    # pass 1: the context ends in 5, which occurs nowhere earlier -> no draft, emits 9; pass 2: same for 9, emits 1;
    # pass 3: "1" occurred at the start -> drafts 2, 3, 4, 5 (at most len(output) - i - 1 = 4): all come true,
    # plus the pass's own token 7 -> done in 3 passes (7 tokens / 3 passes = 2.33 tokens per pass)
    assert replay_passes(prompt, output, proposer) == 3
    # one draft a pass: 9 | 1 | 2 (+3) | 4 (+5) | 7
    assert replay_passes(prompt, output, proposer, max_k=1) == 5
    assert replay_passes(prompt, [], proposer) == 0
