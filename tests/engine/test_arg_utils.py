"""Engine flags generated from the config dataclasses: one flag per field, defaults and help from the field,
parsed values round-trip into ``EngineConfig`` (no model)."""

import argparse
from dataclasses import fields

import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.engine.arg_utils import add_engine_args, engine_kwargs


def parse(*argv):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p, p.parse_args(list(argv))


def test_every_config_field_is_a_flag_with_its_default_and_help():
    p, args = parse()
    help_text = " ".join(p.format_help().split())
    for cls in (ModelConfig, CacheConfig, SchedulerConfig):
        for f in fields(cls):
            assert getattr(args, f.name) == f.default, f.name
            assert "--" + f.name.replace("_", "-") in help_text
            assert " ".join(f.metadata["help"].split()) in help_text
    assert "(default: 16)" in help_text and "(default: continuous)" in help_text


def test_parsed_flags_build_the_config():
    _, args = parse("--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "3",
                    "--scheduling", "static", "--speculative-config", '{"method": "ngram"}')
    cfg = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert cfg.cache_config.block_size == 32 and cfg.cache_config.enable_prefix_caching is False
    assert cfg.scheduler_config.max_num_seqs == 3 and cfg.scheduler_config.scheduling == "static"
    assert cfg.speculative_config.method == "ngram" and cfg.model_config.device == "cpu"


def test_bad_flag_values_are_refused():
    with pytest.raises(SystemExit):
        parse("--scheduling", "round-robin")  # not among the field's choices
    with pytest.raises(SystemExit):
        parse("--speculative-config", "[1]")  # not a JSON object
    _, args = parse("--block-size", "0")
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, 1024\], got 0"):
        EngineConfig.from_kwargs(**engine_kwargs(args))
    with pytest.raises(ValueError, match="device must be one of"):
        EngineConfig.from_kwargs(device="cuda")


def test_a_removed_argument_says_why_and_an_unknown_one_lists_the_known():
    with pytest.raises(ValueError, match=r"removed engine argument\(s\): batch_invariant: batch invariance is "
                                         r"always on"):
        EngineConfig.from_kwargs(batch_invariant=True)
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['colour'\]; known: .*'speculative_config'"):
        EngineConfig.from_kwargs(colour=1)


def test_the_disk_tier_is_one_flag_and_bad_values_are_refused_by_name():
    _, args = parse("--kv-disk-cache-dir", "/tmp/kv", "--kv-disk-cache-bytes", "1000000")
    cc = EngineConfig.from_kwargs(**engine_kwargs(args)).cache_config
    assert (cc.kv_disk_cache_dir, cc.kv_disk_cache_bytes) == ("/tmp/kv", 1000000)
    assert parse()[1].kv_disk_cache_dir is None  # off by default
    with pytest.raises(ValueError, match="kv_disk_cache_dir needs enable_prefix_caching=True"):
        EngineConfig.from_kwargs(kv_disk_cache_dir="/tmp/kv", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_disk_cache_bytes must be an integer >= 1, got 0"):
        EngineConfig.from_kwargs(kv_disk_cache_dir="/tmp/kv", kv_disk_cache_bytes=0)
    with pytest.raises(ValueError, match="kv_disk_cache_dir must be a directory path"):
        EngineConfig.from_kwargs(kv_disk_cache_dir="")
    with pytest.raises(ValueError, match="kv_disk_cache_dir is not supported with tensor_parallel_size=2"):
        EngineConfig.from_kwargs(kv_disk_cache_dir="/tmp/kv", tensor_parallel_size=2)
