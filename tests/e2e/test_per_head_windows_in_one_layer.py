"""Per-head windows end to end, several sliding types inside one layer: each (layer, KV head) pair of the
tiny preset (2 layers, 4 KV heads) with its own window and sink, full heads among them, from the config's
`head_windows` / `head_sinks`. The paged backend passes each layer's [2, kv_heads] windows and sinks to the
op, the dense NATIVE_ATTN oracle masks every query head with its KV head's own pair, and greedy tokens
must agree; with recycling on, every sliding type's dead pages go back to the free lists."""

import pytest

from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import find_cuda_include
from greedy_run import MODES, greedy_tokens

# Windows of 9 to 40 tokens: the prompts below run past each by up to ~30x. Layer 0: head 1 full;
# layer 1: head 0 full; the others slide with four different (window, sink) pairs.
SPEC = {"sliding_window": 20, "sink_size": 3, "swa_kv_heads": [[0, 2, 3], [1, 2, 3]],
        "head_windows": [[20, 9, 33], [33, 20, 40]], "head_sinks": [[3, 0, 5], [5, 3, 0]]}
PROMPT_LENGTHS = [7, 40, 130, 300]
MAX_TOKENS = 16


def prompts():
    return [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def generate(monkeypatch, backend, spec=SPEC, head_wise="0", recycle="1", **engine_args):
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, head_wise, recycle, block_size=16,
                         max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256, head_wise_swa_config=spec,
                         **engine_args)


@pytest.fixture(scope="module")
def oracle():
    mp = pytest.MonkeyPatch()
    try:
        return generate(mp, "NATIVE_ATTN")[0]
    finally:
        mp.undo()


@pytest.mark.parametrize("mode", MODES)
def test_a_window_per_head_gives_the_oracles_tokens(monkeypatch, oracle, mode):
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", SPEC, *MODES[mode])
    assert tokens == oracle
    if mode == "head_wise_recycle_on":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0


def test_the_oracle_depends_on_each_heads_own_window(monkeypatch, oracle):
    """The same heads sliding with one window and sink is a different model, so the comparison above can fail."""
    one_type = {k: v for k, v in SPEC.items() if k not in ("head_windows", "head_sinks")}
    assert generate(monkeypatch, "NATIVE_ATTN", one_type)[0] != oracle


@pytest.mark.skipif(find_cuda_include() is None, reason="the CUDA toolkit's headers are needed to build the kernels")
def test_the_cuda_kernels_on_the_cpu_give_the_cpu_ops_tokens_with_a_window_per_head(monkeypatch):
    """CUDA_ON_CPU (the CUDA kernels, head_windows 1) and the CPU op on the same bfloat16 pages, every
    sliding type's dead pages -1, on the head_dim-64 twin of the tiny preset."""
    args = dict(model="ernie-4.5-tiny-swa-hd64", cache_dtype="bfloat16")
    cpu_op, _ = generate(monkeypatch, "APPEND_ATTN", SPEC, *MODES["head_wise_recycle_on"], **args)
    kernels, engine = generate(monkeypatch, "CUDA_ON_CPU", SPEC, *MODES["head_wise_recycle_on"], **args)
    assert kernels == cpu_op
    assert engine.get_stats()["swa_pages_recycled_total"] > 0
