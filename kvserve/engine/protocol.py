"""``EngineClient``: everything serving code (every HTTP API, the dashboard routes, the Ray ingress) may ask of the
engine, as vLLM's ``vllm/engine/protocol.py`` ``EngineClient``: generate (an async stream of ``RequestOutput``),
abort, tokenize / detokenize, render a chat (template + kwargs), model facts (``ModelInfo``), health, stats.

``AsyncLLM`` implements it over a local engine, ``entrypoints.ray.ingress.RayEngineClient`` over Ray Serve replicas;
both take the tokenizer side (tokenize, detokenize, chat templates, structured-output checks) and
``generate`` from ``EngineClientBase``, so a request is validated the same way behind either. Serving modules
import nothing else of ``kvserve.engine`` (``tests/test_import_layers.py`` enforces it). Errors: ``ParamError``
(``kvserve.validation``: bad input, naming its field), ``NoChatTemplateError``, ``EngineShutdownError`` (503),
``EngineDeadError`` (500).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Protocol, runtime_checkable

from kvserve.engine.chat_render import NoChatTemplateError, chat_template_for, render_chat
from kvserve.engine.detokenizer import TokenVocab
from kvserve.engine.harmony_render import render_harmony
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.validation import ParamError, check_text

__all__ = ["EngineClient", "EngineClientBase", "EngineDeadError", "EngineShutdownError", "ModelInfo",
           "NoChatTemplateError", "OutputStream", "ParamError", "tokenize_prompt"]


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an unexpected error; no request can be served any more."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down: a new request is refused, or an in-flight one was aborted by the shutdown."""


@dataclass(frozen=True)
class ModelInfo:
    """The served model's facts.

    Attributes:
        model_path: the model file or directory (the default served name is its stem).
        max_model_len: context length in tokens (prompt + output).
        vocab_size: the logits' width; token ids are in ``[0, vocab_size)``.
        eos_token_ids: the tokens that end a request (EOS and the end-of-turn tokens the files declare).
        has_chat_template: chat prompts can be rendered (a chat template, the model's own or ``--chat-template``,
            or the harmony format).
        scheduling_policy: ``fcfs`` or ``priority`` (a request's ``priority`` counts only under the latter).
        chat_format: ``"template"`` or ``"harmony"`` (``LLMEngine.chat_format``: gpt-oss's prompts rendered by
            ``kvserve.engine.harmony_render``).
    """

    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple
    has_chat_template: bool
    scheduling_policy: str
    chat_format: str = "template"


