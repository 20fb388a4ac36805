"""SpecGate: the break-even acceptance rate and the draft / hold-back / shadow-check bookkeeping (no model)."""

import pytest

from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.gate import SpecGate, break_even_acceptance


def test_break_even_acceptance_values():
    assert break_even_acceptance(1) == pytest.approx(0.1 / 1.1)
    assert break_even_acceptance(8) == pytest.approx(0.8 / 1.8)
    assert break_even_acceptance(16) == pytest.approx(1.6 / 2.6)
    assert break_even_acceptance(16, 0.0) == 0.0  # memory-bound step: every draft is worth verifying
    with pytest.raises(ValueError, match="batch_size"):
        break_even_acceptance(0)
    with pytest.raises(ValueError, match="verify_cost_per_token"):
        break_even_acceptance(1, -0.1)


def test_hold_back_then_shadow_checks_bring_drafting_back():
    gate = SpecGate()
    req = Request("a", [5, 6, 7], SamplingParams(max_tokens=50), max_total_tokens=100)
    assert req.spec_acceptance == 0.5
    assert gate.admit(req, [9, 9], batch_size=1) == [9, 9]  # 0.5 > 0.09
    gate.observe_verified(req, num_drafted=4, num_accepted=1)
    assert req.spec_acceptance == pytest.approx(0.45)
    assert gate.admit(req, [], batch_size=1) == []
    # at batch 16 the break-even rate is 0.615: held back, the draft remembered for a shadow check
    assert gate.admit(req, [11, 12], batch_size=16) == []
    assert req.spec_shadow == (0, [11, 12]) and gate.num_held_back == 1
    assert gate.admit(req, [13], batch_size=16) == [] and req.spec_shadow == (0, [11, 12])  # one at a time
    gate.observe_shadow(req)  # nothing generated yet: no update
    req.output_token_ids.append(11)
    gate.observe_shadow(req)  # first token came true, second not generated yet: still pending
    assert req.spec_acceptance == pytest.approx(0.45) and req.spec_shadow is not None
    req.output_token_ids.append(12)  # the whole draft came true: observation 2/2
    gate.observe_shadow(req)
    assert req.spec_shadow is None and req.spec_acceptance == pytest.approx(0.56)
    assert gate.admit(req, [14, 15, 16, 17], batch_size=16) == []  # 0.56 < 0.615: still held
    req.output_token_ids += [14, 15, 99]  # 2 of 4 matched, then a miss: observation 0.5, known already
    gate.observe_shadow(req)
    assert req.spec_shadow is None and req.spec_acceptance == pytest.approx(0.548)
    assert gate.admit(req, [1], batch_size=16) == []
    req.output_token_ids.append(1)
    gate.observe_shadow(req)
    assert req.spec_acceptance == pytest.approx(0.6384)
    assert gate.admit(req, [13], batch_size=16) == [13]  # 0.6384 > 0.615: drafting again
