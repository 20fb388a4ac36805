"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization`` and its shapes)."""

from __future__ import annotations

import asyncio

from kvserve.entrypoints.openai import protocol as p
from kvserve.entrypoints.openai import request_fields
from kvserve.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing
from kvserve.validation import ParamError, check_text


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer endpoints (arguments: ``OpenAIServing``)."""

    async def tokenize(self, body: dict) -> p.TokenizeResponse:
        """``POST /tokenize`` (vLLM's shapes): ``{"prompt": str}`` (``TokenizeCompletionRequest``) or
        ``{"messages": [...]}`` (``TokenizeChatRequest``: the chat template's text, as the chat endpoint renders
        it), tokenized with or without the tokenizer's special tokens (``add_special_tokens``).

        Raises:
            pydantic.ValidationError: a body that fits neither shape (a 400 through the validation handler).
            OpenAIError: unknown model, text that is not valid Unicode or over the server's bounds
                (``limits.RequestLimits``), a conversation the template rejects, or both ``add_generation_prompt``
                and ``continue_final_message``.
        """
        if "messages" in body:
            req = p.TokenizeChatRequest.model_validate(body)
            self.check_model(req.model)
            self.check_bounds(req)
            if req.add_generation_prompt and req.continue_final_message:
                raise OpenAIError("continue_final_message cannot be used with add_generation_prompt=true (the "
                                  "default); set add_generation_prompt to false", param="continue_final_message")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            kwargs = request_fields.checked_template_kwargs(req.chat_template_kwargs)
            text = (await self.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                           tools, kwargs)).text
        else:
            req = p.TokenizeCompletionRequest.model_validate(body)
            self.check_model(req.model)
            text = req.prompt
            self.limits.check_prompt_chars(text, "prompt")
            try:
                check_text("prompt", text)
            except ValueError as e:
                raise OpenAIError(str(e), param="prompt") from None
        ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        """``POST /detokenize``: the text of ``tokens`` (special tokens kept, as vLLM does).

        Raises:
            OpenAIError: unknown model, or token ids outside ``[0, vocab_size)``.
        """
        self.check_model(req.model)
        try:
            return p.DetokenizeResponse(prompt=await self.llm.detokenize(req.tokens))
        except ParamError as e:
            raise OpenAIError(str(e), param=e.field) from None
