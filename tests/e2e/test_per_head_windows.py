"""Per-head windows end to end: each (layer, KV head) pair of the tiny preset (2 layers, 4 KV heads) with
its own window and sink, full heads among them, through the real engine. The type table is built by
hand (the config's per-head windows come with the slot layout's change); the paged backend passes each
layer's [2, kv_heads] windows and sinks to the op, the dense NATIVE_ATTN oracle masks every query head
with its KV head's own pair, and greedy tokens must agree."""

import pytest

from fastdeploy.cache_manager.slots import FULL, AttentionType
from fastdeploy.model_executor.layers.attention import append_attn_backend, swa_spec
from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import find_cuda_include
from greedy_run import MODES, greedy_tokens

# Windows of 9 to 40 tokens: the prompts below run past each by up to ~30x.
TABLE = ((AttentionType(20, 3), FULL, AttentionType(9, 0), AttentionType(33, 5)),
         (FULL, AttentionType(33, 5), AttentionType(20, 3), AttentionType(40, 0)))
SPEC = {"sliding_window": 20, "sink_size": 3, "swa_kv_heads": [0, 2]}  # a valid spec; TABLE replaces it
PROMPT_LENGTHS = [7, 40, 130, 300]
MAX_TOKENS = 16


def prompts():
    return [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def generate(monkeypatch, backend, table, head_wise="0", recycle="1", **engine_args):
    monkeypatch.setattr(swa_spec, "attention_type_table", lambda model_config: table)
    monkeypatch.setattr(append_attn_backend, "attention_type_table", lambda model_config: table)
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, head_wise, recycle, block_size=16,
                         max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256, head_wise_swa_config=SPEC,
                         **engine_args)


@pytest.fixture(scope="module")
def oracle():
    mp = pytest.MonkeyPatch()
    try:
        return generate(mp, "NATIVE_ATTN", TABLE)[0]
    finally:
        mp.undo()


@pytest.mark.parametrize("mode", MODES)
def test_a_window_per_head_gives_the_oracles_tokens(monkeypatch, oracle, mode):
    """With recycling on, the slots of the layout's recycled type (today one sliding type recycles)
    hold -1 at their dead blocks while heads of the other types keep theirs."""
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", TABLE, *MODES[mode])
    assert tokens == oracle
    if mode == "head_wise_recycle_on":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0


def test_the_oracle_depends_on_each_heads_own_window(monkeypatch, oracle):
    """The same heads sliding with one window and sink (today's spec) is a different model, so the
    comparison above can fail."""
    one_type = tuple(tuple(AttentionType(20, 3) if t.sliding else FULL for t in row) for row in TABLE)
    assert generate(monkeypatch, "NATIVE_ATTN", one_type)[0] != oracle


@pytest.mark.skipif(find_cuda_include() is None, reason="the CUDA toolkit's headers are needed to build the kernels")
def test_the_cuda_kernels_on_the_cpu_give_the_cpu_ops_tokens_with_a_window_per_head(monkeypatch):
    """CUDA_ON_CPU (the CUDA kernels, head_windows 1) and the CPU op on the same bfloat16 pages, the
    recycled type's dead pages -1, on the head_dim-64 twin of the tiny preset."""
    args = dict(model="ernie-4.5-tiny-swa-hd64", cache_dtype="bfloat16")
    cpu_op, _ = generate(monkeypatch, "APPEND_ATTN", TABLE, *MODES["head_wise_recycle_on"], **args)
    kernels, engine = generate(monkeypatch, "CUDA_ON_CPU", TABLE, *MODES["head_wise_recycle_on"], **args)
    assert kernels == cpu_op
    assert engine.get_stats()["swa_pages_recycled_total"] > 0
