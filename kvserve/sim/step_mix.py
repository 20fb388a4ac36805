"""Step mixes: a calibration refitted to the kinds of steps a level will run (``kvserve sim validate --match-mix``).

A server calibration fits three numbers (``ServerCalibrated``: offset, scale, prefill scale) over every step the
server ran while it was measured, each step's relative error counting alike. Those steps are mostly 1- and 8-row
decodes and lone prompts; an overloaded level runs ``max_num_seqs`` rows beside prompt chunks, where the profile's
shape can be off by 7-19% (docs/simulator.md). Here the same calibration steps are weighted so that each class of
step (``mix_key``: its kind and its row count to the next power of two) weighs in the fit as much as that class's
share of the time the simulator predicts for the level, and the three numbers are refitted. This stays a
prediction: the level's requests are an input of the simulation anyway, and no step of the level itself is used.
"""

from __future__ import annotations

from kvserve.engine.step_trace import plan_rows


def step_kind(rows) -> str:
    """``"decode"`` (single-token or draft-verify rows only), ``"prefill"`` (prompt chunks only) or ``"mixed"``, for
    a step given as ``plan_rows`` tuples ``(q, start_pos, spec, logits)``."""
    chunks = sum(1 for q, _, spec, _ in rows if q > 1 and not spec)
    return "decode" if not chunks else ("prefill" if chunks == len(rows) else "mixed")


def mix_key(rows) -> tuple:
    """``(step_kind, b)`` with ``2 ** b`` the smallest power of two >= the step's rows (1 row: 0; 2: 1; 3-4: 2; 5-8: 3;
    9-16: 4 ...)."""
    return step_kind(rows), max(0, len(rows) - 1).bit_length()


class MixRecorder:
    """A step-time callable for ``Simulator`` that passes each plan to ``cost`` and adds the predicted seconds to
    ``times[mix_key]``."""

    def __init__(self, cost):
        self.cost = cost
        self.times: dict = {}

    def __call__(self, so) -> float:
        t = self.cost(so)
        key = mix_key(plan_rows(so))
        self.times[key] = self.times.get(key, 0.0) + t
        return t


def nearest_key(key: tuple, keys) -> tuple:
    """The key of ``keys`` closest to ``key``: the fewest powers of two of rows apart, a change of kind counting as
    two; ties go to the larger row count."""
    return min(keys, key=lambda k: (abs(k[1] - key[1]) + 2 * (k[0] != key[0]), -k[1]))


def matched_weights(step_keys: list, level_times: dict) -> list:
    """A weight per calibration step (``step_keys``: its ``mix_key``) such that the weights of each class sum to
    that class's share of ``level_times`` (seconds per ``mix_key``); a class of the level that the calibration lacks
    lends its share to the ``nearest_key`` one. Steps of a class the level does not run weigh 0.

    Raises:
        ValueError: no calibration steps, or no predicted time.
    """
    total = sum(level_times.values())
    if not step_keys or not total > 0:
        raise ValueError("matching a step mix needs calibration steps and a level with predicted time")
    counts: dict = {}
    for k in step_keys:
        counts[k] = counts.get(k, 0) + 1
    share: dict = {}
    for k, t in level_times.items():
        near = k if k in counts else nearest_key(k, counts)
        share[near] = share.get(near, 0.0) + t / total
    return [share.get(k, 0.0) / counts[k] for k in step_keys]


def predict_matched(raw_sim, cal: dict, cal_steps: list, trace: list, slos) -> tuple:
    """The level ``trace`` replayed with ``cal`` refitted to the level's predicted step mix.

    Simulates ``trace`` with ``cal`` (a ``ServerCalibrated`` dict) to get the time per ``mix_key``, weights the
    calibration's own server steps by ``matched_weights``, refits with ``fit_from_steps`` and replays.

    Args:
        raw_sim: a ``Simulator`` with the profile's uncalibrated cost model.
        cal: ``offset_s``, ``scale``, ``prefill_scale`` of the calibration.
        cal_steps: the server's steps during that calibration (``read_step_trace`` tuples).
        trace: the level's ``TraceRequest`` list; slos: as ``Simulator.run``.

    Returns:
        ``(fit, summary, level_times)``: ``fit_from_steps``'s dict, the replay's summary and the predicted seconds
        per ``mix_key`` (keys as ``"kind/rows<=2**b"`` strings, for a JSON report).

    Raises:
        ValueError: fewer than 3 calibration steps that the level's mix weighs.
    """
    from kvserve.sim.cost_model import ServerCalibrated
    from kvserve.sim.simulator import Simulator
    from kvserve.sim.validate import fit_from_steps, replay

    rec = MixRecorder(ServerCalibrated(raw_sim.step_time, cal["offset_s"], cal["scale"], cal["prefill_scale"]))
    Simulator(raw_sim.config, rec, raw_sim.num_blocks, raw_sim.max_model_len).run(trace, slos)
    weights = matched_weights([mix_key(rows) for *_, rows in cal_steps], rec.times)
    fit = fit_from_steps(cal_steps, raw_sim.step_time, weights=weights)
    times = {f"{kind}/rows<={2 ** b}": t for (kind, b), t in sorted(rec.times.items())}
    return fit, replay(raw_sim, fit, trace, slos), times
