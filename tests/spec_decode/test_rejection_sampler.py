"""Rejection sampler: greedy rows, per-row generators in mixed batches, edge cases of the rule, validation."""

import pytest
import torch

from kvserve.sample.rejection_sampler import PAD_TOKEN_ID, RejectionSampler, accepted_lengths


def one_hot_rows(argmaxes, v=5, low=0.05):
    """``[len(argmaxes), v]`` distributions peaked (not one-hot) on the given tokens."""
    rows = torch.full((len(argmaxes), v), low)
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 1 - low * (v - 1)
    return rows


# ------------------------------------------------------------------------------------------------------ greedy


def test_greedy_accepts_the_matching_prefix_and_emits_argmaxes():
    target = torch.stack(
        [
            one_hot_rows([2, 4, 0, 3]),  # drafts 2, 4 match, 1 does not -> 2, 4, then the argmax 0
            one_hot_rows([1, 1, 1, 3]),  # all three match -> bonus = argmax of row 3
            one_hot_rows([4, 0, 0, 0]),  # no drafts -> argmax of row 0
            one_hot_rows([2, 3, 3, 3]),  # first draft wrong -> argmax of row 0 only
            one_hot_rows([0, 2, 1, 1]),  # one draft, matched -> bonus = argmax of row 1
        ]
    )
    drafts = torch.tensor([[2, 4, 1], [1, 1, 1], [-1, -1, -1], [3, 3, 3], [0, -1, -1]])
    n = [3, 3, 0, 3, 1]
    # a draft distribution that would make a sampled row refuse almost everything: greedy ignores it
    draft_probs = torch.ones(5, 3, 5)
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    out = RejectionSampler()(drafts, n, draft_probs, target, torch.ones(5, dtype=torch.bool), [g] * 5)
    assert out.tolist() == [
        [2, 4, 0, -1],
        [1, 1, 1, 3],
        [4, -1, -1, -1],
        [2, -1, -1, -1],
        [0, 2, -1, -1],
    ]
    assert accepted_lengths(out) == [2, 3, 0, 0, 1]
    assert torch.equal(g.get_state(), state)  # greedy rows draw no random numbers


def test_greedy_with_one_hot_drafts_matches_plain_argmax_decoding():
    """Greedy verification reproduces token-by-token argmax decoding of the same target rows."""
    torch.manual_seed(0)
    target = torch.randn(8, 5, 11).softmax(dim=-1)
    argmax = target.argmax(dim=-1)
    drafts = argmax[:, :4].clone()
    wrong_at = torch.tensor([0, 1, 2, 3, 4, 4, 2, 0])  # 4 = no wrong draft
    for b, j in enumerate(wrong_at.tolist()):
        if j < 4:
            drafts[b, j] = (drafts[b, j] + 1) % 11
    out = RejectionSampler()(drafts, [4] * 8, None, target, [True] * 8, [None] * 8)
    for b, j in enumerate(wrong_at.tolist()):
        assert out[b, : j + 1].tolist() == argmax[b, : j + 1].tolist()
        assert bool((out[b, j + 1 :] == PAD_TOKEN_ID).all())


# ------------------------------------------------------------------------------------------- mixed batches, seeds


V = 40


def mixed_batch():
    """Five rows, k = 3: seeded sampled (n=2), unseeded sampled (n=3), greedy (n=1), seeded with no drafts,
    seeded greedy (n=3). Distributions flat enough that acceptance is a coin flip."""
    g = torch.Generator().manual_seed(11)
    target = (torch.randn(5, 4, V, generator=g) * 0.7).softmax(dim=-1)
    draft_probs = (torch.randn(5, 3, V, generator=g) * 0.7).softmax(dim=-1)
    drafts = torch.stack([torch.multinomial(draft_probs[b], 1, generator=g)[:, 0] for b in range(5)])
    n = [2, 3, 1, 0, 3]
    for b in range(5):
        drafts[b, n[b] :] = -1
    greedy = [False, False, True, False, True]
    return drafts, n, draft_probs, target, greedy


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def run_alone(row, seed, drafts, n, draft_probs, target, greedy, with_probs=True):
    """Row ``row`` verified on its own, padded to its own draft count only."""
    k = n[row]
    out = RejectionSampler(seeded(999))(
        drafts[row : row + 1, :k],
        [k],
        draft_probs[row : row + 1, :k] if with_probs else None,
        target[row : row + 1, : k + 1],
        [greedy[row]],
        [seeded(seed)],
    )
    return out[0]


