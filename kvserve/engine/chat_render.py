"""A conversation through a chat template: ``render_chat`` with the template ``chat_template_for`` picks
(``--chat-template``, else the model's own, else ``NoChatTemplateError``). The engine's side of
``EngineClient.render_chat`` (``kvserve.engine.protocol``) and of the offline ``LLM.chat``; the conversation itself
is validated above (``kvserve.entrypoints.chat_utils.conversation_from_messages``).
"""

from __future__ import annotations

import json
from typing import Optional

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""



class NoChatTemplateError(ValueError):
    """The model has no chat template and none was given (a 400 on ``/v1/chat/completions``)."""


NO_CHAT_TEMPLATE = ("this model has no chat template (none in its files: a GGUF's tokenizer.chat_template, or "
                    "tokenizer_config.json's chat_template / chat_template.jinja in a Hugging Face directory), so "
                    "chat messages cannot be turned into a prompt; pass one with --chat-template FILE (kvserve "
                    "serve / generate) or LLM(chat_template=...) / LLM.chat(chat_template=...), or send the prompt "
                    "text to /v1/completions")


def chat_template_for(tokenizer, chat_template: Optional[str] = None, tools: Optional[list] = None) -> str:
    """The Jinja text that renders a conversation: ``chat_template`` when given (``--chat-template``), else the
    tokenizer's own -- of several named ones (a GGUF's ``tokenizer.chat_template.<name>``, a directory's
    ``chat_templates/``), ``tool_use`` when there are ``tools`` and it exists, else ``default`` (transformers'
    rule).

    Raises:
        NoChatTemplateError: neither exists (the message says how to pass one).
    """
    if chat_template:
        return chat_template
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("tool_use") if tools and own.get("tool_use") else own.get("default")
    if not isinstance(own, str) or not own:
        raise NoChatTemplateError(NO_CHAT_TEMPLATE)
    return own


def render_chat(tokenizer, conversation: list[dict], tools: Optional[list] = None,
                chat_template: Optional[str] = None, **kwargs) -> str:
    """The chat template's text for ``conversation`` (from ``conversation_from_messages``) and OpenAI ``tools``.

    The template is ``chat_template_for(tokenizer, chat_template, tools)``. One that knows tools (mentions
    ``tools``) gets them (``apply_chat_template(tools=...)``). Otherwise (SmolLM2's template ignores tools and
    tool calls) the conversation is rewritten in the Hermes convention first (an assistant's ``reasoning_content``
    kept): the tools and the ``<tool_call>``
    format go into the system message (``TOOLS_PROMPT``), an assistant's tool calls become
    ``<tool_call>{...}</tool_call>`` text, and a tool result becomes a user turn ``<tool_response>...``.
    ``kwargs`` go to ``apply_chat_template`` (``add_generation_prompt`` ...).

    Raises:
        NoChatTemplateError: no template (see ``chat_template_for``); whatever the template raises
            (``raise_exception``: a ``jinja2`` error).
    """
    template = chat_template_for(tokenizer, chat_template, tools)
    if "tools" in template:
        return tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                             chat_template=template, **kwargs)
    conv = []
    for m in conversation:
        if m.get("tool_calls"):
            blocks = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                             "arguments": c["function"]["arguments"]})
                                + "\n</tool_call>" for c in m["tool_calls"])
            conv.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + blocks})
        elif m["role"] == "tool":
            conv.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            conv.append({"role": m["role"], "content": m["content"]})
        if "reasoning_content" in m:  # reasoning sent back: the template's variable, whichever convention
            conv[-1]["reasoning_content"] = m["reasoning_content"]
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if conv and conv[0]["role"] == "system":
            conv[0] = {"role": "system", "content": conv[0]["content"] + "\n\n" + prompt}
        else:
            conv.insert(0, {"role": "system", "content": prompt})
    return tokenizer.apply_chat_template(conv, tokenize=False, chat_template=template, **kwargs)
