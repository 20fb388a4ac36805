"""Prompts and the greedy-parity check shared by the n-gram and draft-model speculative decoding tests."""

# repetitive text, so prompt lookup finds matches and drafts are accepted
TEXT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
        "Repeat the sentence: The quick brown fox")


def prompts(llm):
    """Four prompts: the repetitive text raw and chat-templated, a counting pattern, and a short question."""
    chat = llm.apply_chat_template([{"role": "user", "content": "Copy this exactly: " + TEXT}])
    return [TEXT, chat, "Count: one two three one two three one two", "Name a fruit."]


def greedy_reference_and_single(llm, spec_llm, ps, sp):
    """Greedy token ids of ``ps`` without speculation (one batch on ``llm``) and with it (one by one on
    ``spec_llm``); asserts they are identical and returns the reference."""
    reference = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    single = [spec_llm.generate(p, sp)[0].outputs[0].token_ids for p in ps]
    assert single == reference
    return reference
