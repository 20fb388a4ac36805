"""``benchmarks.accuracy``'s texts: the vLLM sonnet text cut into prompts (the perplexity the issue-47 default was
decided on) and the bad-data-folder error. Model-free: a tokenizer of one id per character."""

import pytest

from benchmarks.accuracy import add_args, sonnet_texts



class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_sonnet_texts_are_consecutive_prompts_of_the_whole_text(tmp_path):
    (tmp_path / "vllm_sonnet").mkdir()
    (tmp_path / "vllm_sonnet" / "sonnet.txt").write_text("abcdefghij", encoding="utf-8")
    tok = CharTokenizer()
    texts = sonnet_texts(tok, 100, chunk_tokens=4, data_dir=tmp_path)
    assert texts == [tok.encode("abcd"), tok.encode("efgh"), tok.encode("ij")]  # 3 + 3 + 1 = 7 positions
    assert sonnet_texts(tok, 4, chunk_tokens=4, data_dir=tmp_path) == texts[:2]  # stops once 4 are covered


def test_missing_data_folder_is_a_value_error_naming_the_path(tmp_path):
    with pytest.raises(ValueError, match="sonnet.txt not found: --data-dir"):
        sonnet_texts(CharTokenizer(), 10, data_dir=tmp_path)


def test_activations_and_texts_flags():
    import argparse

    p = argparse.ArgumentParser()
    add_args(p)
    a = p.parse_args(["--activations", "int8,int8x2", "--texts", "sonnet", "--chunk-tokens", "256"])
    assert (a.activations, a.texts, a.chunk_tokens) == ("int8,int8x2", "sonnet", 256)
    with pytest.raises(SystemExit):
        p.parse_args(["--texts", "wiki"])
