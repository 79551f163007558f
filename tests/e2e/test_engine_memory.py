"""A long-running engine must not accumulate Python objects step after step."""

import gc

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import SamplingParams


def python_lists() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is list)


def test_engine_steps_leave_no_python_objects_behind(monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    engine = LLMEngine.from_engine_args(EngineArgs(block_size=16, num_gpu_blocks_override=64, max_model_len=512,
                                                   max_num_seqs=4, enable_prefix_caching=False))
    for i in range(2):
        engine.add_request(f"r{i}", [5 + i] * 8, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(20):  # warm-up: lazily built caches, first-call imports
        engine.step()
    before = python_lists()
    for _ in range(200):
        engine.step()
    after = python_lists()
    # paddle.to_tensor on each step's inputs used to leave ~7 lists per step (1400 here) alive.
    assert after - before < 50
