"""What a warm load keeps out of memory, on the real default model: Q/K rows reordered lazily, embedding rows read
with ``pread`` (same values as the mapping), the tokenizer cache's ``added_tokens_decoder`` (same tokenizer, no
Python parse of ``tokenizer.json``)."""

import json
import shutil

import numpy as np
import pytest

from kvserve.model import loader
from kvserve.model.loader import load_model
from kvserve.quant import gguf_io
from kvserve.quant.gguf_io import QuantTensor, rope_unpermute_index

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, "float32", keep_quantized=True)


@pytest.fixture(scope="module")
def fresh():
    """A load of its own: the shared one's tensors may have been read by other tests' model builds."""
    return loader._load_model(None, "float32", keep_quantized=True, with_tokenizer=False)


def test_q_rows_reordered_without_a_copy_until_read(fresh):
    q = fresh.weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantTensor) and q.rows is not None and "raw" not in q.__dict__
    index = rope_unpermute_index(q.out_features, fresh.arch.num_attention_heads)
    fresh = QuantTensor(q.name, q.qtype, q.source, q.shape)
    assert np.array_equal(fresh.take_rows(index).raw, q.source[index])
    nested = fresh.take_rows(index).take_rows(np.arange(5, 9))
    assert nested.shape == (4, q.in_features) and np.array_equal(nested.raw, q.source[index[5:9]])
    assert nested.nbytes() == 4 * q.source.shape[1]


def test_embedding_rows_read_from_the_file_equal_the_mapping(fresh, monkeypatch):
    emb = fresh.weights["model.embed_tokens.weight"]
    assert emb.file is not None and "raw" not in emb.__dict__
    ids = np.array([0, 5, 49151, 5, 1234, -1])
    mapped = QuantTensor(emb.name, emb.qtype, emb.source, emb.shape)  # no file: indexes the mapping
    assert np.array_equal(emb.dequantize(ids), mapped.dequantize(ids))
    assert "raw" not in emb.__dict__
    assert emb.raw is emb.source  # no copy; lookups still read the file (not the mapping)
    reads = []
    real_preadv = gguf_io.os.preadv
    monkeypatch.setattr(gguf_io.os, "preadv", lambda *a: reads.append(a[2]) or real_preadv(*a))
    assert np.array_equal(emb.dequantize(ids), mapped.dequantize(ids))
    row = emb.source.shape[1]
    assert reads == [emb.file[1] + r * row for r in (0, 5, 49151, 5, 1234, 49151)]  # one read per row
    with pytest.raises(IndexError, match="rows must be in"):
        emb.dequantize(np.array([emb.out_features]))


def test_tokenizer_cache_records_added_tokens(tmp_path, monkeypatch, loaded):
    digest = loader.source_sha256(loaded.path)
    source = loader.cache_root() / "tokenizers" / digest[:16]
    root = tmp_path / "cache"
    folder = root / "tokenizers" / source.name
    shutil.copytree(source, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)  # as saved before this change
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(root))

    first = loader._gguf_tokenizer(loaded.path, digest)  # reads the old config, then records the added tokens
    recorded = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert recorded["2"] == {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": True}
    second = loader._gguf_tokenizer(loaded.path, digest)
    text = "<|im_start|>user\nHi there, ünïcödé 🤖<|im_end|>\n"
    chat = [{"role": "user", "content": "Name a planet."}]
    for tok in (second, loaded.tokenizer):
        assert tok.encode(text) == first.encode(text)
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            first.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert {i: str(t) for i, t in tok.added_tokens_decoder.items()} == \
            {i: str(t) for i, t in first.added_tokens_decoder.items()}
        assert (tok.eos_token_id, tok.pad_token, tok.all_special_ids, len(tok)) == \
            (first.eos_token_id, first.pad_token, first.all_special_ids, len(first))
