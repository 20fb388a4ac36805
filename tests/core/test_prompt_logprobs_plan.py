"""The scheduler's prompt-logprobs plan (model-free): which rows of each step score which prompt token, across
chunked prefill, a preemption by recompute and prefix-cache hits — exact rows, no duplicate entries."""

from tests.core.conftest import add, fake_run, make_sched


def run_step(sched):
    """One step with the fake runner; each scored row's entry is ``{target: -position}`` (its position, to check)."""
    so = sched.schedule()
    out = fake_run(so)
    for s in so.scheduled:
        if s.prompt_logprob_targets:
            first = s.start_pos + s.prompt_logprob_start
            out.prompt_logprobs[s.request_id] = [{t: -float(first + j)}
                                                 for j, t in enumerate(s.prompt_logprob_targets)]
    sched.update_from_output(so, out)
    return so


def rows(so, rid):
    s = next(s for s in so.scheduled if s.request_id == rid)
    return s.start_pos, s.prompt_logprob_start, s.prompt_logprob_targets


def expected(req):
    p = req.prompt_token_ids
    return [None] + [{p[i + 1]: -float(i)} for i in range(len(p) - 1)]


def test_chunks_score_each_prompt_position_once_and_the_last_row_samples():
    sched, kv = make_sched(num_blocks=16, block_size=4, max_num_batched_tokens=5)
    req = add(sched, "r", prompt_len=12, max_tokens=2, prompt_logprobs=1)  # prompt ids 3..14
    assert rows(run_step(sched), "r") == (0, 0, [4, 5, 6, 7, 8])  # positions 0..4 score tokens 1..5
    assert rows(run_step(sched), "r") == (5, 0, [9, 10, 11, 12, 13])
    so = run_step(sched)  # positions 10, 11: only 10 scores (11 is the last prompt token: it samples)
    assert rows(so, "r") == (10, 0, [14]) and so.scheduled[0].samples
    assert rows(run_step(sched), "r") == (12, 0, [])  # decoding: nothing to score
    assert req.prompt_logprobs == expected(req) and not sched.has_unfinished_requests()


def test_preemption_mid_prompt_rescores_nothing_and_hits_only_scored_blocks():
    sched, kv = make_sched(num_blocks=16, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=5)
    req = add(sched, "r", prompt_len=12, max_tokens=1, prompt_logprobs=0)
    run_step(sched)  # positions 0..4 scored; block 0 (positions 0..3) cached
    sched._preempt(req)
    # back with 5 positions scored: the cached block 0 hits (all its positions are scored), then the plan scores
    # from position 5 on, never 4 again
    so = run_step(sched)
    assert rows(so, "r") == (4, 1, [9, 10, 11, 12])
    while sched.has_unfinished_requests():
        run_step(sched)
    assert req.prompt_logprobs == expected(req) and req.num_preemptions == 1


def test_prefix_hits_are_skipped_until_the_positions_are_scored():
    sched, kv = make_sched(num_blocks=32, block_size=4, enable_prefix_caching=True)
    add(sched, "warm", prompt_len=12, max_tokens=1)
    run_step(sched)  # its 2 full prompt blocks (positions 0..7) are cached
    scored = add(sched, "scored", prompt_len=12, max_tokens=1, prompt_logprobs=2)
    plain = add(sched, "plain", prompt_len=12, max_tokens=1)
    so = run_step(sched)
    assert rows(so, "scored") == (0, 0, list(range(4, 15)))  # no hit: every position computed and scored
    assert rows(so, "plain")[0] == 8  # the same prefix hits without prompt_logprobs
    assert scored.prompt_logprobs == expected(scored) and plain.prompt_logprobs == [None]
    kv.check_integrity()
