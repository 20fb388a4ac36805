"""SpecPolicy: the break-even acceptance rate, adaptive k, hold-back with shadow checks (free proposers) and
pause back-off (proposers with a model), all from one acceptance estimate per request (no model)."""

import pytest

from kvserve.spec_decode.policy import SpecPolicy, break_even_acceptance


def test_break_even_acceptance_values():
    assert break_even_acceptance(1) == pytest.approx(0.1 / 1.1)
    assert break_even_acceptance(8) == pytest.approx(0.8 / 1.8)
    assert break_even_acceptance(16) == pytest.approx(1.6 / 2.6)
    assert break_even_acceptance(16, 0.0) == 0.0  # memory-bound step: every draft is worth verifying
    assert break_even_acceptance(1, 0.1, draft_cost=0.25) == pytest.approx(0.25 + 0.1 / 1.1)
    assert break_even_acceptance(64, 1.0, draft_cost=0.5) == 1.0  # capped
    with pytest.raises(ValueError, match="batch_size"):
        break_even_acceptance(0)
    with pytest.raises(ValueError, match="costs must be >= 0"):
        break_even_acceptance(1, -0.1)
    with pytest.raises(ValueError, match="max_pause must be a power of 4"):
        SpecPolicy(4, 4, free=False, max_pause=8)


def test_adaptive_k_grows_on_full_acceptance_and_shrinks_on_rejection():
    policy = SpecPolicy(max_k=4, initial_k=2, free=True)
    st = policy.new_state([])
    assert st.k == 2
    policy.observe_verified(st, 2, 2, batch_size=1)
    assert st.k == 3
    policy.observe_verified(st, 3, 3, batch_size=1)
    policy.observe_verified(st, 4, 4, batch_size=1)
    assert st.k == 4  # capped at max_k
    policy.observe_verified(st, 4, 1, batch_size=1)
    assert st.k == 2  # what was accepted + 1
    policy.observe_verified(st, 2, 0, batch_size=1)
    assert st.k == 1  # nothing accepted: one less, at least 1


def test_free_proposer_holds_back_then_shadow_checks_bring_drafting_back():
    policy = SpecPolicy(max_k=4, initial_k=4, free=True)
    st = policy.new_state([])
    out = []
    assert st.acceptance == 0.5
    assert policy.admit(st, [9, 9], len(out), batch_size=1) == [9, 9]  # 0.5 > 0.09
    policy.observe_verified(st, num_drafted=4, num_accepted=1, batch_size=1)
    assert st.acceptance == pytest.approx(0.45)
    assert policy.budget(st, step=3) == st.k  # a free proposer always drafts (for the shadow check at least)
    # at batch 16 the break-even rate is 0.615: held back, the draft remembered for a shadow check
    assert policy.admit(st, [11, 12], len(out), batch_size=16) == []
    assert st.shadow == (0, [11, 12]) and policy.num_held_back == 1
    assert policy.admit(st, [13], len(out), batch_size=16) == [] and st.shadow == (0, [11, 12])  # one at a time
    policy.observe_shadow(st, out)  # nothing generated yet: no update
    out.append(11)
    policy.observe_shadow(st, out)  # first token came true, second not generated yet: still pending
    assert st.acceptance == pytest.approx(0.45) and st.shadow is not None
    out.append(12)  # the whole draft came true: observation 2/2
    policy.observe_shadow(st, out)
    assert st.shadow is None and st.acceptance == pytest.approx(0.56)
    assert policy.admit(st, [14, 15, 16, 17], len(out), batch_size=16) == []  # 0.56 < 0.615: still held
    out += [14, 15, 99]  # 2 of 4 matched, then a miss: observation 0.5, known already
    policy.observe_shadow(st, out)
    assert st.shadow is None and st.acceptance == pytest.approx(0.548)
    assert policy.admit(st, [1], len(out), batch_size=16) == []
    out.append(1)
    policy.observe_shadow(st, out)
    assert st.acceptance == pytest.approx(0.6384)
    assert policy.admit(st, [13], len(out), batch_size=16) == [13]  # 0.6384 > 0.615: drafting again


def test_costly_proposer_backs_off_by_pauses_and_probes_together():
    policy = SpecPolicy(max_k=4, initial_k=1, free=False, draft_cost=0.3, max_pause=16)
    threshold = policy.break_even(1)  # 0.3 + 0.091
    st = policy.new_state([])
    assert (st.k, st.pause, policy.budget(st, step=7)) == (1, 1, 1)
    assert policy.admit(st, [5], 0, batch_size=1) == [5]  # drafts are always verified: the pause gates drafting
    policy.observe_verified(st, 1, 0, batch_size=1)  # 0.5 -> 0.4: still above
    assert st.pause == 1
    policy.observe_verified(st, 1, 0, batch_size=1)  # 0.32 <= 0.39: back off, estimate reset to the threshold
    assert st.pause == 4 and st.acceptance == pytest.approx(threshold)
    assert [policy.budget(st, s) for s in (4, 5, 6, 7, 8)] == [1, 0, 0, 0, 1]  # probes on multiples of 4
    policy.observe_verified(st, 1, 0, batch_size=1)
    policy.observe_verified(st, 1, 0, batch_size=1)
    policy.observe_verified(st, 1, 0, batch_size=1)
    assert st.pause == 16  # capped at max_pause
    newcomer = policy.new_state([st, policy.new_state([])])  # median of the live pauses [1, 16]
    assert newcomer.pause == 16
    policy.observe_verified(st, 1, 1, batch_size=1)  # a passed probe: the pause shrinks by 4
    assert st.pause == 4 and st.acceptance > threshold
    policy.release(st)
    assert policy.new_state([]).pause == 4  # no live request: the median of the recently released
