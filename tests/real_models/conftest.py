"""The real models that PyPI packages ship, and their reference: transformers on torch CPU reading the
same GGUF file. Each is loaded once per test session; without the packages these tests skip."""

import os

import pytest


def _gguf_of(name: str):
    from fastdeploy.model_executor.models.named_models import resolve

    try:
        return resolve(name)
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_path():
    return _gguf_of("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3_path():
    return _gguf_of("gemma-3-270m")


def _hide_paddlecodec_from_transformers() -> None:
    """PaddleFormers' dependency paddlecodec installs an import package named `torchcodec` without
    torchcodec's metadata; transformers then takes it for torchcodec and fails to read its version.
    The reference never decodes audio or video: tell transformers there is no torchcodec."""
    import importlib.metadata

    try:
        importlib.metadata.version("torchcodec")
    except importlib.metadata.PackageNotFoundError:
        import transformers.utils
        import transformers.utils.import_utils as import_utils

        import_utils.is_torchcodec_available = transformers.utils.is_torchcodec_available = lambda: False


def _transformers_model(path: str):
    transformers = pytest.importorskip("transformers")
    _hide_paddlecodec_from_transformers()
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    return _transformers_model(smollm2_path)


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_path):
    return _transformers_model(gemma3_path)


def _smollm2_engine(flag: int):
    from fastdeploy import LLM, envs

    _gguf_of("smollm2-135m-instruct")  # skips without the package
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
