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
    # at batch 16 the break-even rate is 0.615: held back, its first token remembered for a shadow check
    assert gate.admit(req, [11, 12], batch_size=16) == []
    assert req.spec_shadow == (0, 11) and gate.num_held_back == 1
    gate.observe_shadow(req)  # nothing generated yet at index 0: no update
    assert req.spec_acceptance == pytest.approx(0.45)
    req.output_token_ids.append(11)  # the held-back draft came true
    gate.observe_shadow(req)
    assert req.spec_shadow is None and req.spec_acceptance == pytest.approx(0.56)
    assert gate.admit(req, [12], batch_size=16) == [] and req.spec_shadow == (1, 12)  # 0.56 < 0.615: still held
    req.output_token_ids.append(12)
    gate.observe_shadow(req)
    assert req.spec_acceptance == pytest.approx(0.648)
    assert gate.admit(req, [13], batch_size=16) == [13]  # 0.648 > 0.615: drafting again
    req.spec_shadow = (len(req.output_token_ids), 4)
    req.output_token_ids.append(5)  # a miss lowers the estimate
    gate.observe_shadow(req)
    assert req.spec_acceptance == pytest.approx(0.648 * 0.8)
