"""Configuration is read once: every environment variable the product reads is declared in envs.py (so
--help lists it) and snapshot into the config at start-up; nothing in a step or an op call reads the
environment (a knob a measurement varies between calls is an argument: set_cpu_options, an attribute)."""

import os
import re
from pathlib import Path

import pytest

from fastdeploy import envs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PRODUCT = [p for root in ("fastdeploy", "custom_ops") for p in (REPO / root).rglob("*")
           if p.suffix in (".py", ".cc", ".h", ".cu", ".cuh", ".cpp") and "__pycache__" not in p.parts]


class _NoEnvironment(dict):
    """os.environ while a step runs: any read is a failure naming the variable."""

    def __getitem__(self, key):
        raise AssertionError(f"a step read the environment: {key}")

    def get(self, key, default=None):
        raise AssertionError(f"a step read the environment: {key}")

    def __contains__(self, key):
        raise AssertionError(f"a step read the environment: {key}")


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_no_step_reads_the_environment(make_config, monkeypatch, mode):
    engine = LLMEngine(make_config(mode, block_size=16, num_gpu_blocks_override=64, max_model_len=256,
                                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
    engine.add_request("a", [5, 6, 7] * 20, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("b", list(range(3, 90)), SamplingParams(temperature=0.7, top_k=5, max_tokens=20, seed=1))
    engine.step()  # the first step builds what is built once (op libraries, views)
    monkeypatch.setattr(os, "environ", _NoEnvironment())
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps > 10


def test_the_ops_read_no_environment_variable():
    """The C++ CPU ops and the CUDA-on-CPU executor take their options from their loaders (cpu_options.h,
    cuda_on_cpu_set_*): no getenv anywhere in their sources."""
    calls = [f"{p.relative_to(REPO)}" for p in PRODUCT if p.suffix != ".py" and "getenv" in p.read_text()]
    assert calls == []


def test_every_variable_the_product_reads_is_declared_in_envs():
    names = set()
    for path in PRODUCT:
        names.update(re.findall(r"\b((?:FD|CUDA_ON_CPU)_[A-Z0-9_]*[A-Z0-9])\b", path.read_text()))
    # Prefixes and names that are no variable (a prefix in a message, C macros, a test server's arguments).
    not_variables = {name for name in names if name.startswith(("FD_TP_", "FD_KVQ_")) and not hasattr(envs, name)}
    not_variables |= {"CUDA_ON_CPU_TLS", "CUDA_ON_CPU_UNSUPPORTED", "CUDA_ON_CPU_STR"}
    missing = sorted(names - not_variables - set(envs.environment_variables))
    assert missing == [], f"read by the product but not declared in fastdeploy/envs.py: {missing}"


def test_the_config_keeps_the_flags_it_was_built_with(make_config, monkeypatch):
    monkeypatch.setenv("FD_LOG_INTERVAL", "7")
    cfg = make_config("1d")
    monkeypatch.setenv("FD_LOG_INTERVAL", "99")
    assert cfg.env.FD_LOG_INTERVAL == 7 and cfg.env.FD_HEAD_WISE_KV_CACHE == 0
    monkeypatch.setenv("FD_CPU_ATTN_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="FD_CPU_ATTN_NUM_THREADS='two' must be an integer"):
        make_config("1d")  # a bad flag stops the start-up, naming it
