"""A model-free runner: the scheduler and KV cache manager driven without a model.

The simulator (``kvserve.sim``), the lab (``examples/lab.py``) and the scheduler tests all step the real
``Scheduler`` with outputs made up here instead of a forward pass, so they exercise exactly the engine's
scheduling and paging (vLLM's ``tests/v1/core/test_scheduler.py`` hand-builds runner outputs the same way).
"""

from __future__ import annotations

from typing import Optional

from kvserve.core.sched_output import ModelRunnerOutput, SchedulerOutput

#: The first token id ``fake_run`` gives when no fixed ``token_id`` is asked for (away from special tokens).
FIRST_FAKE_TOKEN = 100


def fake_run(scheduler_output: SchedulerOutput, token_id: Optional[int] = None,
             drafts_accepted: Optional[dict[str, int]] = None) -> ModelRunnerOutput:
    """The ``ModelRunnerOutput`` of a step in which every sample the plan draws gets a made-up token.

    Args:
        scheduler_output: the step's plan.
        token_id: the token every sample gets; ``None``: ``FIRST_FAKE_TOKEN + (outputs the sample has so far)``,
            distinct per position so tests can follow each one.
        drafts_accepted: for a request verifying ``k`` drafts, how many of them are accepted (request id ->
            count, default all ``k``); the accepted drafts are followed by the bonus token (vLLM's rule: accepted
            + one).

    Returns:
        ``sampled_token_ids`` for every sample of every sampling entry; ``num_accepted`` for verifying ones.
    """
    out = ModelRunnerOutput()
    for s in scheduler_output.scheduled:
        k = len(s.spec_token_ids)
        for st in s.sampling_states:
            a = (drafts_accepted or {}).get(s.request_id, k) if k else 0
            n = len(st.output_token_ids) + a
            bonus = FIRST_FAKE_TOKEN + n if token_id is None else token_id
            out.sampled_token_ids[st.request_id] = list(s.spec_token_ids[:a]) + [bonus]
            if k:
                out.num_accepted[st.request_id] = a
    return out
