"""Pydantic models of the OpenAI-compatible API: requests (validated, unknown fields rejected) and responses.

Field names follow OpenAI, plus vLLM's sampling extras (``top_k``, ``min_p``, ``min_tokens``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``priority``, ``structured_outputs``, ``bad_words``, ``allowed_token_ids``,
``truncate_prompt_tokens``, ``thinking_token_budget``; on chat ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``, ``include_reasoning``) and vLLM's tokenizer routes. Fields that OpenAI defines but this
engine cannot honour (``best_of`` other than ``n``, ``suffix``, the deprecated ``functions``) are declared
so that a request using them gets a 400 naming them (``serving_engine.OpenAIServing.check_unsupported``) instead of
being silently ignored; any other unknown field is rejected by ``extra="forbid"``.

Requests are validated strictly, as OpenAI's API does: no type coercion (``"max_tokens": "4"`` or ``true``,
``"stream": "yes"``, ``"prompt": [true]`` are 400s); an integer is accepted where a number is expected. Ranges are
checked by ``SamplingParams`` (one place), not repeated here.

Responses always carry OpenAI's required fields, ``null`` included (``finish_reason: null`` on every chunk but
a choice's last, ``logprobs: null``); a field OpenAI marks optional is left out while unset (``_Response``).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Response(BaseModel):
    """A response model. Fields named in ``_omit_if_unset`` (optional in OpenAI's schema) are left out of the
    JSON when ``None`` and not set explicitly; every other field is always written, ``null`` included."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        for name in self._omit_if_unset:
            if data.get(name) is None and name not in self.model_fields_set:
                data.pop(name, None)
        return data


# ---------------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    """OpenAI's error object. ``type``: ``invalid_request_error`` (400; 401 with ``code: invalid_api_key``),
    ``not_found_error`` (404), ``server_shutdown`` (503), ``internal_server_error`` (500); ``param``: the
    offending field, if one."""

    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------------- requests
class StreamOptions(_Strict):
    include_usage: Optional[bool] = False


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: ``schema`` is the JSON schema the output follows."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(_Strict):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams``): exactly one constraint
    (``json`` is the field's name on the wire: ``json_schema_`` here, as pydantic's ``json`` is taken)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    json_schema_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None


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
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id (a decimal string) -> bias in "
                                                                     "[-100, 100] added to its logit")
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
    prompt_logprobs: Optional[int] = Field(None, description="top logprobs per prompt token, 0..20 (vLLM's "
                                                             "prompt_logprobs); not with stream")
    # structured outputs: OpenAI's response_format and vLLM's guided_* extras (at most one of them)
    response_format: Optional[ResponseFormat] = Field(None, description="text, json_object or json_schema")
    guided_json: Optional[Union[str, dict[str, Any]]] = Field(None, description="a JSON schema the output follows")
    guided_regex: Optional[str] = Field(None, description="a regular expression the output matches")
    guided_choice: Optional[list[str]] = Field(None, description="the output is one of these strings")
    guided_grammar: Optional[str] = Field(None, description="an EBNF grammar (start rule root)")
    structured_outputs: Optional[StructuredOutputsField] = Field(None, description="vLLM's field: exactly one of "
                                                                 "json, regex, choice, grammar, structural_tag")
    # vLLM's token controls
    bad_words: Optional[list[str]] = Field(None, description="words never generated")
    allowed_token_ids: Optional[list[int]] = Field(None, description="only these token ids may be generated")
    truncate_prompt_tokens: Optional[int] = Field(None, description="keep the last k prompt tokens (-1: "
                                                                    "max_model_len)")
    thinking_token_budget: Optional[int] = Field(None, description="reasoning tokens allowed before the end of "
                                                                   "the reasoning is forced")


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or a list of such
    lists (one choice per prompt, ``index`` in order)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, description="tokens to generate at most; default 16; 0 only with echo "
                                                      "(the prompt alone, e.g. scored with logprobs)")
    echo: Optional[bool] = Field(False, description="prepend the prompt text to the output text (with logprobs: "
                                                    "the prompt tokens' logprobs too)")
    logprobs: Optional[int] = Field(None, description="top logprobs per generated (and, with echo, prompt) token, "
                                                      "0..20")
    suffix: Optional[str] = Field(None, description="not supported (400)")
    best_of: Optional[int] = Field(None, description="only equal to n is supported")


class ContentPart(_Open):
    """A message content part; only ``{"type": "text", "text": str}`` is supported (checked in
    ``chat_utils.conversation_from_messages``, one rule with the offline ``LLM.chat``)."""

    type: str
    text: Optional[str] = None


class FunctionDefinition(_Strict):
    """A function tool; ``name`` as OpenAI allows it: 1-64 of ``a-z A-Z 0-9 _ -``."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments object")
    strict: Optional[bool] = None


