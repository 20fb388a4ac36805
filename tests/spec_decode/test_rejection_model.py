"""The rejection sampler on the real model's next-token distribution (SmolLM2-135M, temperature 1).

Target ``p``: the top-20 tokens of the next-token distribution after "My favourite colour is", renormalised (what
top_k=20 at temperature 1 samples from). Draft ``q``: the temperature-2 distribution over the top 64 tokens, so
``q`` is flatter, larger than ``p`` on the tail and puts mass on 44 tokens ``p`` forbids. 20k trials run in one
batch over those 64 token ids (a full-vocabulary ``[20000, 2, 49152]`` batch would take 8 GB); a small batch over
the full vocabulary checks the real token ids come back.
"""

import pytest
import torch

from kvserve.model.backends import select_backends
from kvserve.model.loader import load_model
from kvserve.model.registry import build_model
from kvserve.sample.rejection_sampler import RejectionSampler
from tests.conftest import flat_batch
from tests.spec_decode.stats import chi_square

pytestmark = pytest.mark.real_model

PROMPT = "My favourite colour is"
N = 20_000
TOP_P_TOKENS, TOP_Q_TOKENS = 20, 64


@pytest.fixture(scope="module")
def next_token_logits():
    """``[V]`` float32 logits for the token after PROMPT."""
    loaded = load_model()
    model = build_model(loaded, select_backends("cpu", torch.float32))
    ids = loaded.tokenizer.encode(PROMPT)
    bs = 16
    kv = torch.zeros(model.kv_cache_shape(1, bs))
    return model.forward(flat_batch([(ids, 0, [0])], bs), kv)[0]


def distributions(logits):
    """(token ids [64], p [64], q [64]) over the 64 most likely tokens."""
    top = logits.topk(TOP_Q_TOKENS)
    p = torch.zeros(TOP_Q_TOKENS)
    p[:TOP_P_TOKENS] = top.values[:TOP_P_TOKENS].softmax(dim=-1)  # top-k 20 at temperature 1
    q = (top.values / 2.0).softmax(dim=-1)
    return top.indices, p, q


def trials(sampler, p, q, generator):
    drafts = torch.multinomial(q, N, replacement=True, generator=generator)[:, None]
    target = p[None, None].expand(N, 2, -1).contiguous()
    return sampler(drafts, [1] * N, q[None, None].expand(N, 1, -1), target, [False] * N, [None] * N)


def test_emitted_tokens_follow_the_models_distribution(next_token_logits):
    ids, p, q = distributions(next_token_logits)
    assert float((q[:TOP_P_TOKENS] < p[:TOP_P_TOKENS]).float().mean()) > 0.3  # q differs in both directions
    assert float(q[TOP_P_TOKENS:].sum()) > 0.2
    out = trials(RejectionSampler(torch.Generator().manual_seed(5)), p, q, torch.Generator().manual_seed(6))
    stat, p_value = chi_square(out[:, 0], p)
    assert p_value > 1e-3, (stat, p_value)
    # the bonus token after an accepted draft follows p too
    stat, p_value = chi_square(out[:, 1][out[:, 1] >= 0], p)
    assert p_value > 1e-3, (stat, p_value)

    class AlwaysAccept(RejectionSampler):
        @staticmethod
        def _accept(target_p, draft_q, uniforms):
            return torch.ones_like(target_p, dtype=torch.bool)

    wrong = trials(AlwaysAccept(torch.Generator().manual_seed(5)), p, q, torch.Generator().manual_seed(6))
    stat, _ = chi_square(wrong[:, 0], p)
    assert stat == float("inf")  # tokens outside top-20 come out
    stat, p_value = chi_square(wrong[:, 0][wrong[:, 0] < TOP_P_TOKENS], p)  # even restricted to the top 20
    assert stat > 500 and p_value < 1e-50, (stat, p_value)


def test_full_vocabulary_rows_return_model_token_ids(next_token_logits):
    ids, p, q = distributions(next_token_logits)
    v, b = next_token_logits.numel(), 4
    target = torch.zeros(b, 3, v)
    target[:, :, ids] = p
    draft_probs = torch.zeros(b, 2, v)
    draft_probs[:, :, ids] = q
    drafts = ids[torch.multinomial(q, 2 * b, replacement=True, generator=torch.Generator().manual_seed(0))]
    out = RejectionSampler()(drafts.view(b, 2), [2] * b, draft_probs, target, [False, True, False, True], [None] * b)
    emitted = out[out >= 0]
    assert set(emitted.tolist()) <= set(ids[:TOP_P_TOKENS].tolist())
    assert out[1, 0].item() == out[3, 0].item() == ids[0].item()  # greedy rows start with the argmax
