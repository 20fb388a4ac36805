"""``LLM``: the offline API. ``LLM(model=None, **engine_args).generate(prompts, sampling_params)``."""

from __future__ import annotations

from typing import Optional

from kvserve.engine.harmony_render import render_harmony
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.chat_utils import check_tools, conversation_from_messages, render_chat
from kvserve.sampling_params import SamplingParams


class LLM:
    """Offline batched generation over one ``LLMEngine``.

    Args:
        model: path to a ``.gguf`` file or Hugging Face directory; ``None`` = the default SmolLM2-135M-Instruct.
        **engine_args: see ``LLMEngine.from_engine_args`` (``block_size``, ``num_kv_blocks``, ``max_num_seqs``,
            ``scheduling``, ...).

    Raises:
        ValueError: unknown or invalid engine arguments, or an unloadable model.
    """

    def __init__(self, model: Optional[str] = None, **engine_args):
        self.llm_engine = LLMEngine.from_engine_args(model=model, **engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, priority=None) -> list:
        """Generate for every prompt; continuous batching runs them together.

        Args:
            prompts: a str, a list of str, one list of token ids, or a list of token-id lists.
            sampling_params: one ``SamplingParams`` for all, or a list with one per prompt; default greedy-free
                ``SamplingParams()``.
            use_tqdm: show a progress bar (finished requests).
            priority: one int per prompt (lower first) for ``scheduling_policy="priority"``; default all 0.

        Returns:
            ``list[RequestOutput]`` in input order, all finished.

        Raises:
            ValueError: a bad prompt or parameter (nothing is left queued: requests added before it are aborted).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a str, a list of str or a list of token-id lists, got "
                             f"{type(prompts).__name__}")
        return self._run(list(prompts), sampling_params, use_tqdm, priority)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False, add_generation_prompt: bool = True,
             tools: Optional[list] = None, chat_template: Optional[str] = None,
             chat_template_kwargs: Optional[dict] = None):
        """Apply the model's chat template, then ``generate``. The rendered text is tokenized without the
        tokenizer's own special tokens (the template writes its BOS itself), as vLLM's ``LLM.chat`` does.

        Args:
            messages: one conversation (a list of ``{"role", "content"}`` dicts) or a list of conversations.
            tools: OpenAI tools (``[{"type": "function", "function": {"name", "description", "parameters"}}]``,
                vLLM's parameter), rendered into the prompt exactly as the server does for ``tool_choice`` "auto"
                (``apply_chat_template``). There is no ``tool_choice`` offline (as in vLLM's ``LLM.chat``): to
                force a call, pass ``SamplingParams(structured_outputs=...)`` with the tool's schema.
            chat_template: a Jinja template (text) for this call instead of the engine's (``chat_template``
                engine argument, else the model's own).
            chat_template_kwargs: variables for the template (``{"enable_thinking": False}``; a harmony model's
                ``reasoning_effort`` and ``model_identity``), as vLLM's ``LLM.chat`` takes them.

        Returns:
            ``list[RequestOutput]``, one per conversation.

        Raises:
            ValueError: a malformed message or tool (see ``apply_chat_template``) or a bad parameter.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c, add_generation_prompt, tools, chat_template, chat_template_kwargs)
                   for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def apply_chat_template(self, conversation: list, add_generation_prompt: bool = True,
                            tools: Optional[list] = None, chat_template: Optional[str] = None,
                            chat_template_kwargs: Optional[dict] = None) -> str:
        """The prompt text of one conversation (and ``tools``) under the model's chat template: the server's
        rendering (``chat_utils.render_chat``; a template that ignores tools, as SmolLM2's does, gets them in the
        system message, tool calls and tool results in the Hermes convention).

        Messages follow ``kvserve.entrypoints.chat_utils`` (the server's rule too): roles system, developer, user,
        assistant, tool; content a string or a list of ``{"type": "text", "text": str}`` parts, ``None`` only in
        an assistant message; valid Unicode. ``tools`` follow the server's ``tools`` (``chat_utils.check_tools``).

        The template is ``chat_template`` if given, else the engine's ``chat_template`` argument, else the
        model's own (``chat_utils.chat_template_for``); a harmony model (gpt-oss: ``LLMEngine.chat_format``) is
        rendered by ``openai-harmony`` instead when no template is given (``harmony_render.render_harmony``).
        ``chat_template_kwargs`` are the template's variables (harmony: ``reasoning_effort``, ``model_identity``).

        Raises:
            ValueError: a malformed conversation or tool (the message names the field, e.g.
                ``messages[0].content``, ``tools[0].function.name``); no chat template at all
                (``chat_utils.NoChatTemplateError``, saying how to pass one).
        """
        messages = conversation_from_messages(conversation)
        kwargs = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt)
        if chat_template is None and self.llm_engine.chat_format == "harmony":
            return render_harmony(messages, check_tools(tools), **kwargs)
        return render_chat(self.get_tokenizer(), messages, check_tools(tools),
                           chat_template or self.llm_engine.chat_template, **kwargs)

    def _run(self, prompts: list, sampling_params, use_tqdm: bool, priority=None,
             add_special_tokens: bool = True) -> list:
        n = len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        if len(params) != n:
            raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts; they must match")
        priorities = [0] * n if priority is None else list(priority)
        if len(priorities) != n:
            raise ValueError(f"priority has {len(priorities)} entries for {n} prompts; they must match")
        engine = self.llm_engine
        ids = []
        try:
            for p, sp, prio in zip(prompts, params, priorities):
                ids.append(engine.add_request(p, sp, priority=prio, add_special_tokens=add_special_tokens))
        except Exception:
            engine.abort_request(ids)
            raise
        return self._drain(ids, use_tqdm)

    def _drain(self, ids: list, use_tqdm: bool) -> list:
        engine = self.llm_engine
        finished = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(running=engine.scheduler.num_running, refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids]