class OutputStream(Protocol):
    """One request's outputs: an async iterator of ``RequestOutput`` (the last ``finished``); ``abort()`` ends it
    early (synchronous, idempotent). Iteration raises ``EngineShutdownError`` / ``EngineDeadError``."""

    request_id: str
    finished: bool

    def __aiter__(self) -> "OutputStream": ...

    async def __anext__(self) -> RequestOutput: ...

    def abort(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """What serving asks of an engine (see the module docstring).

    Attributes:
        model_info: ``ModelInfo``.
        tokenizer: the model's Hugging Face tokenizer (read only: token names for logprobs).
        token_vocab: the vocabulary's names and bytes (``TokenVocab``, built once).
        stat_logger: the Prometheus stats (``/metrics``), or ``None``.
        state_observer: an observer called between engine steps (the dashboard's hub), or ``None``.
    """

    model_info: ModelInfo
    stat_logger: Any
    state_observer: Any

    @property
    def tokenizer(self) -> Any: ...

    @property
    def token_vocab(self) -> TokenVocab: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_running(self) -> bool:
        """Health: the loop is alive and accepts requests (false while draining or after a failure)."""

    @property
    def dead_error(self) -> Optional[BaseException]:
        """The error that stopped the engine loop, or ``None``."""

    @property
    def num_streams(self) -> int:
        """Requests in flight."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def drain(self) -> None: ...

    def abort_all(self) -> None: ...

    def wake(self) -> None: ...

    async def add_request(self, prompt: list, sampling_params: SamplingParams, request_id: Optional[str] = None,
                          arrival_time: Optional[float] = None, priority: int = 0) -> OutputStream:
        """Queue a request (token ids) and return its stream. Raises ``ParamError`` / ``ValueError`` (nothing
        queued), ``EngineShutdownError``, ``EngineDeadError``."""

    def generate(self, prompt: list, sampling_params: SamplingParams, request_id: str,
                 arrival_time: Optional[float] = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """``add_request`` then the stream's outputs; the request is aborted if the consumer stops early."""

    def abort(self, request_id: str) -> None: ...

    async def tokenize(self, prompt, add_special_tokens: bool = True) -> list:
        """Token ids of a text (or validated ids), off the engine's thread."""

    async def detokenize(self, token_ids: list) -> str: ...

    async def render_chat(self, conversation: list, tools: Optional[list] = None, *,
                          add_generation_prompt: bool = True, continue_final_message: bool = False,
                          chat_template_kwargs: Optional[dict] = None) -> str:
        """The chat template's text for a validated conversation."""

    async def check_structured_outputs(self, params) -> None:
        """Compile ``StructuredOutputsParams`` now (cached), so a bad one is refused before queueing."""

    def chat_template_text(self, tools: Optional[list] = None) -> Optional[str]:
        """A model fact: the Jinja text of the chat template a request with (``tools`` given) or without tools
        renders with, or ``None`` when there is none (what picks the tool-call parser)."""


def tokenize_prompt(tokenizer, vocab_size: int, prompt, add_special_tokens: bool = True) -> list:
    """Token ids of a text prompt (the tokenizer's own special-token rule, e.g. a BOS, unless
    ``add_special_tokens`` is false: a chat template's text carries its own), or validated ids as given.

    Raises:
        ParamError: (field ``prompt``) empty prompt, text that is not valid Unicode (a lone surrogate), wrong type,
            or ids outside ``[0, vocab_size)``.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ParamError.of("prompt", " must not be empty")
        check_text("prompt", prompt)
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ParamError.of("prompt", f" token ids must be in [0, {vocab_size}), got {bad[:5]}")
    else:
        raise ParamError.of("prompt", f" must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ParamError.of("prompt", " must not be empty (it has 0 tokens)")
    return ids


class EngineClientBase:
    """What both ``EngineClient``s share: the tokenizer side (tokenize, detokenize, chat templates, structured-output
    checks), the same behind ``AsyncLLM`` and the Ray ingress, and ``generate`` over the subclass's
    ``add_request``. Work that takes time (tokenizing, rendering, compiling a grammar) runs in a worker thread
    (``asyncio.to_thread``), never on the event loop or the engine's thread.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        model_info: the model's facts.
        chat_template: ``--chat-template`` text, or ``None`` for the model's own.
        grammar_backend: a ``GrammarBackend`` (its compile cache is shared with the engine's), or ``None``: a
            structured-output request is then refused by name.
    """

    def __init__(self, tokenizer, model_info: ModelInfo, chat_template: Optional[str], grammar_backend=None):
        self._tokenizer = tokenizer
        self.model_info = model_info
        self.chat_template = chat_template
        self.grammar_backend = grammar_backend
        self._vocab: Optional[TokenVocab] = None

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def token_vocab(self) -> TokenVocab:
        """Built on first use (it reads the whole vocabulary)."""
        if self._vocab is None:
            self._vocab = TokenVocab(self._tokenizer)
        return self._vocab

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str,
                       arrival_time: Optional[float] = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """``add_request``, then yield the request's outputs (the last ``finished``); the request is aborted if the
        consumer stops early. Raises as ``add_request`` and the stream do."""
        stream = await self.add_request(prompt, sampling_params, request_id, arrival_time, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def tokenize(self, prompt, add_special_tokens: bool = True) -> list:
        """``tokenize_prompt`` in a worker thread. Raises ``ParamError`` (field ``prompt``)."""
        return await asyncio.to_thread(tokenize_prompt, self._tokenizer, self.model_info.vocab_size, prompt,
                                       add_special_tokens)

    async def detokenize(self, token_ids: list) -> str:
        """The text of ``token_ids``. Raises ``ParamError`` (field ``tokens``) for ids outside the vocabulary."""
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.model_info.vocab_size]
        if bad:
            raise ParamError.of("tokens", f" must be token ids in [0, {self.model_info.vocab_size}), got {bad[:5]}")
        return await asyncio.to_thread(self._tokenizer.decode, token_ids)

    async def render_chat(self, conversation: list, tools: Optional[list] = None, *,
                          add_generation_prompt: bool = True, continue_final_message: bool = False,
                          chat_template_kwargs: Optional[dict] = None) -> str:
        """The chat template's text (``chat_render.render_chat``) for ``conversation`` and OpenAI ``tools``;
        ``chat_template_kwargs`` go to the template as variables (``enable_thinking``, ...). A harmony model's
        (``ModelInfo.chat_format``) is ``harmony_render.render_harmony``'s text, those variables its arguments.

        Raises:
            NoChatTemplateError: no template at all (the message says how to pass one).
            ParamError: (field ``messages``) the template rejected the conversation (its ``raise_exception``);
                harmony's own refusals (``render_harmony``).
        """
        if self.model_info.chat_format == "harmony":
            kwargs = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message)
            return await asyncio.to_thread(render_harmony, conversation, tools, **kwargs)
        template = chat_template_for(self._tokenizer, self.chat_template, tools)
        kwargs = dict(chat_template_kwargs or {})
        kwargs.update(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)

        def render() -> str:
            return render_chat(self._tokenizer, conversation, tools, template, **kwargs)

        try:
            return await asyncio.to_thread(render)
        except Exception as e:  # a template's raise_exception (jinja2 TemplateError) and the like: bad input
            raise ParamError.of("messages", f": the chat template rejected the conversation: {e}") from None

    def chat_template_text(self, tools: Optional[list] = None) -> Optional[str]:
        """The template ``render_chat`` uses for a request with (``tools`` given) or without tools; ``None``
        without one."""
        try:
            return chat_template_for(self._tokenizer, self.chat_template, tools)
        except NoChatTemplateError:
            return None

    async def check_structured_outputs(self, params) -> None:
        """Compile ``params`` (``StructuredOutputsParams``) in a worker thread.

        Raises:
            ParamError: (field ``structured_outputs...``) it cannot be compiled, or no backend here.
        """
        if self.grammar_backend is None:
            raise ParamError.of("structured_outputs", " are not available behind this client")
        await asyncio.to_thread(self.grammar_backend.compile, params)
