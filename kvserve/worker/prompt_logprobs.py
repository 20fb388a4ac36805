"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI's ``echo`` + ``logprobs``): score each prompt token under
the model's distribution at the position before it, from logits computed in the prefill.

Each scored row is one prefill position ``p`` of a request; its target is the prompt token at ``p + 1``. The
log-softmax is taken over the raw logits (no penalties or temperature, as for generated-token logprobs), so a
prompt scored in one step or split over several chunked-prefill steps gets the same values.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: Rows log-softmaxed at once (bounds the temporary to ``ROWS_PER_PASS x vocab_size`` floats).
ROWS_PER_PASS = 256


@torch.inference_mode()
def score_prompt_rows(logits: torch.Tensor, entries: Sequence) -> tuple[dict[str, list[dict[int, float]]],
                                                                       dict[str, list[int]]]:
    """Per entry, one ``{token_id: logprob}`` per scored row: the target token and the top ``prompt_logprobs``;
    and the target token's rank in each row.

    Args:
        logits: ``[R, V]`` float32, the scored rows of every entry in order (``input_batch.prompt_logprob_rows``).
        entries: the ``ScheduledRequest``s with ``prompt_logprob_targets``, in the same order; each has
            ``prompt_logprobs`` (``k`` in ``[0, 20]``) and ``len(prompt_logprob_targets)`` rows.

    Returns:
        ``(logprobs, ranks)``: request id -> its list of dicts (top-``k`` by logprob first, then the target if not
        among them), the same shape as a generated token's ``logprobs`` entry; and request id -> the target's rank
        per row, vLLM's definition: the number of vocabulary entries whose logprob is >= the target's (1 = the
        most likely token), also when the target is outside the top ``k``.
    """
    targets = torch.tensor([t for e in entries for t in e.prompt_logprob_targets], device=logits.device)
    k_max = max(e.prompt_logprobs for e in entries)
    target_lp, target_rank, top_lp, top_ids = [], [], [], []
    for lo in range(0, logits.shape[0], ROWS_PER_PASS):  # a [rows, V] temporary at a time, not [R, V]
        logprobs = torch.log_softmax(logits[lo : lo + ROWS_PER_PASS].float(), dim=-1)
        tlp = logprobs.gather(1, targets[lo : lo + ROWS_PER_PASS, None])
        target_lp += tlp[:, 0].tolist()
        target_rank += (logprobs >= tlp).sum(dim=-1).tolist()
        top = logprobs.topk(k_max, dim=-1)
        top_lp += top.values.tolist()
        top_ids += top.indices.tolist()
    targets = targets.tolist()
    out, ranks, row = {}, {}, 0
    for e in entries:
        k, entries_of = e.prompt_logprobs, []
        for _ in e.prompt_logprob_targets:
            entry = dict(zip(top_ids[row][:k], top_lp[row][:k]))
            entry[targets[row]] = target_lp[row]
            entries_of.append(entry)
            row += 1
        out[e.request_id] = entries_of
        ranks[e.request_id] = target_rank[row - len(entries_of) : row]
    return out, ranks