@pytest.mark.parametrize("with_probs", [True, False])
def test_seeded_row_is_the_same_alone_and_in_a_mixed_batch(with_probs):
    drafts, n, draft_probs, target, greedy = mixed_batch()
    q = draft_probs if with_probs else None
    alone = {row: run_alone(row, 100 + row, drafts, n, draft_probs, target, greedy, with_probs) for row in (0, 3)}
    for shared_seed in (1, 2):  # the unseeded row's draws differ between these batches
        gens = [seeded(100), None, None, seeded(103), seeded(104)]
        out = RejectionSampler(seeded(shared_seed))(drafts, n, q, target, greedy, gens)
        for row, expected in alone.items():
            assert out[row, : n[row] + 1].tolist() == expected.tolist()
            assert bool((out[row, n[row] + 1 :] == PAD_TOKEN_ID).all())
        # generators advance by the same amount alone and in the batch: later steps stay in sync
        g_alone = seeded(100)
        RejectionSampler()(drafts[:1, :2], [2], None if q is None else q[:1, :2], target[:1, :3], [False], [g_alone])
        assert torch.equal(gens[0].get_state(), g_alone.get_state())


def test_seeded_rows_reproduce_and_seeds_matter():
    drafts, n, draft_probs, target, greedy = mixed_batch()
    runs = {}
    for seed in range(12):
        outs = [
            RejectionSampler()(drafts, n, draft_probs, target, greedy, [seeded(seed)] * 2 + [None] * 3)
            for _ in range(2)
        ]
        assert torch.equal(outs[0][:1], outs[1][:1])
        runs[seed] = tuple(outs[0][0].tolist())
    assert len(set(runs.values())) > 3  # the seeded row's randomness really comes from its generator


def test_unseeded_rows_use_the_samplers_generator():
    drafts, n, draft_probs, target, greedy = mixed_batch()
    a = RejectionSampler(seeded(5))(drafts, n, draft_probs, target, greedy, [None] * 5)
    b = RejectionSampler(seeded(5))(drafts, n, draft_probs, target, greedy, [None] * 5)
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------- edge cases of the rule


def sampled(drafts, n, draft_probs, target, seed=0):
    b = drafts.shape[0]
    return RejectionSampler(seeded(seed))(drafts, n, draft_probs, target, [False] * b, [None] * b)


def test_draft_with_zero_draft_probability_is_accepted_iff_the_target_allows_it():
    b = 2000
    target = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(b, 2, 4).contiguous()
    draft_probs = torch.tensor([0.5, 0.0, 0.0, 0.5]).expand(b, 1, 4).contiguous()
    # q(1) == 0 < p(1): always accepted (min(1, p/q) = 1), no division by zero
    out = sampled(torch.ones(b, 1, dtype=torch.long), [1] * b, draft_probs, target)
    assert bool((out[:, 0] == 1).all())
    assert set(out[:, 1].tolist()) == {1, 2}
    # p(3) == 0: never accepted, and the recovered token avoids it
    out = sampled(torch.full((b, 1), 3), [1] * b, draft_probs, target)
    assert set(out[:, 0].tolist()) == {1, 2} and bool((out[:, 1] == PAD_TOKEN_ID).all())


def test_draft_more_likely_under_the_target_is_always_accepted():
    b = 2000
    target = torch.tensor([0.1, 0.6, 0.3]).expand(b, 3, 3).contiguous()
    draft_probs = torch.tensor([0.4, 0.3, 0.3]).expand(b, 2, 3).contiguous()  # p >= q on tokens 1, 2
    drafts = torch.tensor([[1, 2]]).expand(b, 2).contiguous()
    out = sampled(drafts, [2] * b, draft_probs, target)
    assert accepted_lengths(out) == [2] * b