class ChatTool(_Strict):
    """A tool: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCallIn(_Strict):
    name: str
    arguments: str = Field(..., description="the arguments as a JSON text")


class ToolCallIn(_Strict):
    """A tool call of an earlier assistant message."""

    id: str
    type: Literal["function"]
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: str = Field(..., description="system, developer, user, assistant or tool")
    content: Optional[Union[str, list[ContentPart]]] = Field(
        None, description="a string or a list of text parts; null only for an assistant message")
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = Field(None, description="an assistant message's tool calls")
    tool_call_id: Optional[str] = Field(None, description="a tool message: the call it answers")
    reasoning_content: Optional[str] = Field(None, description="an assistant message's reasoning, sent back (a "
                                                               "template that reads it, harmony's analysis)")
    reasoning: Optional[str] = Field(None, description="the newer name of reasoning_content")


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, description="default: what is left of max_model_len")
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens")
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, description="0..20, needs logprobs=true")
    tools: Optional[list[ChatTool]] = Field(None, description="functions the model may call")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description="none, auto (the default with tools), required, or a named function")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call (required)")
    functions: Optional[list[Any]] = Field(None, description="deprecated; not supported (400), use tools")
    function_call: Optional[Any] = Field(None, description="deprecated; not supported (400), use tool_choice")
    # vLLM's chat extras
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="passed to the chat template, e.g. "
                                                                              '{"enable_thinking": false}')
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high"]] = Field(
        None, description="passed to the chat template as reasoning_effort")
    add_generation_prompt: Optional[bool] = Field(True, description="end the prompt with the assistant header")
    continue_final_message: Optional[bool] = Field(False, description="continue the last (assistant) message")
    include_reasoning: Optional[bool] = Field(True, description="with a reasoning parser: return the reasoning")


# ---------------------------------------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    """Legacy completions logprobs, one entry per token: ``tokens`` (the token's name: ``TokenVocab.token_name``),
    its logprob, the top alternatives keyed by name, and ``text_offset``, the character offset of the token in the
    choice's text. With ``echo`` the prompt's tokens come first, the very first with ``null`` logprob and top
    logprobs (nothing precedes it), then the generated ones."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's ``Logprob`` of a prompt token or an alternative: ``rank`` in the whole distribution (1 = most
    likely; for the prompt token the number of tokens with a logprob >= its own, also outside the top
    ``prompt_logprobs``), ``decoded_token`` the token's name (``TokenVocab.token_name``)."""

    logprob: float
    rank: int
    decoded_token: Optional[str]


#: vLLM's ``prompt_logprobs``: ``null`` for the first prompt token, then ``{token_id: PromptLogprob}`` per token
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionChoice(_Response):
    """A completion choice (also in stream chunks): ``logprobs`` and ``finish_reason`` are always present,
    ``null`` when not requested / until the choice's last chunk; ``prompt_logprobs`` (vLLM's field) only when
    requested."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(_Response):
    """A completion, or one stream chunk of it. ``usage`` is left out unless set: stream chunks carry
    ``usage: null`` only with ``stream_options.include_usage`` (OpenAI's rule), and the final usage chunk."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("usage",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(_Response):
    """``token``: the token's name (``TokenVocab.token_name``); ``bytes``: its raw bytes, so that the bytes of a
    choice's tokens concatenate to its content's UTF-8."""

    token: str
    logprob: float
    bytes: Optional[list[int]]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = Field(default_factory=list)
    refusal: Optional[list[ChatTokenLogprob]] = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    """A call the model made: ``id`` ``call_<24 hex>``, ``function.arguments`` a JSON text."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    """``reasoning_content`` and ``reasoning`` (vLLM's older and newer names of the same text): the thinking a
    reasoning parser separated, only when there is some."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("tool_calls", "reasoning_content", "reasoning")
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Response):
    """A chat completion; ``prompt_logprobs`` (vLLM's field, at the top level) only when requested."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None


class DeltaFunctionCall(_Response):
    _omit_if_unset: ClassVar[tuple[str, ...]] = ("name", "arguments")
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    """A streamed piece of a tool call: its first delta has ``id``, ``type`` and ``function.name``; later ones
    append to ``function.arguments``."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("id", "type", "function")
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Response):
    """What a chunk adds to the message: ``role`` in a choice's first chunk, then ``content``; both optional in
    OpenAI's schema, so left out unless set (a choice's last chunk may have an empty delta ``{}``)."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("role", "content", "tool_calls", "reasoning_content", "reasoning")
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None


class ChatStreamChoice(_Response):
    """One choice of a chat chunk: ``logprobs`` and ``finish_reason`` are always present (``null`` until set)."""

    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_Response):
    """A chat stream chunk; ``usage`` as in ``CompletionResponse`` chunks."""

    _omit_if_unset: ClassVar[tuple[str, ...]] = ("usage",)
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------------------------------- tokenizer
class TokenizeCompletionRequest(_Strict):
    """``POST /tokenize`` with a ``prompt`` (vLLM's shape)."""

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (e.g. BOS), if any")
    return_token_strs: Optional[bool] = Field(False, description="also return the vocabulary's token strings")


class TokenizeChatRequest(_Strict):
    """``POST /tokenize`` with ``messages``: the chat template's tokens, as ``/v1/chat/completions`` would run."""

    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = Field(True, description="end with the assistant turn's header")
    continue_final_message: bool = Field(False, description="leave the last message open (not with "
                                                            "add_generation_prompt)")
    add_special_tokens: bool = Field(False, description="add special tokens on top of the template's")
    return_token_strs: Optional[bool] = False
    tools: Optional[list[ChatTool]] = Field(None, description="tools, rendered as a chat request with "
                                                              "tool_choice auto renders them (vLLM's field)")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="passed to the chat template, as in "
                                                                              "chat completions")


class TokenizeResponse(_Response):
    _omit_if_unset: ClassVar[tuple[str, ...]] = ()
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids -> text (special tokens kept)."""

    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str
