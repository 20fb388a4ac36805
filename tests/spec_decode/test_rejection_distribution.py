"""The rejection sampler emits tokens distributed exactly as the target (Leviathan et al. 2023, Theorem 3.5).

Synthetic vocabulary of 6 tokens, known target ``p`` and draft ``q`` per position, 40k rows in one batch (each row
one independent trial). Checked with a chi-square test (p-value > 1e-3): the first emitted token against ``p_0``;
the second against ``p_1`` among rows whose first draft was accepted; the bonus against ``p_2`` among rows that
accepted both drafts; and the acceptance rate of the first draft against ``sum_t min(p_0(t), q_0(t))``.
The same statistic is huge for deliberately wrong rules, so the test has power.
"""

import pytest
import torch

from kvserve.sample.rejection_sampler import RejectionSampler
from tests.spec_decode.stats import chi_square

N = 40_000
K = 2
NUM_DRAFTS = [2, 2, 1, 0]  # cycled over the rows: most rows draft 2, some 1, some none

P = torch.tensor([0.05, 0.40, 0.25, 0.10, 0.15, 0.05])
Q_HIGH = torch.tensor([0.50, 0.05, 0.05, 0.30, 0.05, 0.05])  # q >> p on tokens 0 and 3
P_LEFT = torch.tensor([0.50, 0.30, 0.20, 0.0, 0.0, 0.0])
Q_RIGHT = torch.tensor([0.0, 0.0, 0.0, 0.20, 0.30, 0.50])  # support disjoint from P_LEFT
P_GAPS = torch.tensor([0.0, 0.30, 0.30, 0.40, 0.0, 0.0])
Q_GAPS = torch.tensor([0.40, 0.10, 0.0, 0.20, 0.30, 0.0])  # q > 0 where p == 0, and p > 0 where q == 0
BONUS = torch.tensor([0.10, 0.10, 0.20, 0.20, 0.10, 0.30])

CASES = {
    # name: (target rows p_0, p_1, p_2 for the bonus; draft rows q_0, q_1 or None for a fixed one-hot draft)
    "q_much_larger_than_p": ((P, P_GAPS, BONUS), (Q_HIGH, Q_GAPS)),
    "disjoint_supports": ((P_LEFT, P, BONUS), (Q_RIGHT, Q_HIGH)),
    "zeros_on_both_sides": ((P_GAPS, P, BONUS), (Q_GAPS, Q_HIGH)),
    "p_equals_q": ((P, Q_HIGH, BONUS), (P, Q_HIGH)),
    "one_hot_draft": ((P, P_GAPS, BONUS), None),
}


def run_trials(sampler, target_rows, draft_rows, seed=0):
    """N independent verification steps in one batch; returns (output [N, K+1], num_drafts [N])."""
    g = torch.Generator().manual_seed(seed)
    target = torch.stack(target_rows)[None].expand(N, K + 1, -1).contiguous()
    n = torch.tensor(NUM_DRAFTS).repeat(N // len(NUM_DRAFTS))
    if draft_rows is None:  # a deterministic proposer: always drafts tokens 3, then 1 (one-hot q)
        drafts, draft_probs = torch.tensor([[3, 1]]).expand(N, K).clone(), None
    else:
        q = torch.stack(draft_rows)
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], dim=1)
        draft_probs = q[None].expand(N, K, -1).contiguous()
    drafts[torch.arange(K)[None, :] >= n[:, None]] = -1
    out = sampler(drafts, n.tolist(), draft_probs, target, [False] * N, [None] * N)
    return out, n


def assert_follows(tokens, probs):
    stat, p_value = chi_square(tokens, probs)
    assert p_value > 1e-3, f"chi-square {stat:.1f}, p-value {p_value:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_tokens_follow_the_target_at_every_position(case):
    target_rows, draft_rows = CASES[case]
    out, n = run_trials(RejectionSampler(torch.Generator().manual_seed(1)), target_rows, draft_rows)
    emitted = (out >= 0).sum(dim=1)
    assert bool((emitted >= 1).all()) and bool((emitted <= n + 1).all())
    assert_follows(out[:, 0], target_rows[0])
    if draft_rows is not None:  # P(accept draft 0) = sum_t min(p(t), q(t)) (Leviathan et al. 2023, Def. 3.1)
        drafted = n >= 1
        rate = (emitted[drafted] >= 2).double().mean().item()
        alpha = torch.minimum(target_rows[0], draft_rows[0]).sum().item()
        assert abs(rate - alpha) <= 4 * (alpha * (1 - alpha) / drafted.sum().item()) ** 0.5 + 1e-6, (rate, alpha)
    if case == "disjoint_supports":  # p(draft) is always 0: nothing is ever accepted
        assert bool((emitted == 1).all())
        return
    second = out[:, 1][emitted >= 2]  # first draft accepted: the second token is accepted, recovered or bonus
    assert second.numel() > 2000
    assert_follows(second, target_rows[1])
    assert_follows(out[:, 2][emitted == 3], target_rows[2])  # both accepted: the bonus token


class AlwaysAccept(RejectionSampler):
    """Wrong: keeps every draft (the output then follows q, not p)."""

    @staticmethod
    def _accept(target_p, draft_q, uniforms):
        return torch.ones_like(target_p, dtype=torch.bool)


class RecoverFromTarget(RejectionSampler):
    """Wrong: at a refusal, samples from p instead of the residual max(0, p - q) (a plausible bug)."""

    @staticmethod
    def _recovery_distribution(target, draft, draft_token):
        return target


class AcceptSquaredRatio(RejectionSampler):
    """Wrong: accepts with probability min(1, p / q) ** 2, i.e. too rarely when p < q."""

    @staticmethod
    def _accept(target_p, draft_q, uniforms):
        return uniforms * draft_q**2 < target_p**2


@pytest.mark.parametrize(
    "wrong, case",
    [
        (AlwaysAccept, "q_much_larger_than_p"),
        (AlwaysAccept, "disjoint_supports"),
        (AlwaysAccept, "one_hot_draft"),
        (RecoverFromTarget, "q_much_larger_than_p"),
        (RecoverFromTarget, "one_hot_draft"),
        (AcceptSquaredRatio, "q_much_larger_than_p"),
    ],
)
def test_the_same_check_rejects_wrong_rules(wrong, case):
    target_rows, draft_rows = CASES[case]
    out, _ = run_trials(wrong(torch.Generator().manual_seed(1)), target_rows, draft_rows)
    stat, p_value = chi_square(out[:, 0], target_rows[0])
    assert stat > 500 and p_value < 1e-50, (stat, p_value)