def test_one_hot_draft_recovers_from_the_target_without_the_refused_token():
    b = 4000
    target = torch.tensor([0.2, 0.3, 0.5]).expand(b, 2, 3).contiguous()
    out = sampled(torch.full((b, 1), 2), [1] * b, None, target)
    refused = out[:, 1] == PAD_TOKEN_ID
    assert abs(refused.double().mean().item() - 0.5) < 0.04  # accepted with probability p(2) = 0.5
    assert set(out[refused, 0].tolist()) == {0, 1}


def test_residual_all_zero_falls_back_to_the_target():
    p = torch.tensor([[0.2, 0.3, 0.5], [0.0, 1.0, 0.0]])
    q_equal = p.clone()
    q_elsewhere = torch.tensor([[0.1, 0.1, 0.8], [0.5, 0.0, 0.5]])
    rs = RejectionSampler()
    out = rs._recovery_distribution(p, q_equal, torch.tensor([2, 1]))
    assert torch.equal(out, p)
    out = rs._recovery_distribution(p, q_elsewhere, torch.tensor([2, 0]))
    assert torch.allclose(out, torch.tensor([[0.1, 0.2, 0.0], [0.0, 1.0, 0.0]]))
    # one-hot q on a token with p == 1 leaves nothing: fall back to p as well
    out = rs._recovery_distribution(p, None, torch.tensor([0, 1]))
    assert torch.allclose(out, torch.tensor([[0.0, 0.3, 0.5], [0.0, 1.0, 0.0]]))
    # end to end: q >= p everywhere (an unnormalised q) refuses sometimes and still emits only p's support
    b = 500
    target = p[:1, None].expand(b, 2, 3).contiguous()
    out = sampled(torch.full((b, 1), 1), [1] * b, (2 * target[:, :1]).contiguous(), target)
    refused = out[:, 1] == PAD_TOKEN_ID
    assert 0 < int(refused.sum()) < b
    assert set(out[refused, 0].tolist()) <= {0, 1, 2}


def test_no_drafts_at_all_samples_the_bonus_from_row_zero():
    b = 3000
    target = torch.tensor([[0.0, 0.7, 0.3]]).expand(b, 1, 3).contiguous()
    out = sampled(torch.empty(b, 0, dtype=torch.long), [0] * b, None, target)
    assert out.shape == (b, 1)
    assert abs((out[:, 0] == 1).double().mean().item() - 0.7) < 0.04
    assert accepted_lengths(out) == [0] * b


# --------------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(draft_token_ids=torch.zeros(2, 2, 2, dtype=torch.long)), "draft_token_ids must be"),
        (dict(target_probs=torch.full((2, 2, 4), 0.25)), r"target_probs must be \[B, k \+ 1, V\]"),
        (dict(draft_probs=torch.full((2, 2, 5), 0.2)), r"draft_probs must be \[B, k, V\]"),
        (dict(num_draft_tokens=[1, 3]), r"num_draft_tokens must be in \[0, k\]"),
        (dict(num_draft_tokens=[1]), "num_draft_tokens must have one entry per row"),
        (dict(greedy=[False]), "greedy must have one entry per row"),
        (dict(generators=[None] * 3), "generators must have one entry per row"),
        (dict(draft_token_ids=torch.tensor([[0, 4], [1, 1]])), r"draft token ids must be in \[0, V\)"),
        (dict(draft_token_ids=torch.tensor([[0, -1], [1, 1]])), r"draft token ids must be in \[0, V\)"),
    ],
)
def test_bad_arguments_raise_value_error(change, message):
    args = dict(
        draft_token_ids=torch.tensor([[0, 1], [2, -1]]),
        num_draft_tokens=[2, 1],
        draft_probs=torch.full((2, 2, 4), 0.25),
        target_probs=torch.full((2, 3, 4), 0.25),
        greedy=[False, True],
        generators=[None, None],
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        RejectionSampler()(**args)


def test_padding_past_num_draft_tokens_is_ignored():
    target = torch.full((1, 3, 4), 0.25)
    out = RejectionSampler()(torch.tensor([[1, 12345]]), [1], None, target, [False], [None])
    assert out.shape == (1, 3) and out[0, 2].item() == PAD_TOKEN_ID
