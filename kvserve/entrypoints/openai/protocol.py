"""Pydantic models of the OpenAI-compatible API: requests (validated, unknown fields rejected) and responses.

Field names follow OpenAI, plus vLLM's sampling extras (``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``priority``). Fields that OpenAI defines but this engine cannot honour (``best_of``
other than ``n``, ``logit_bias``, ``suffix``, tools, ``response_format`` other than text) are declared so that a
request using them gets a 400 naming them (``serving.check_unsupported``) instead of being silently ignored; any
other unknown field is rejected by ``extra="forbid"``. Ranges are checked by ``SamplingParams`` (one place), not
repeated here.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    """OpenAI's error object. ``type``: ``invalid_request_error`` (400), ``not_found_error`` (404),
    ``server_shutdown`` (503), ``internal_server_error`` (500); ``param``: the offending field, if one."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------------- requests
class StreamOptions(_Strict):
    include_usage: Optional[bool] = False


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions (``None`` = the default)."""

    model: Optional[str] = Field(None, description="the served model name (GET /v1/models); default: it")
    temperature: Optional[float] = Field(None, description="0 = greedy; default 1")
    top_p: Optional[float] = None
    n: Optional[int] = Field(1, description="samples per prompt, 1..16 (parallel sampling)")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = Field(None, description="not supported (400 unless empty)")
    user: Optional[str] = Field(None, description="an end-user id; accepted and not used")
    # vLLM extras
    top_k: Optional[int] = Field(None, description="0 or -1 = disabled")
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    priority: Optional[int] = Field(None, description="lower runs first; needs --scheduling-policy priority")


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or a list of such
    lists (one choice per prompt, ``index`` in order)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, description="tokens to generate at most; default 16")
    echo: Optional[bool] = Field(False, description="prepend the prompt text to the output text")
    logprobs: Optional[int] = Field(None, description="top logprobs per generated token, 0..20")
    suffix: Optional[str] = Field(None, description="not supported (400)")
    best_of: Optional[int] = Field(None, description="only equal to n is supported")


class ContentPart(_Open):
    """A message content part; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: str = Field(..., description="system, developer, user or assistant")
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, description="default: what is left of max_model_len")
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, description="0..20, needs logprobs=true")
    tools: Optional[list[Any]] = Field(None, description="not supported (400 unless empty)")
    tool_choice: Optional[Any] = Field(None, description="not supported (400 unless 'none')")
    parallel_tool_calls: Optional[bool] = Field(None, description="not supported (400 if true)")
    functions: Optional[list[Any]] = Field(None, description="not supported (400 unless empty)")
    function_call: Optional[Any] = Field(None, description="not supported (400 unless 'none')")
    response_format: Optional[dict[str, Any]] = Field(None, description="only {'type': 'text'}")


# ---------------------------------------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs, one entry per generated token (``text_offset`` in characters)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
