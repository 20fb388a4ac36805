"""Pearson's chi-square goodness-of-fit test, without scipy."""

import torch


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple:
    """Goodness of fit of observed tokens to a distribution.

    Args:
        tokens: ``[N]`` int64, observed token ids in ``[0, V)``.
        probs: ``[V]`` float, the hypothesised distribution (sums to 1).

    Returns:
        ``(statistic, p_value)`` over the support of ``probs`` (``support - 1`` degrees of freedom); a token
        outside the support makes both ``(inf, 0.0)``.
    """
    probs = probs.double() / probs.double().sum()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return float("inf"), 0.0
    expected = tokens.numel() * probs[support]
    assert float(expected.min()) >= 5, "too few trials for the chi-square approximation"
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    p_value = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2)
    return float(stat), float(p_value)
