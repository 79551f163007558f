"""FastDeploy-shaped serving engine with a head-wise sliding-window KV cache."""

from setuptools import find_packages, setup

setup(
    name="fastdeploy-headwise-swa",
    version="0.1.0",
    description="LLM serving engine whose sliding-window KV heads recycle their pages per head",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*"]),
    python_requires=">=3.10",
    install_requires=[
        "paddlepaddle>=3.0",
        "numpy",
        "safetensors",
        "fastapi",
        "uvicorn",
        "pydantic>=2",
        "tqdm",
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "openai", "aiohttp", "requests", "matplotlib", "pyyaml", "tokenizers"],
        "bench": ["aiohttp", "matplotlib", "pyyaml"],
    },
)
