"""The step-time cost model of ``kvserve sim``: a linear model over a step plan's work, fitted to measured steps.

A step's plan (``SchedulerOutput``) is reduced to six features (``step_features``), prefill and decode apart:

| feature | unit | what it stands for |
|---|---|---|
| ``prefill_tokens`` | tokens | tokens of prompt chunks (rows of more than one token): the flat batch's matmuls |
| ``decode_tokens`` | tokens | single-token (decode) rows and verified drafts: the same matmuls, one row each |
| ``logit_rows`` | rows | rows that sample: the LM head (vocab x hidden) and the sampler run once per row |
| ``decode_ctx`` | k query-key pairs | attention of single-token (decode) rows and verification spans: the keys each row reads |
| ``prefill_attn`` | M query-key pairs | causal attention of prompt chunks: ``q * (start + (q + 1) / 2)`` per chunk |
| ``rows`` | rows | per-request bookkeeping: block tables, batch building, output processing |

and ``step_s = intercept + sum(coef[f] * feature[f])`` (intercept: reading the weights once per step, Python
overhead). Prefill and decode tokens get their own coefficients because they run at different efficiency (a
512-token chunk is one large matmul; 32 decode rows are 32 rows with a paged-attention read each). The coefficients are fitted by
non-negative least squares on relative error (every measured step counts alike, a 40 ms decode as much as a 2 s
prefill; reweighted by the prediction so that noisy measurements do not bias totals low: ``nnls_relative``), so the
model can be replayed anywhere. The same shape is used by Vidur (Agrawal et al., MLSys 2024),
which fits per-operator costs; a whole-step model is coarser but needs only a few minutes of measurements on the
real engine (``kvserve sim profile``). Profiles of the first format, with one ``tokens`` feature, still load: its
coefficient becomes both token coefficients (the same prediction).

The two attention terms are the same kernel (``kvserve.attention.cpu``) at two efficiencies: a decode row's keys
are transposed for a few query rows, a prompt chunk's for many, so a pair costs far less in a chunk. Profiles of
the third format counted the pairs of chunks of at most 32 tokens under ``decode_ctx`` (then a separate path) and
profiles of the second counted them under ``prefill_attn``; both load unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.core.sched_output import SchedulerOutput

FEATURES = ("prefill_tokens", "decode_tokens", "logit_rows", "decode_ctx", "prefill_attn", "rows")
FEATURE_UNITS = {"decode_ctx": " (thousands of pairs)", "prefill_attn": " (millions of pairs)"}  # printed after a name
PREFILL_FEATURES = ("prefill_tokens", "prefill_attn")  # a step's prompt-chunk terms (``CostModel.prefill_time``)


def plan_rows(so: SchedulerOutput) -> list:
    """``[[q, start_pos, spec, logits], ...]`` of a plan, one per scheduled request: its query tokens, the position
    of the first, whether it verifies drafts (0/1) and how many rows it samples (0 for a prompt chunk that does not
    end its prompt)."""
    rows = []
    for s in so.scheduled:
        logits = len(s.sampling_states) + len(s.spec_token_ids) if s.samples else 0
        rows.append([len(s.token_ids), s.start_pos, 1 if s.spec_token_ids else 0, logits])
    return rows


def step_features(so: SchedulerOutput) -> tuple:
    """The ``FEATURES`` of one step plan, in that order (tokens, tokens, rows, thousands of kernel query-key pairs,
    millions of SDPA pairs, rows)."""
    return row_features(plan_rows(so))


def row_features(rows) -> tuple:
    """``step_features`` of a step given as ``plan_rows``: ``(q, start_pos, spec, logits)`` per scheduled request
    (tokens, position, 0/1, sampled rows)."""
    prefill_tokens = decode_tokens = n = logit_rows = 0
    decode_ctx = prefill_attn = 0.0
    for q, start, spec, logits in rows:
        n += 1
        logit_rows += logits
        if q == 1 or spec:
            decode_tokens += q
            decode_ctx += q * (start + q)
        else:
            prefill_tokens += q
            prefill_attn += q * (start + (q + 1) / 2)
    return (prefill_tokens, decode_tokens, logit_rows, decode_ctx / 1e3, prefill_attn / 1e6, n)


@dataclass
class CostModel:
    """``step_s = intercept + sum(coef * features)``, seconds.

    Attributes:
        intercept: seconds per step.
        coef: one coefficient per name in ``FEATURES`` (seconds per unit), all >= 0.
    """

    intercept: float
    coef: dict

    def __post_init__(self):
        self._coefs = tuple(self.coef[name] for name in FEATURES)
        self._prefill = tuple(i for i, name in enumerate(FEATURES) if name in PREFILL_FEATURES)

    def step_time(self, features: tuple) -> float:
        """Predicted seconds of a step with these ``FEATURES`` values."""
        t = self.intercept
        for c, x in zip(self._coefs, features):
            t += c * x
        return t

    def prefill_time(self, features: tuple) -> float:
        """The ``PREFILL_FEATURES`` terms of ``step_time`` (seconds): the prompt chunks' own cost."""
        return sum(self._coefs[i] * features[i] for i in self._prefill)

    def __call__(self, so: SchedulerOutput) -> float:
        return self.step_time(step_features(so))

    def split(self, so: SchedulerOutput) -> tuple:
        """``(step seconds, of which its prompt chunks' terms)`` for this plan."""
        f = step_features(so)
        return self.step_time(f), self.prefill_time(f)

    def to_dict(self) -> dict:
        return {"intercept_s": self.intercept, "coef_s": dict(self.coef)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile") -> "CostModel":
        """Raises ``ValueError`` naming the missing or negative field."""
        try:
            intercept = float(d["intercept_s"])
            given = dict(d["coef_s"])
            if "tokens" in given:  # the first profile format: one coefficient for every scheduled token
                shared = given.pop("tokens")
                for name in ("prefill_tokens", "decode_tokens"):
                    given[name] = float(given.get(name, 0.0)) + float(shared)
            coef = {name: float(given[name]) for name in FEATURES}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: cost model needs 'intercept_s' and 'coef_s' with {list(FEATURES)} "
                             f"({type(e).__name__}: {e})") from None
        bad = [k for k, v in {"intercept_s": intercept, **coef}.items() if not v >= 0]
        if bad:
            raise ValueError(f"{where}: cost model values must be >= 0: {bad}")
        return cls(intercept, coef)


