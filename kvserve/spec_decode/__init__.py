"""Speculative decoding: proposers that draft tokens cheaply, verified by ``kvserve.sample.rejection_sampler``.

Terms (draft, target, accepted, recovered, bonus) are defined in ``kvserve.sample.rejection_sampler``.
"""

from kvserve.spec_decode.draft_model import DraftModelProposer, DraftProposal
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.proposer import Proposer

__all__ = ["DraftModelProposer", "DraftProposal", "NgramProposer", "Proposer"]
