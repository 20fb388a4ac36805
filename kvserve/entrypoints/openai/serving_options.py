"""The server's parser, CORS and metric-name options (``kvserve serve`` flags with vLLM's names), in one object
handed to ``build_app``: ``ServingOptions``.

- ``--reasoning-parser NAME``: split thinking from the answer (``reasoning_parsers``: ``deepseek_r1``, ``qwen3``,
  ``smollm3``, ``granite``); ``--thinking-token-budget N``: the budget of requests that set none.
- ``--tool-call-parser NAME`` and ``--enable-auto-tool-choice`` (vLLM's semantics: ``tool_choice`` "auto", the
  default when a request has tools, needs the second; without it such a request is a 400 naming the flag). Without
  ``--tool-call-parser`` the parser is picked from the model's chat template when that is unambiguous
  (``tool_parsers.parser_for_template``) and the choice is logged.
- ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` (JSON lists, as vLLM takes them) and
  ``--allow-credentials``: CORS (FastAPI's ``CORSMiddleware``), off unless ``--allowed-origins`` is given. It sits
  outside the API-key check: a preflight ``OPTIONS`` is answered without the key, every real request still needs it.
- ``--vllm-metric-names``: ``/metrics`` also under vLLM's ``vllm:`` names (``metrics.VLLMNamesCollector``).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Optional

from kvserve.entrypoints.openai.reasoning_parsers import reasoning_parser_names
from kvserve.entrypoints.openai.tool_parsers import parser_for_template, tool_parser_names
from kvserve.validation import check_int

logger = logging.getLogger(__name__)


@dataclass
class ServingOptions:
    """What ``build_app`` serves beyond the engine (every field but ``forced_tool_format`` a flag of the same name:
    ``add_args``).

    Raises:
        ValueError: an unknown parser name, a negative budget, a CORS list that is not a list of strings.
    """

    reasoning_parser: Optional[str] = field(default=None, metadata={
        "help": "separate the model's reasoning into reasoning_content: " + ", ".join(reasoning_parser_names())})
    thinking_token_budget: Optional[int] = field(default=None, metadata={
        "help": "reasoning tokens allowed to requests that set no thinking_token_budget (default: no budget)"})
    tool_call_parser: Optional[str] = field(default=None, metadata={
        "help": "the model's tool-call format: " + ", ".join(tool_parser_names()) + " (default: from the chat "
                "template when unambiguous)"})
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "let the model call tools on its own (tool_choice auto); otherwise such requests are a 400"})
    allowed_origins: list = field(default_factory=list, metadata={
        "help": 'CORS: allowed origins as a JSON list, e.g. \'["https://app.example"]\' or \'["*"]\' (default: CORS '
                "off)"})
    allowed_methods: list = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: allowed methods as a JSON list (default [\"*\"])"})
    allowed_headers: list = field(default_factory=lambda: ["*"], metadata={
        "help": "CORS: allowed headers as a JSON list (default [\"*\"])"})
    allow_credentials: bool = field(default=False, metadata={"help": "CORS: allow credentials"})
    vllm_metric_names: bool = field(default=False, metadata={
        "help": "also publish the engine metrics under vLLM's vllm: names (for vLLM's Grafana dashboard)"})
    #: not a flag (``build_app`` sets it): the parser whose own format "required" / named ``tool_choice`` grammars
    #: write, the ``--tool-call-parser`` given explicitly; ``None``: their JSON path (docs/structured_outputs.md)
    forced_tool_format: Optional[str] = field(default=None, metadata={"flag": False})

    def __post_init__(self) -> None:
        for name, known in (("reasoning_parser", reasoning_parser_names()), ("tool_call_parser", tool_parser_names())):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ValueError(f"{name} must be one of {known}, got {value!r}")
        if self.thinking_token_budget is not None:
            check_int("thinking_token_budget", self.thinking_token_budget, 0)
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a JSON list of strings, got {value!r}")

    def resolve_reasoning_parser(self, chat_format: str = "template") -> Optional[str]:
        """The reasoning parser to use: ``reasoning_parser``, else ``openai_gptoss`` for a harmony model (its
        ``analysis`` channel is always there; logged), else ``None``."""
        if self.reasoning_parser is None and chat_format == "harmony":
            logger.info("reasoning parser: openai_gptoss (the harmony format renders the prompts)")
            return "openai_gptoss"
        return self.reasoning_parser

    def resolve_tool_parser(self, chat_template: Optional[str], chat_format: str = "template") -> Optional[str]:
        """The tool parser to use: ``tool_call_parser``, else ``openai`` for a harmony model (``chat_format``), else
        the one ``chat_template`` implies (logged), else ``None`` (then "auto" is refused, naming
        ``--tool-call-parser``)."""
        if self.tool_call_parser is not None:
            return self.tool_call_parser
        name, why = (("openai", "the harmony format renders the prompts") if chat_format == "harmony" else
                     parser_for_template(chat_template))
        if self.enable_auto_tool_choice:
            logger.info("tool-call parser: %s (%s)", name or "none", why + ("" if name else "; pass "
                                                                           "--tool-call-parser"))
        return name

    def cors(self) -> Optional[dict]:
        """``CORSMiddleware`` keyword arguments, or ``None`` when CORS is off."""
        if not self.allowed_origins:
            return None
        return dict(allow_origins=self.allowed_origins, allow_methods=self.allowed_methods,
                    allow_headers=self.allowed_headers, allow_credentials=self.allow_credentials)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServingOptions":
        """The options given on the command line (``add_args``)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if f.metadata.get("flag", True)})


def _json_list(text: str) -> list:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} (e.g. '[\"*\"]')") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r} (e.g. '[\"*\"]')")
    return value


def add_args(parser: argparse.ArgumentParser) -> None:
    """One ``kvserve serve`` flag per ``ServingOptions`` field (``--reasoning-parser``, ...)."""
    g = parser.add_argument_group("parsers, CORS and metric names (vLLM's flags)")
    defaults = ServingOptions()
    for f in fields(ServingOptions):
        if not f.metadata.get("flag", True):
            continue
        flag, default, help_text = "--" + f.name.replace("_", "-"), getattr(defaults, f.name), f.metadata["help"]
        if isinstance(default, bool):
            g.add_argument(flag, action="store_true", help=help_text)
        elif isinstance(default, list):
            g.add_argument(flag, type=_json_list, default=default, help=help_text)
        elif f.name == "thinking_token_budget":
            g.add_argument(flag, type=int, default=None, help=help_text)
        else:
            choices = reasoning_parser_names() if f.name == "reasoning_parser" else tool_parser_names()
            g.add_argument(flag, default=None, choices=choices, help=help_text)