def decode_features(batch: int, context: int) -> tuple:
    """``FEATURES`` of a step of ``batch`` single-token decodes at ``context`` tokens each."""
    return (0, batch, batch, batch * (context + 1) / 1e3, 0.0, batch)


def prefill_features(prompt_len: int) -> tuple:
    """``FEATURES`` of a step that prefills one ``prompt_len``-token prompt in one chunk and samples its first
    token."""
    return (prompt_len, 0, 1, 0.0, prompt_len * (prompt_len + 1) / 2 / 1e6, 1)


def fit(samples: list[tuple[tuple, float]]) -> CostModel:
    """Non-negative least squares of ``step_s`` on ``FEATURES`` + intercept on relative error (``nnls_relative``:
    weighted by ``1 / step_s``, then by ``1 / prediction``, so that totals are not biased low).

    Args:
        samples: ``(features, step_s)`` pairs, at least ``len(FEATURES) + 1``.

    Returns:
        the fitted ``CostModel``. A feature whose unconstrained coefficient comes out negative (its effect is
        below the noise, or another feature carries it) is dropped and the rest refitted (active-set NNLS).

    Raises:
        ValueError: too few samples or a non-positive time.
    """
    if len(samples) < len(FEATURES) + 1:
        raise ValueError(f"need at least {len(FEATURES) + 1} measured steps to fit, got {len(samples)}")
    if any(not t > 0 for _, t in samples):
        raise ValueError("measured step times must be > 0")
    full = nnls_relative([[1.0, *f] for f, _ in samples], [t for _, t in samples])
    return CostModel(full[0], dict(zip(FEATURES, full[1:])))


def nnls_relative(x: list, y: list, iterations: int = 4, sample_weight: list | None = None) -> list:
    """Non-negative least squares of ``y ≈ x @ c`` on relative error, by active set: a column whose unconstrained
    coefficient comes out negative is dropped and the rest refitted.

    The first solve weights each row by ``1 / y`` (its relative error). That alone is biased low when the
    measurements are noisy (a step measured slow weighs less than one measured fast: with the ~10-15% spread of
    steps on a shared CPU, totals came out 3-6% short). Each further iteration weights each row by ``1 /
    prediction`` instead (iteratively reweighted least squares for errors proportional to the mean: the gamma
    quasi-likelihood with identity link, McCullagh & Nelder, *Generalized Linear Models*, 2nd ed. 1989, ch. 8-9),
    whose estimate of the mean, and so of total time, is unbiased; on exact data every iteration gives the same
    coefficients.

    Args:
        x: rows of regressors, ``n x k``; y: ``n`` positive targets.
        iterations: solves in all (``1``: plain relative error).
        sample_weight: ``n`` weights >= 0 on each row's squared relative error (``None``: all 1).

    Returns:
        the ``k`` coefficients (0.0 for dropped columns).
    """
    xt = torch.tensor(x, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)
    sw = torch.ones_like(yt) if sample_weight is None else torch.tensor(sample_weight, dtype=torch.float64).sqrt()
    w = sw / yt
    full = [0.0] * xt.shape[1]
    for _ in range(max(1, iterations)):
        active = list(range(xt.shape[1]))
        sol = torch.zeros(0, dtype=torch.float64)
        while active:
            sol = torch.linalg.lstsq(xt[:, active] * w[:, None], (yt * w)[:, None]).solution[:, 0]
            neg = [a for a, v in zip(active, sol.tolist()) if v < 0]
            if not neg:
                break
            worst = min(neg, key=lambda a: sol[active.index(a)].item())
            active.remove(worst)
        full = [0.0] * xt.shape[1]
        for a, v in zip(active, sol.tolist()):
            full[a] = v
        pred = xt @ torch.tensor(full, dtype=torch.float64)
        if not bool((pred > 0).all()):  # a prediction of 0 s cannot weigh a row: keep the last weights' answer
            break
        w = sw / pred
    return full


def fit_errors(model: CostModel, samples: list[tuple[tuple, float]]) -> dict:
    """Relative errors of ``model`` on ``samples``: mean and max of ``|pred - meas| / meas``."""
    errs = [abs(model.step_time(f) - t) / t for f, t in samples]
    return {"mean_abs_rel_err": sum(errs) / len(errs), "max_abs_rel_err": max(errs), "n": len(errs)}
