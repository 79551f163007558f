"""APPEND_ATTN (paged, through real scheduler tables) vs NATIVE_ATTN (dense) on random q/k/v."""

import numpy as np
import paddle
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.model_executor.layers.attention.append_attn_backend import AppendAttentionBackend
from fastdeploy.model_executor.layers.attention.native_attn_backend import NativeAttentionBackend
from fastdeploy.engine.step_runner import StepRunner
from fastdeploy.cache_manager.slots import FULL, AttentionType
from fastdeploy.model_executor.layers.attention import append_attn_backend, swa_spec
from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import find_cuda_include

SWA = {"sliding_window": 20, "sink_size": 3, "swa_kv_heads": [0, 2]}


def _worst_step_difference(cfg, runner, paged, dense, shapes):
    """Run requests of (prompt, output) `shapes` through the real scheduler; at every step feed layer 0 of
    both backends the same random qkv. Returns (worst relative difference, steps, the resource manager)."""
    rm = ResourceManagerV1(cfg)
    runner.batch.kv_cache_manager = rm.kv_cache_manager  # the step runner forwards this scheduler's table changes
    for i, (plen, out) in enumerate(shapes):
        rm.add_request(Request(f"r{i}", [5] * plen, SamplingParams(max_tokens=out, ignore_eos=True), eos_token_id=2))
    rng = np.random.default_rng(0)
    model = cfg.model_config
    width = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    worst, steps = 0.0, 0
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        meta = runner.ranks.build_forward_meta(runner.build_step_input(batch))
        qkv = paddle.to_tensor(rng.standard_normal((batch.num_tokens, width)).astype(np.float32))
        a = paged.forward(0, qkv, meta).astype("float32").numpy()
        b = dense.forward(0, qkv, meta).numpy()
        worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        for r in batch.requests:
            if r.request.is_finished:
                runner.release(r.request.request_id)
        steps += 1
    return worst, steps, rm


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_off", "head_wise_recycle_on"])
def test_paged_backend_matches_dense_backend_step_by_step(make_config, mode):
    cfg = make_config(mode, num_gpu_blocks_override=40, block_size=8, max_num_batched_tokens=24, max_num_seqs=4,
                      max_model_len=256, head_wise_swa_config=SWA, enable_prefix_caching=False)
    runner = StepRunner(cfg)
    paged = runner.attn_backend
    assert isinstance(paged, AppendAttentionBackend)
    dense = NativeAttentionBackend(cfg, paged.rotary)
    worst, steps, rm = _worst_step_difference(cfg, runner, paged, dense, [(45, 30), (7, 40), (60, 12)])
    assert steps > 20
    if mode == "head_wise_recycle_on":
        assert rm.kv_cache_manager.swa_pages_recycled_total > 0
    assert worst < 1e-5, worst


# -- per-head windows: each (layer, KV head) pair with its own window and sink ---------------------------
# The type table is built by hand here (three sliding types and a full head in every layer of the tiny
# preset); the backends read it through swa_spec.attention_type_table.
MIXED_TYPES = (AttentionType(20, 3), FULL, AttentionType(9, 0), AttentionType(33, 5))


@pytest.fixture
def mixed_window_table(monkeypatch):
    """Every layer's KV head h gets MIXED_TYPES[h % 4]: full heads and three sliding types in one layer."""
    def table(model_config):
        row = tuple(MIXED_TYPES[h % len(MIXED_TYPES)] for h in range(model_config.num_key_value_heads))
        return (row,) * model_config.num_hidden_layers

    monkeypatch.setattr(swa_spec, "attention_type_table", table)
    monkeypatch.setattr(append_attn_backend, "attention_type_table", table)
    return MIXED_TYPES


def test_row_attention_args_give_each_head_its_window_and_sink():
    assert swa_spec.row_attention_args(MIXED_TYPES) == ([20, 0, 9, 33], [3, 0, 0, 5])
    assert swa_spec.row_attention_args((FULL, FULL)) == ([0, 0], [0, 0])


def test_dense_backend_masks_each_query_head_with_its_kv_heads_window(make_config, mixed_window_table):
    cfg = make_config("1d", num_gpu_blocks_override=40, block_size=8, max_num_seqs=2, max_model_len=128,
                      head_wise_swa_config=SWA, enable_prefix_caching=False)
    dense = NativeAttentionBackend(cfg, StepRunner(cfg).attn_backend.rotary)
    model = cfg.model_config
    group = model.num_attention_heads // model.num_key_value_heads
    start, n = 50, 7
    got = dense.visibility(start, n, 0).numpy()
    t = np.arange(start, start + n)[:, None]
    j = np.arange(start + n)[None, :]
    for qh in range(model.num_attention_heads):
        kind = mixed_window_table[(qh // group) % len(mixed_window_table)]
        want = j <= t
        if kind.sliding:
            want = want & ((j < kind.sink) | (j > t - kind.window))
        assert np.array_equal(got[qh], want), (qh, kind)


@pytest.mark.parametrize("backend, mode, cache_dtype, tolerance", [
    ("APPEND_ATTN", "1d", None, 1e-5),
    ("APPEND_ATTN", "head_wise_recycle_off", None, 1e-5),
    ("CUDA_ON_CPU", "head_wise_recycle_off", "bfloat16", 2e-2),
])
def test_paged_backends_match_dense_backend_with_a_window_per_head(make_config, monkeypatch, mixed_window_table,
                                                                   backend, mode, cache_dtype, tolerance):
    """APPEND_ATTN (the CPU op) and CUDA_ON_CPU (the CUDA kernels) pass each head's own window and sink
    ([2, kv_heads] masks); the dense backend masks per query head: the same attention step by step
    (recycling off: the hand-built table bypasses the config the cache manager's slot layout reads)."""
    if backend == "CUDA_ON_CPU" and find_cuda_include() is None:
        pytest.skip("the CUDA toolkit's headers are needed to build the kernels for the CPU")
    monkeypatch.setenv("FD_ATTENTION_BACKEND", backend)
    extra = {"model": "ernie-4.5-tiny-swa-hd64", "cache_dtype": cache_dtype} if backend == "CUDA_ON_CPU" else {}
    cfg = make_config(mode, num_gpu_blocks_override=40, block_size=16, max_num_batched_tokens=24, max_num_seqs=4,
                      max_model_len=256, enable_prefix_caching=False, **extra,
                      **({} if extra else {"head_wise_swa_config": SWA}))
    runner = StepRunner(cfg)
    paged = runner.attn_backend
    assert isinstance(paged, AppendAttentionBackend)
    assert all(mask.shape == [2, cfg.model_config.num_key_value_heads] for mask, *_ in paged.layer_args)
    dense = NativeAttentionBackend(cfg, paged.rotary)
    worst, steps, _ = _worst_step_difference(cfg, runner, paged, dense, [(45, 12), (7, 30), (60, 6)])
    assert steps > 20
    assert worst < tolerance, worst
