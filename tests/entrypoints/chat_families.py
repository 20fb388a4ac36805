"""Tiny chat models of three families' conventions, built from SmolLM2's own tokenizer (no download): the family's
special tokens added, its chat template, its end tokens in ``generation_config.json`` and in GGUF metadata, and a
random 2-layer Llama whose greedy answer provably ends on the family's end-of-turn token at a known step.

How the answer is made to end: ``transformers`` greedy-decodes the chat prompt (end tokens suppressed); at step
``k`` (the first whose token is new and not the end token) the LM-head rows of that token and of the end token are
swapped, so the same weights now choose the end token at step ``k`` and exactly the old tokens before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
#: A named template in the Llama 3 GGUF (``tokenizer.chat_template.tool_use``): lists the tools' names.
LLAMA3_TOOL_TEMPLATE = (
    "{{- bos_token }}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools: ' }}"
    "{{- tools | map(attribute='function') | map(attribute='name') | join(', ') }}{{- '<|eot_id|>' }}"
    + LLAMA3_TEMPLATE.removeprefix("{{- bos_token }}"))
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message['role'] != "
    "'system' %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ message['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@dataclass(frozen=True)
class Family:
    """One family's chat conventions.

    Attributes:
        added: special tokens added to SmolLM2's vocabulary (ids 49152, 49153, ... in this order).
        bos, eos: the tokenizer's BOS / EOS (``None``: SmolLM2's own); ``add_bos``: the tokenizer adds BOS itself.
        generation_eos: ``generation_config.json`` ``eos_token_id`` (token strings).
        gguf_end: GGUF end-token keys (``eos``, ``eot``, ``eom``) -> token string.
        end: the end-of-turn token the answer ends on.
        template: the chat template; ``layout``: ``"jinja"`` (transformers 5's ``chat_template.jinja``) or
            ``"config"`` (``tokenizer_config.json``'s ``chat_template``).
        added_text: tokens added after ``added`` as plain added tokens, kept in decoded text (Qwen3's ``<think>``
            and ``</think>``).
    """

    name: str
    added: tuple
    bos: str | None
    eos: str | None
    add_bos: bool
    generation_eos: tuple
    gguf_end: dict
    end: str
    template: str
    layout: str
    added_text: tuple = ()


FAMILIES = {
    "llama3": Family("llama3", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eom_id|>", "<|eot_id|>"), "<|begin_of_text|>", "<|end_of_text|>", True,
                     ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                     {"eos": "<|end_of_text|>", "eot": "<|eot_id|>", "eom": "<|eom_id|>"}, "<|eot_id|>",
                     LLAMA3_TEMPLATE, "jinja"),
    "qwen": Family("qwen", (), None, "<|endoftext|>", False, ("<|im_end|>", "<|endoftext|>"),
                   {"eos": "<|im_end|>"}, "<|im_end|>", QWEN_TEMPLATE, "config"),
    "gemma": Family("gemma", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", True,
                    ("<eos>", "<end_of_turn>"), {"eos": "<eos>", "eot": "<end_of_turn>"}, "<end_of_turn>",
                    GEMMA_TEMPLATE, "config"),
}
CONVERSATION = [{"role": "user", "content": "Hi!"}]


@dataclass
class ChatModel:
    """A built family model: ``hf_dir``, ``gguf`` paths; the chat prompt's ids; the greedy ``answer`` (token ids
    before the end token); ``end_id``; ``tokenizer`` (the family's)."""

    family: Family
    hf_dir: Path
    gguf: Path
    prompt_ids: list
    answer: list
    end_id: int
    tokenizer: object


def family_tokenizer(base_dir: Path, fam: Family):
    """SmolLM2's tokenizer (saved in ``base_dir``) with ``fam``'s tokens, BOS / EOS and template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base_dir))  # a fresh copy: the engine's tokenizer is shared
    if fam.added:
        tok.add_special_tokens({"additional_special_tokens": list(fam.added)})
    if fam.added_text:
        tok.add_tokens(list(fam.added_text))
    if fam.bos:
        tok.bos_token = fam.bos
    if fam.eos:
        tok.eos_token = fam.eos
    if fam.add_bos:
        tok.add_bos_token = True
    tok.chat_template = fam.template
    return tok


def build(root: Path, base_dir: Path, gguf_vocab: dict, fam: Family) -> ChatModel:
    """Write ``fam``'s tiny model as a Hugging Face directory and as a GGUF (same weights) under ``root``."""
    import transformers

    tok = family_tokenizer(base_dir, fam)
    ids = lambda t: tok.convert_tokens_to_ids(t)  # noqa: E731
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=False,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = transformers.LlamaForCausalLM(config).eval()
    prompt_ids = tok.encode(tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    end_id = ids(fam.end)
    with torch.no_grad():
        ones = torch.ones(1, len(prompt_ids), dtype=torch.long)
        seq = model.generate(torch.tensor([prompt_ids]), attention_mask=ones,
                             max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt_ids):]
    seq = seq.tolist()
    k = next(i for i in range(3, 8) if seq[i] not in seq[:i] and end_id not in seq[:i + 1])
    with torch.no_grad():  # the end token takes the place of seq[k]: greedy now ends exactly there
        head = model.lm_head.weight
        head[[seq[k], end_id]] = head[[end_id, seq[k]]].clone()

    hf_dir = root / f"{fam.name}-hf"
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    (hf_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": [ids(t) for t in fam.generation_eos]}))
    tok.save_pretrained(str(hf_dir))
    if fam.layout == "config":  # the older layout: the template inside tokenizer_config.json
        (hf_dir / "chat_template.jinja").unlink()
        cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
        cfg["chat_template"] = fam.template
        (hf_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert (hf_dir / "chat_template.jinja").exists() == (fam.layout == "jinja")

    gguf_path = root / f"{fam.name}.gguf"
    write_gguf(gguf_path, model, gguf_vocab, fam, tok)
    return ChatModel(fam, hf_dir, gguf_path, prompt_ids, seq[:k], end_id, tok)


def gguf_vocab(base_dir: Path) -> dict:
    """SmolLM2's vocabulary as GGUF tokenizer arrays (what llama.cpp's converter writes for it): ``tokens`` by id,
    ``token_type`` (its added special tokens are control tokens), ``merges`` (``"a b"``), from the
    ``tokenizer.json`` saved in ``base_dir``."""
    import gguf

    spec = json.loads((base_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return {"tokens": tokens, "token_type": types, "merges": merges, "pre": "smollm"}


def write_gguf(path: Path, model, vocab: dict, fam: Family, tok) -> None:
    """``model`` as a float32 ``llama`` GGUF (``test_families._write_gguf``: llama.cpp's names and Q/K row order)
    with SmolLM2's vocabulary plus ``fam``'s tokens (control tokens), its end-token keys, BOS, and its template --
    for Llama 3 also a named ``tool_use`` template (``tokenizer.chat_template.tool_use``)."""
    import gguf

    from tests.model.test_families import _write_gguf

    tokenizer = {"model": "gpt2", "pre": vocab["pre"],
                 "tokens": list(vocab["tokens"]) + list(fam.added) + list(fam.added_text),
                 "token_type": list(vocab["token_type"]) + [gguf.TokenType.CONTROL] * len(fam.added)
                 + [gguf.TokenType.USER_DEFINED] * len(fam.added_text),
                 "merges": vocab["merges"], "bos_token_id": tok.bos_token_id, "add_bos_token": fam.add_bos}
    fields = [(f"tokenizer.ggml.{k}", v) for k, v in tokenizer.items()]
    fields += [(f"tokenizer.ggml.{key}_token_id", tok.convert_tokens_to_ids(t)) for key, t in fam.gguf_end.items()]
    fields.append(("tokenizer.chat_template", fam.template))
    if fam.name == "llama3":
        fields += [("tokenizer.chat_template.tool_use", LLAMA3_TOOL_TEMPLATE),
                   ("tokenizer.chat_templates", ["tool_use"])]
    _write_gguf(path, model, "llama", permute=True, extra_fields=fields)
