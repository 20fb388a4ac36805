"""``kvserve.sample.nucleus``: the candidate-window filters give the distribution a full descending sort gives
(top-k, renormalise, top-p, min-p, in vLLM's order), also when the nucleus outgrows the first window; the
inverse-transform draw follows it (chi-square) and never draws a dropped token."""

import pytest
import torch

from kvserve.sample import nucleus
from kvserve.sampling_params import SamplingParams
from tests.spec_decode.stats import chi_square


def _reference(logits, params):
    """The full-sort implementation the module replaced (kept here as the specification)."""
    b, v = logits.shape
    logits = logits / torch.tensor([p.temperature for p in params])[:, None]
    if any(p.top_k_enabled or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([min(p.top_k, v) if p.top_k_enabled else v for p in params])
        ranks = torch.arange(v)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_p = torch.tensor([p.top_p for p in params])
        sorted_logits = sorted_logits.masked_fill((mass_before > top_p[:, None]) & (ranks > 0), float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params])
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    probs = probs * keep
    return probs / probs.sum(dim=-1, keepdim=True)


PARAMS = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.3, top_p=0.999),      # a nucleus of thousands: the window widens
    SamplingParams(temperature=0.7, top_k=50),
    SamplingParams(temperature=1.0, top_k=3000),       # top_k beyond the first window
    SamplingParams(temperature=0.9, top_k=40, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_p=1e-9),       # only the most likely
]


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_filtered_equals_the_full_sort(scale):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), 49152, generator=g) * scale
    for i, p in enumerate(PARAMS):  # each alone (its own path) and all together (one batch)
        ids, probs = nucleus.filtered(logits[i : i + 1], [p])
        got = nucleus.dense(ids, probs, 49152)
        want = _reference(logits[i : i + 1], [p])
        # the same tokens kept, but for float rounding right at the top-p boundary (cumulative sums in another
        # order): the tokens kept by one only carry < 1e-4 of probability, and the rest agree
        differ = (got > 0) != (want > 0)
        assert float(want[differ].sum() + got[differ].sum()) < 1e-4, p
        assert 0.5 * float((got - want).abs().sum()) < 1e-4, p  # total variation distance
        torch.testing.assert_close(got * ~differ, want * ~differ, rtol=1e-3, atol=1e-7)
    ids, probs = nucleus.filtered(logits, PARAMS)
    got, want = nucleus.dense(ids, probs, 49152), _reference(logits, PARAMS)
    differ = (got > 0) != (want > 0)
    assert float(want[differ].sum() + got[differ].sum()) < 1e-4 * len(PARAMS)
    torch.testing.assert_close(got * ~differ, want * ~differ, rtol=1e-3, atol=1e-7)
    assert ids.shape[1] > nucleus.FIRST_CANDIDATES  # the window grew for the wide nuclei
    assert torch.allclose(probs.sum(dim=-1), torch.ones(len(PARAMS)))


def test_draw_follows_the_distribution_and_skips_dropped_tokens():
    g = torch.Generator().manual_seed(2)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -1.5]])
    for p in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.8)):
        ids, probs = nucleus.filtered(logits, [p])
        want = nucleus.dense(ids, probs, 6)[0]
        n = 20000
        u = torch.rand(n, generator=g, dtype=torch.float64)
        toks = nucleus.draw(None if ids is None else ids.expand(n, -1), probs.expand(n, -1), u)
        stat, p_value = chi_square(toks, want)  # (inf, 0) if a dropped token were drawn
        assert p_value > 1e-3, (p, stat)
    # u at the very top of [0, 1): still a kept token, never a dropped one
    ids, probs = nucleus.filtered(logits, [SamplingParams(temperature=1.0, top_p=0.5)])
    top = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    assert nucleus.dense(ids, probs, 6)[0, nucleus.draw(ids, probs, top)] > 0
    assert nucleus.draw(None, torch.tensor([[0.5, 0.5, 0.0]]), top).item() == 1


def test_two_level_draw_equals_a_float64_inverse_transform():
    """Over a vocabulary that is not a multiple of ``CHUNK``, the two-level draw picks the token a full float64
    running sum picks, for 4000 uniforms (up to rounding right at a boundary: then a neighbour)."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(1, 1000, generator=g) * 2, dim=-1)
    probs[0, 500:520] = 0.0  # dropped tokens inside a chunk
    probs = probs / probs.sum()
    u = torch.rand(4000, generator=g, dtype=torch.float64)
    got = nucleus.draw(None, probs.expand(4000, -1), u)
    c = probs[0].double().cumsum(0)
    want = torch.searchsorted(c, u * c[-1], right=True).clamp_max(999)
    off = got != want
    assert int(off.sum()) <= 2 and bool(((got[off] - want[off]).abs() <= 1).all())
    assert bool((probs[0, got] > 0).all())
    ids = torch.arange(999, -1, -1)[None, :].expand(4000, -1)  # through candidate ids
    assert torch.equal(nucleus.draw(ids, probs.expand(4000, -1), u), 999 - got)


def test_rows_without_top_k_or_top_p_do_not_widen_a_top_p_rows_window():
    """A batch mixing plain rows (temperature only) with top-p / top-k rows: each row's distribution is the one it
    has alone, and the top-p rows' candidate window stays small (the plain rows are filtered apart)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 49152, generator=g) * 3
    params = [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0.7, top_k=50),
              SamplingParams(temperature=0.8), SamplingParams(temperature=0.9, top_k=20, top_p=0.8)]
    mixed = nucleus.probabilities(logits, params)
    for i, p in enumerate(params):
        torch.testing.assert_close(mixed[i], nucleus.probabilities(logits[i : i + 1], [p])[0])
    cut = [i for i, p in enumerate(params) if p.top_k_enabled or p.top_p < 1.0]
    ids, _ = nucleus.filtered(logits[cut], [params[i] for i in cut])
    assert ids.shape[1] <= 49152 // 8  # (one call with the plain rows: the whole vocabulary)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    toks = nucleus.sample(logits, params, u)
    for i, p in enumerate(params):
        assert toks[i] == nucleus.sample(logits[i : i + 1], [p], u[i : i + 1])[0]
        assert mixed[i, toks[i]] > 0
