"""The grammar backend: xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine
for Large Language Models"), chosen over llguidance by the per-token mask cost measured on this model's vocabulary
(docs/structured_outputs.md).

One ``GrammarBackend`` per engine: the tokenizer's vocabulary is read once (on the first structured request),
compiled grammars are cached by ``StructuredOutputsParams.key()``, and every sample gets its own ``GrammarState``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from kvserve.extras import MissingExtraError, require
from kvserve.structured.params import StructuredOutputsParams
from kvserve.validation import ParamError

logger = logging.getLogger(__name__)

#: compiled grammars kept per engine (least recently used dropped first).
CACHE_SIZE = 256


class GrammarBackend:
    """Compiles grammars for one tokenizer and makes per-sample matchers.

    Args:
        tokenizer: a ``transformers`` tokenizer (its vocabulary decides which tokens each grammar state allows).
        vocab_size: the model's logits width ``V`` (``>= len(tokenizer)``; extra ids are never allowed).
        eos_token_ids: the engine's EOS ids; a grammar allows them only where its text may end.
        max_threads: threads xgrammar may use to compile one grammar.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], max_threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_threads = max_threads
        self._compiler = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def _get_compiler(self):
        if self._compiler is None:  # reading the vocabulary takes ~1 s: only engines that get a structured request
            xgr = require("xgrammar", "structured", "structured outputs")

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (cached by ``params.key()``; thread-safe).

        Raises:
            ValueError: the backend cannot compile it (a regex or EBNF syntax error, an unsatisfiable schema),
                the message names the field (``structured_outputs.regex`` ...) and quotes the backend's reason.
        """
        key = params.key()
        with self._lock:
            try:
                compiler = self._get_compiler()
            except MissingExtraError as e:
                raise ParamError.of("structured_outputs", f" are not available here: {e}") from None
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = _compile(compiler, params)
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
            raise ParamError.of(f"structured_outputs.{params.kind}", f" cannot be compiled: {reason}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, compiled) -> "GrammarState":
        """A fresh matcher over ``compiled`` (one per sample)."""
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size)


def _compile(compiler, params: StructuredOutputsParams):
    kind = params.kind
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(params.json), strict_mode=True)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "structural_tag":
        return _compile_structural_tag(compiler, params.structural_tag)
    if kind == "choice":  # EBNF string literals take JSON's escapes
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return compiler.compile_grammar(f"root ::= {alts}")
    return compiler.compile_grammar(params.grammar)


def _compile_structural_tag(compiler, tag: dict):
    """vLLM's ``{"structures": [{"begin", "schema", "end"}], "triggers"}`` (xgrammar's tag items) or xgrammar's own
    structural-tag object."""
    if "structures" not in tag:
        return compiler.compile_structural_tag(json.dumps(tag))
    import xgrammar as xgr

    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                 for s in tag["structures"]]
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"each of structures needs begin, schema and end, and triggers a list: {e!r}") from None
    return compiler.compile_structural_tag(items, triggers)


class GrammarState:
    """One sample's position in its grammar: an xgrammar ``GrammarMatcher`` plus how many of the sample's output
    tokens it has consumed.

    Only the scheduler touches it: the matcher follows the sample's output token list (``sync``), so it advances
    exactly once per token the scheduler appends — a preemption (recompute) appends nothing and so advances nothing
    — and it is rolled back if that list is cut; when a step is planned, ``plan_bitmask`` writes the masks of the
    rows the step samples into the plan, and the samplers only apply them.

    Attributes:
        matcher: the ``xgrammar.GrammarMatcher``.
        vocab_size: the logits width ``V`` its masks cover.
        num_consumed: output tokens the matcher has accepted.
        failed: a token the grammar did not allow was appended (never expected; the request is then stopped).
    """

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0
        self.failed = False

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept ``output_token_ids[num_consumed:]`` (roll back first if the list got shorter)."""
        n = len(output_token_ids)
        if n < self.num_consumed:
            self.matcher.rollback(self.num_consumed - n)
            self.num_consumed = n
        while self.num_consumed < n and not self.failed:
            if self.matcher.is_terminated() or not self.matcher.accept_token(output_token_ids[self.num_consumed]):
                logger.warning("grammar refused output token %d at position %d; stopping the request",
                               output_token_ids[self.num_consumed], self.num_consumed)
                self.failed = True
                return
            self.num_consumed += 1

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (it accepted a stop token), or it refused a token."""
        return self.failed or self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (``[ceil(V/32)]`` int32, bit ``t % 32`` of word
        ``t // 32`` set iff token ``t`` is allowed). A finished state allows everything (its request is stopping;
        the row is not used)."""
        if self.finished:
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_drafts(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        """Masks for speculative verification: ``bitmask[j]`` (``j = 0 .. len(drafts)``) is the state after
        drafts ``0 .. j-1``. The matcher is advanced through the drafts and rolled back, so it ends where it
        started. After a draft the grammar refuses, the remaining rows allow everything: that draft is rejected
        (its target probability is 0), so later rows are never used."""
        advanced = 0
        for j in range(len(drafts) + 1):
            if advanced < j:  # the previous draft was refused or ended the grammar
                bitmask[j] = -1
                continue
            self.fill(bitmask, j)
            if j < len(drafts) and not self.finished and self.matcher.accept_token(drafts[j]):
                advanced += 1
        if advanced:
            self.matcher.rollback(advanced)


def plan_bitmask(states: list[GrammarState], output_token_ids: list[list[int]],
                 drafts: list[int]) -> torch.Tensor:
    """The token masks of the rows a step samples for one request, ``[R, ceil(V/32)]`` int32 (bit ``t % 32`` of
    word ``t // 32`` set iff token ``t`` is allowed).

    Args:
        states: the grammar of each sample drawn from the request's last row (one, or ``n`` for a fork), each
            synced first with its sample's ``output_token_ids``.
        drafts: with one state, drafts verified this step: rows ``0 .. k`` are then the masks after drafts
            ``0 .. j-1`` (``GrammarState.fill_drafts``; the matcher ends where it started).

    Returns:
        ``R = len(states)`` rows, or ``k + 1`` when verifying drafts.
    """
    for st, out in zip(states, output_token_ids):
        st.sync(out)
    width = (states[0].vocab_size + 31) // 32
    if drafts:
        bitmask = torch.empty((len(drafts) + 1, width), dtype=torch.int32)
        states[0].fill_drafts(bitmask, drafts)
        return bitmask
    bitmask = torch.empty((len(states), width), dtype=torch.int32)
    for i, st in enumerate(states):
        st.fill(bitmask, i)
    return bitmask


def stack_bitmasks(rows: list[Optional[torch.Tensor]]) -> Optional[tuple[torch.Tensor, list[int]]]:
    """One ``[B, ceil(V/32)]`` int32 bitmask of ``B`` logits rows from each row's own mask (``[W]``, or ``None``
    for a row without a grammar, left all-allowed), and the indices of the rows that have one; ``None`` when no
    row has one."""
    masked = [i for i, r in enumerate(rows) if r is not None]
    if not masked:
        return None
    bitmask = torch.full((len(rows), rows[masked[0]].shape[0]), -1, dtype=torch.int32)
    for i in masked:
        bitmask[i] = rows[i]
    return bitmask, masked


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Optional[list[int]] = None) -> None:
    """Set ``logits[b, t] = -inf`` where bit ``t`` of ``bitmask[b]`` is 0 (in place), for ``b`` in ``rows``
    (default: every row).

    Args:
        logits: ``[B, V]`` float (CPU or accelerator).
        bitmask: ``[B, ceil(V/32)]`` int32 on the CPU.
        rows: the rows to mask, or ``None`` for all.
    """
    import xgrammar as xgr

    if logits.device.type == "cpu":  # xgrammar's C++ kernel (a few times faster than unpacking bits in torch)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
        return
    idx = list(range(bitmask.shape[0])) if rows is None else rows
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[idx, :, None] >> bits) & 1).bool().reshape(len(idx), -1)[:, : logits.shape[1]]
    sel = torch.tensor(idx, device=logits.device)
    logits[sel] = logits[sel].masked_fill(~allowed.to(logits.device), float("-inf"))
