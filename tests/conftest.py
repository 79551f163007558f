"""Shared fixtures: configs in each memory mode, built through the real EngineArgs path."""

import os

import pytest

try:
    # PaddleFormers (the ERNIE oracle) puts `sys.modules["torch"] = None` when torch is not imported yet,
    # hiding torch from transformers (the Llama / Gemma 3 oracle) for the rest of the session.
    import torch  # noqa: F401
except ImportError:
    pass

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.paddle_env import CCACHE_WARNING

# The suite's exact-token expectations are CPU float32 ones; on a machine with paddlepaddle-gpu,
# `auto` would pick the GPU (bf16, other presets). GPU tests ask for device="gpu" explicitly.
os.environ.setdefault("FD_DEVICE", "cpu")

# (FD_HEAD_WISE_KV_CACHE, FD_HEAD_WISE_SWA_RECYCLE) for the three memory modes of docs/testing.md.
MEMORY_MODES = {
    "1d": ("0", "1"),
    "head_wise_recycle_off": ("1", "0"),
    "head_wise_recycle_on": ("1", "1"),
}


def pytest_configure(config):
    # pytest restores the warning filters around collection and every test, dropping the one
    # `import fastdeploy` installs (fastdeploy/paddle_env.py); re-state it as a pytest filter.
    config.addinivalue_line("filterwarnings", f"ignore:{CCACHE_WARNING}:UserWarning")
    # PaddleFormers' import pulls in setuptools' distutils shim, which announces itself.
    config.addinivalue_line("filterwarnings", "ignore:Setuptools is replacing distutils:UserWarning")


@pytest.fixture(autouse=True)
def restore_fd_env_flags():
    """Some tests and in-process benchmark helpers set FD_* flags directly; none may leak into the
    next test (a leaked FD_HEAD_WISE_KV_CACHE=1 fails any later subprocess on a model without SWA heads)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("FD_", "ENABLE_V1_"))}
    yield
    for k in [k for k in os.environ if k.startswith(("FD_", "ENABLE_V1_")) and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)


# The CPU ops' instruction sets, best first (custom_ops/cpu_ops/cpu_isa.h; FD_CPU_LINEAR_ISA caps them).
CPU_ISAS = ("avx512", "avx2", "generic")


def cpu_isa() -> str:
    """The instruction set the CPU ops' kernels run on this machine when nothing caps them."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError:
        flags = []
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "generic"


@pytest.fixture(scope="session")
def native_isa() -> str:
    """cpu_isa() as a fixture (test modules cannot import conftest: tests/ holds several)."""
    return cpu_isa()


@pytest.fixture(params=["avx2", "generic"])
def capped_isa(request):
    """An instruction set below this CPU's best (FD_CPU_LINEAR_ISA's values), for the tests that check its
    kernels give the best kernels' bits: on an AVX-512 CPU both, on an AVX2 one the portable kernels;
    skipped where there is nothing below to compare."""
    if CPU_ISAS.index(request.param) <= CPU_ISAS.index(cpu_isa()):
        pytest.skip(f"this CPU's best kernels are {cpu_isa()}: {request.param} is not below them")
    return request.param


@pytest.fixture
def make_config(monkeypatch):
    """make_config(mode, reserve=True, **engine_args) -> FDConfig with the env flags of that mode."""

    def make(mode="head_wise_recycle_on", reserve=True, **kwargs):
        head_wise, recycle = MEMORY_MODES[mode]
        monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
        monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
        monkeypatch.setenv("FD_RESERVE_OUTPUT_PAGES", "1" if reserve else "0")
        kwargs.setdefault("block_size", 16)
        kwargs.setdefault("max_model_len", 1024)
        return EngineArgs(**kwargs).create_engine_config()

    return make
