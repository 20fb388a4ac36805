"""``SamplingParams``: how to sample one request, with vLLM's / OpenAI's field names, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

from kvserve.validation import check_bool as _boolean
from kvserve.validation import check_int as _integer
from kvserve.validation import check_number as _number
from kvserve.validation import ParamError, check_text

if TYPE_CHECKING:
    from kvserve.structured.params import StructuredOutputsParams

#: Temperatures below this are treated as greedy (dividing logits by ~0 would overflow).
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 16


@dataclass
class SamplingParams:
    """Per-request sampling and stopping rules.

    Attributes:
        n: samples per prompt, ``[1, 16]`` (parallel sampling: one prefill, the samples share the prompt's KV
            blocks copy-on-write; seeded samples use ``seed + i``).
        temperature: ``>= 0``; 0 (or below 1e-5) means greedy (argmax).
        top_p: nucleus mass in ``(0, 1]``; 1 = disabled. The top token is always kept.
        top_k: keep the k most likely tokens; ``0`` or ``-1`` = disabled (both accepted, as in vLLM).
        min_p: drop tokens whose probability is below ``min_p * p_max``; in ``[0, 1]``, 0 = disabled.
        max_tokens: most tokens to generate, ``>= 1`` (default 16, like vLLM).
        min_tokens: EOS, ``stop_token_ids`` and stop strings do not end the request until this many tokens exist,
            ``[0, max_tokens]``.
        stop: strings that end generation when they appear in the output text (also across token boundaries);
            cut from the text unless ``include_stop_str_in_output``. With ``min_tokens``, only a stop string
            completed by a token after the first ``min_tokens`` counts (the same rule as EOS and
            ``stop_token_ids``). Must be valid Unicode (no lone surrogates).
        stop_token_ids: token ids that end generation (the token is kept in ``token_ids``, not in the text;
            ``RequestOutput.stop_reason`` is the token), with or without ``ignore_eos``.
        ignore_eos: keep generating past the model's end tokens (its EOS and the end-of-turn tokens its files
            declare: ``LLMEngine.eos_token_ids``), as vLLM does (for benchmarks); ``stop_token_ids`` still end it.
        seed: per-request seed; the same seed gives the same tokens whatever else is in the batch.
        repetition_penalty: ``(0, 2]``; >1 discourages tokens already in prompt or output (CTRL, Keskar et al.
            2019: positive logits divided, negative multiplied).
        presence_penalty, frequency_penalty: ``[-2, 2]``, OpenAI's definitions over the output tokens.
        logprobs: number of top logprobs to return per generated token, ``[0, 20]`` (the sampled token's own
            logprob is always included); ``None`` = none.
        skip_special_tokens: drop special tokens from the text.
        prompt_logprobs: number of top logprobs to return per prompt token, ``[0, 20]`` (the prompt token's own
            logprob is always included); ``None`` = none. Computed in the prefill; such a request takes no
            prefix-cache hits for the positions still to be scored (``RequestOutput.prompt_logprobs``).
        logit_bias: ``{token_id: bias}`` added to the token's logit before sampling (OpenAI's ``logit_bias``; bias in
            ``[-100, 100]``: -100 in effect bans the token, 100 all but forces it). Ids are checked against the
            vocabulary when the request is added.
        allowed_token_ids: only these token ids may be sampled (vLLM's); a non-empty list.
        bad_words: strings that may never be generated (vLLM's): each is tokenized (also with a leading space) and
            the last token of a sequence is banned where the output already ends with the rest of it.
        thinking_token_budget: at most this many reasoning tokens (vLLM's name): once the reasoning (opened by the
            prompt or by the model's own ``reasoning_markers[0]``) has this many tokens and is not closed, the
            tokens of ``reasoning_markers[1]`` are forced one by one (``kvserve.sample.thinking``); ``None`` = no
            budget.
        reasoning_markers: ``(start, end)`` texts of the reasoning, for ``thinking_token_budget`` (default
            ``("<think>", "</think>")``; the server sets its reasoning parser's).
        reasoning_open: whether the output starts inside the reasoning, for ``thinking_token_budget``: the server's
            reasoning parser says so (``deepseek_r1``: the output is reasoning until ``</think>``, whether or not
            ``<think>`` was written); ``None`` (default): decided from the prompt (its last start marker after its
            last end marker).
        structured_outputs: a ``StructuredOutputsParams`` (JSON schema, any JSON object, regex, choice or EBNF
            grammar) the output must match; each sampled token is drawn only from the tokens the grammar allows,
            EOS only where the text may end. ``None`` = unconstrained.

    Raises:
        ValueError: any field out of range (the message names the field and the range).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: Union[None, str, list] = None
    stop_token_ids: list = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: Optional[int] = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict] = None
    allowed_token_ids: Optional[list] = None
    bad_words: Optional[list] = None
    thinking_token_budget: Optional[int] = None
    reasoning_markers: tuple = ("<think>", "</think>")
    reasoning_open: Optional[bool] = None
    structured_outputs: Optional["StructuredOutputsParams"] = None

    def __post_init__(self) -> None:
        _integer("n", self.n, 1, MAX_N)
        _number("temperature", self.temperature, 0.0, 1e4)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("top_k", self.top_k, -1)
        _number("min_p", self.min_p, 0.0, 1.0)
        _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens)
        _number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _boolean(name, getattr(self, name))
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None:
            _integer("seed", self.seed, 0, 2**63 - 1)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ParamError.of("stop", f" must be a non-empty string or a list of non-empty strings, "
                                        f"got {self.stop!r}")
        self.stop = list(self.stop)
        for s in self.stop:
            check_text("stop", s)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ParamError.of("stop_token_ids", f" must be a list of token ids, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            _integer("stop_token_ids[]", t, 0)
        self.stop_token_ids = list(self.stop_token_ids)
        self._check_structured_outputs()
        self._check_token_edits()

    def _check_token_edits(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ParamError.of("logit_bias", f" must be a mapping of token id to bias, got {self.logit_bias!r}")
            for t, bias in self.logit_bias.items():
                _integer("logit_bias[] (a token id)", t, 0)
                _number(f"logit_bias[{t}]", bias, -100.0, 100.0)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ParamError.of("allowed_token_ids", f" must be a non-empty list of token ids, got "
                                                         f"{self.allowed_token_ids!r}")
            for t in self.allowed_token_ids:
                _integer("allowed_token_ids[]", t, 0)
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w.strip()
                                                                         for w in self.bad_words):
                raise ParamError.of("bad_words", f" must be a list of non-blank strings, got {self.bad_words!r}")
            for w in self.bad_words:
                check_text("bad_words[]", w)
            self.bad_words = list(self.bad_words)
        if self.thinking_token_budget is not None:
            _integer("thinking_token_budget", self.thinking_token_budget, 0)
            if self.structured_outputs is not None:
                raise ParamError.of("thinking_token_budget", " cannot be combined with structured_outputs (the "
                                    "forced end of the reasoning would break the grammar)")
        rm = self.reasoning_markers
        if not (isinstance(rm, (list, tuple)) and len(rm) == 2 and all(isinstance(m, str) and m for m in rm)):
            raise ParamError.of("reasoning_markers", f" must be two non-empty strings (start, end), got {rm!r}")
        self.reasoning_markers = tuple(rm)

    @property
    def edits_logits(self) -> bool:
        """Whether the request changes its logits before sampling with ``logit_bias``, ``allowed_token_ids``,
        ``bad_words`` or ``thinking_token_budget`` (``kvserve.sample.logits_edits``)."""
        return (bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)
                or self.thinking_token_budget is not None)

    def _check_structured_outputs(self) -> None:
        from kvserve.structured.params import StructuredOutputsParams

        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ParamError.of("structured_outputs", f" must be a StructuredOutputsParams, got {type(so).__name__}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature below ``GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
