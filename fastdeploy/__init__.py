"""FastDeploy-shaped LLM serving engine with a head-wise sliding-window KV cache.

`from fastdeploy import LLM, SamplingParams` is the offline API; both names load lazily so that
importing a pure-Python submodule (config, cache manager, scheduler) does not import Paddle.
"""

from fastdeploy.paddle_env import quiet_paddle_import_warnings, require_paddle

# Before any submodule can import Paddle (see paddle_env.py).
quiet_paddle_import_warnings()

from fastdeploy.version import __version__  # noqa: E402,F401
__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams"]


def __getattr__(name):
    if name == "LLM":
        require_paddle()
        from fastdeploy.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fastdeploy.engine.request import SamplingParams

        return SamplingParams
    if name == "GuidedDecodingParams":
        from fastdeploy.model_executor.guided_decoding.params import GuidedDecodingParams

        return GuidedDecodingParams
    raise AttributeError(f"module 'fastdeploy' has no attribute {name!r}")
