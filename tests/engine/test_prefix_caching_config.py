"""--enable-prefix-caching: on by default (upstream), in every memory mode, off for the dense oracle."""

import argparse

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_off", "head_wise_recycle_on"])
def test_prefix_caching_is_on_by_default_in_every_memory_mode(make_config, mode):
    cfg = make_config(mode, num_gpu_blocks_override=16)
    assert cfg.cache_config.enable_prefix_caching is True
    assert ResourceManagerV1(cfg).cache_manager.prefix_cache is not None


def test_no_enable_prefix_caching_turns_it_off(make_config):
    cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=16, enable_prefix_caching=False)
    rm = ResourceManagerV1(cfg)
    assert rm.cache_manager.prefix_cache is None and not rm.kv_cache_manager.prefix_caching
    assert rm.stats()["prefix_cache_cached_pages"] == 0


def test_cli_flag_pair_and_default():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args([])).enable_prefix_caching is None  # resolved: on
    assert EngineArgs.from_cli_args(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
    assert EngineArgs.from_cli_args(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False


def test_dense_oracle_defaults_to_off_and_rejects_an_explicit_request(make_config, monkeypatch):
    # NATIVE_ATTN keeps K/V per request slot: a hit would leave it without the prefix's keys.
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "NATIVE_ATTN")
    assert make_config("1d", num_gpu_blocks_override=16).cache_config.enable_prefix_caching is False
    with pytest.raises(ValueError, match="enable_prefix_caching: FD_ATTENTION_BACKEND=NATIVE_ATTN"):
        make_config("head_wise_recycle_on", num_gpu_blocks_override=16, enable_prefix_caching=True)
