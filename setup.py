"""FastDeploy-shaped serving engine with a head-wise sliding-window KV cache."""

import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

CPU_OP_SOURCES = os.path.join("custom_ops", "cpu_ops")
GPU_OP_SOURCES = os.path.join("custom_ops", "gpu_ops")  # JIT-built on first use where Paddle has CUDA


class BuildPyWithOpSources(build_py):
    """Ship the C++ op sources inside the package, so a regular install can compile them on first use."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "fastdeploy", "_custom_ops", "cpu_ops")
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(CPU_OP_SOURCES, target)
        gpu_target = os.path.join(self.build_lib, "fastdeploy", "_custom_ops", "gpu_ops")
        shutil.rmtree(gpu_target, ignore_errors=True)
        shutil.copytree(GPU_OP_SOURCES, gpu_target)


def _version() -> str:
    scope: dict = {}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastdeploy", "version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


setup(
    name="fastdeploy-headwise-swa",
    version=_version(),
    description="LLM serving engine whose sliding-window KV heads recycle their pages per head",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*"]),
    cmdclass={"build_py": BuildPyWithOpSources},
    entry_points={"console_scripts": ["fastdeploy = fastdeploy.cli:main"]},
    python_requires=">=3.10",
    # Paddle is deliberately not required here: pip would install the CPU wheel over an installed
    # `paddlepaddle-gpu` (both provide the `paddle` package). The `cpu` extra installs it.
    install_requires=[
        "numpy",
        "safetensors",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "tqdm",
        "prometheus_client",
        "pyzmq",  # engine <-> tensor-parallel worker messages; KV-cache events (--kv-events-config)
        "msgpack",  # KV-cache events' wire format (vLLM's KVEventBatch)
        "jinja2",  # the checkpoint's chat template (tokenizer_config.json / chat_template.jinja)
        "tokenizers",  # the checkpoint's tokenizer.json, and tokenizer.model converted to the same pipeline
        "sentencepiece",  # reads tokenizer.model (its protobuf comes with paddle)
        "gguf",  # llama.cpp's reader for GGUF model files: their metadata, tokenizer and tensors
        "llguidance>=1.0",  # structured outputs' grammar engine (no torch): masks JSON schemas, regexes, grammars
    ],
    extras_require={
        "cpu": ["paddlepaddle>=3.0"],
        # Prefill/decode disaggregation: NIXL's wheel (it declares torch, pinned to the CPU wheel these
        # machines carry: unpinned, pip would fetch a multi-GB CUDA build it does not need) and the router
        # that drives a prefill + decode pair.
        "pd": ["nixl-cu12==1.5.1", "vllm-router==0.1.17", "torch==2.13.0"],
        # Everything the whole suite needs, in one resolver pass. The real models are not here: they are
        # fetched on first use like any user's (fastdeploy/model_executor/models/model_fetch.py).
        "test": ["fastdeploy-headwise-swa[pd]", "pytest", "hypothesis", "openai", "aiohttp", "requests", "matplotlib",
                 "pyyaml", "tokenizers",
                 "jsonschema",  # validates the structured outputs (tests/entrypoints/test_structured_outputs.py)
                 # The oracle for real models (Llama, Gemma 3) and GGUF tokenizers: transformers' own GGUF
                 # loader on torch CPU. 5.24.0: the first release whose GGUF loader tokenizes Gemma 3 as
                 # llama.cpp does (5.3.0 cut its words into pieces). The ERNIE oracle, PaddleFormers 1.2.0,
                 # declares transformers<5.4: it runs in an environment of its own that its test builds
                 # (tests/model_executor/test_paddleformers_oracle.py).
                 "transformers==5.24.0", "torch==2.13.0", "accelerate==1.15.0",
                 # lm-evaluation-harness against the server (tests/entrypoints/test_lm_eval_harness.py,
                 # docs/accuracy_with_lm_eval.md). Its `datasets` needs pyarrow >= 24; pyarrow 26 refuses to
                 # import next to numpy 1.x, which the suite keeps (the release it was proven on, and the one
                 # the PaddleFormers oracle's fast_dataindex accepts: numpy<=1.26.4).
                 "lm-eval[api]==0.4.13", "pyarrow==24.0.0", "numpy<=1.26.4"],
        "bench": ["aiohttp", "matplotlib", "pyyaml"],
        "mutation": ["mutmut>=3.8"],  # tools/mutation_test.py (docs/mutation_testing.md), not CI
        # benchmarks/gpu_check.py's Paddle-free A/B (device buffers); pick the wheel of your CUDA major
        # (cupy-cuda13x for CUDA 13). PyTorch, where installed, runs its GEMMs in bf16.
        "gpu-check": ["pytest", "cupy-cuda12x"],
    },
)
