"""``POST /v1/completions`` (vLLM's ``serving_completion``): one prompt or several, ``n`` samples each, ``echo``
(with ``max_tokens: 0``: the prompt alone, scored), the legacy ``logprobs`` shape, streaming or not. A choice's
text is rendered from the event model (``events.ChoiceEvents``: text deltas and the finish, no parser), the
non-streamed text as the fold of its events.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from kvserve.entrypoints.events import ChoiceEvents, Finish, TextDelta, fold
from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai.serving_engine import (OpenAIError, OpenAIServing, PreparedPrompt, include_usage,
                                                       new_id, now_s, sse, usage_of)


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint (arguments: ``OpenAIServing``)."""

    async def create_completion(self, req: p.CompletionRequest, receive):
        """``POST /v1/completions``. Returns a ``CompletionResponse``, an async iterator of SSE strings
        (``stream``), or ``None`` if the client disconnected (its requests are aborted). Choice ``index`` is
        ``prompt_index * n + sample_index``.

        Raises:
            OpenAIError: bad input (400), shutdown (503), dead engine (500).
        """
        arrival = now_s()
        self.check_model(req.model)
        self.check_bounds(req)
        self.check_unsupported(req)
        structured = await self.structured_outputs(req)
        prompts = await self.completion_prompts(req.prompt, req.truncate_prompt_tokens)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        # echo with max_tokens 0 returns the prompt alone (vLLM's way to score a prompt): one token is generated
        # and dropped, so the prompt is prefilled (and scored, with logprobs) like any other
        echo_only = bool(req.echo) and max_tokens == 0
        if echo_only:
            max_tokens = 1
        elif max_tokens == 0:
            raise OpenAIError("max_tokens must be >= 1 (0 is only allowed with echo=true: the prompt alone)",
                              param="max_tokens")
        want_lp = req.logprobs is not None
        plp = self.engine_prompt_logprobs(req, req.logprobs if want_lp and req.echo else None)
        params = [self.sampling_params(req, self.check_length(len(pp.token_ids), max_tokens, "prompt", "max_tokens"),
                                       req.logprobs, plp, structured) for pp in prompts]
        n = params[0].n
        rid, created = new_id("cmpl"), int(time.time())  # one timestamp for every chunk
        echo = [pp.text if req.echo else "" for pp in prompts]
        skip_special = params[0].skip_special_tokens
        streams = await self.start(req, prompts, params, rid, arrival)

        def shown(c):
            """What the client sees of a completion: nothing generated when ``echo_only``."""
            if not echo_only:
                return c
            reason = None if c.finish_reason is None else "length"
            return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if want_lp else None, delta_text="",
                                       delta_token_ids=[], finish_reason=reason)

        def logprobs_of(i: int, token_ids: list, entries: list, start: int, prompt_lps) -> tuple:
            """(prompt part when ``prompt_lps``) + the tokens' part; ``(CompletionLogprobs or None, end offset)``."""
            parts = ([self.echo_logprobs(prompts[i], prompt_lps, req.logprobs, skip_special)]
                     if prompt_lps is not None else [])
            offsets, end = self.vocab.text_offsets(token_ids, start, skip_special)
            if token_ids:
                parts.append(self.completion_logprobs(token_ids, entries, offsets))
            if not parts:
                return None, end
            lp = parts[0]
            for more in parts[1:]:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(lp, name).extend(getattr(more, name))
            return lp, end

        if not req.stream:
            finals = await self._collect(streams, receive)
            if finals is None:
                return None
            finals = [dataclasses.replace(o, outputs=[shown(c) for c in o.outputs]) for o in finals]
            choices = []
            for i, out in enumerate(finals):
                extra = {}
                if req.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = self.vllm_prompt_logprobs(prompts[i].token_ids, out,
                                                                         req.prompt_logprobs, plp)
                for c in out.outputs:
                    lp = None
                    if want_lp:
                        lp, _ = logprobs_of(i, c.token_ids, c.logprobs, len(echo[i]),
                                            out.prompt_logprobs if req.echo else None)
                    answer = fold(ChoiceEvents().feed(c.text, c.finish_reason, c.stop_reason))  # the events, folded
                    choices.append(p.CompletionChoice(index=i * n + c.index, text=echo[i] + (answer.text or ""),
                                                      logprobs=lp, finish_reason=answer.finish_reason, **extra))
            return p.CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices,
                                        usage=usage_of(prompts, finals))

        chars: dict = {}  # choice index -> text offset after its tokens so far (for text_offset)
        events: dict = {}  # choice index -> its ChoiceEvents
        prompt_lps: dict = {}  # prompt index -> its RequestOutput.prompt_logprobs (echo + logprobs)
        usage_null = {"usage": None} if include_usage(req) else {}

        def record(i: int, out) -> None:
            if out.prompt_logprobs is not None and req.echo:
                prompt_lps[i] = out.prompt_logprobs

        def chunk(i: int, c, first: bool) -> str:
            c = shown(c)
            k = i * n + c.index
            head = echo[i] if first else ""
            lp = None
            if want_lp and (c.delta_token_ids or first):
                entries = c.logprobs[len(c.logprobs) - len(c.delta_token_ids):]
                lp, chars[k] = logprobs_of(i, c.delta_token_ids, entries, chars.get(k, len(echo[i])),
                                           prompt_lps.get(i) if first else None)
            evs = events.setdefault(k, ChoiceEvents()).feed(c.delta_text, c.finish_reason, c.stop_reason)
            text = "".join(e.text for e in evs if isinstance(e, TextDelta))
            finish = next((e.finish_reason for e in evs if isinstance(e, Finish)), None)
            choice = p.CompletionChoice(index=k, text=head + text, logprobs=lp, finish_reason=finish)
            return sse(p.CompletionResponse(id=rid, created=created, model=self.model_name, choices=[choice],
                                            **usage_null))

        def usage_chunk(finals) -> str:
            finals = [dataclasses.replace(o, outputs=[shown(c) for c in o.outputs]) for o in finals]
            return sse(p.CompletionResponse(id=rid, created=created, model=self.model_name, choices=[],
                                            usage=usage_of(prompts, finals)))

        return self._stream(streams, [], chunk, usage_chunk if include_usage(req) else None,
                            always_first=bool(req.echo), with_logprobs=want_lp, on_output=record)

    def completion_logprobs(self, token_ids: list, entries: list, offsets: list) -> p.CompletionLogprobs:
        """Legacy logprobs for ``token_ids`` with engine entries ``{token_id: logprob}`` and character
        ``offsets`` (``TokenVocab.text_offsets``); tokens and keys are ``TokenVocab.token_name``s (distinct ids,
        distinct keys)."""
        lp = p.CompletionLogprobs()
        for t, entry, offset in zip(token_ids, entries, offsets):
            lp.tokens.append(self.vocab.token_name(t))
            lp.token_logprobs.append(None if entry is None else entry[t])  # None: a prompt's first token
            lp.top_logprobs.append(None if entry is None else {
                self.vocab.token_name(k): v for k, v in sorted(entry.items(), key=lambda kv: -kv[1])})
            lp.text_offset.append(offset)
        return lp

    def echo_logprobs(self, pp: PreparedPrompt, prompt_logprobs: list, k: int,
                      skip_special: bool) -> p.CompletionLogprobs:
        """The legacy logprobs of an echoed prompt with top ``k``: its tokens from offset 0, the first one ``null``
        (``RequestOutput.prompt_logprobs``, vLLM's shape, possibly computed with a larger top k)."""
        offsets, _ = self.vocab.text_offsets(pp.token_ids, 0, skip_special)
        entries = [None if e is None else top_of(e, t, k) for t, e in zip(pp.token_ids, prompt_logprobs)]
        return self.completion_logprobs(pp.token_ids, entries, offsets)


def top_of(entry: dict, target: int, k: int) -> dict:
    """An engine logprob entry ``{token_id: logprob}`` (its top ids in rank order, then ``target`` if not among
    them) cut to its top ``k`` plus ``target``."""
    out = dict(itertools.islice(entry.items(), k))
    out[target] = entry[target]
    return out
