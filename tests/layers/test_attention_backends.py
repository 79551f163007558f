"""APPEND_ATTN (paged, through real scheduler tables) vs NATIVE_ATTN (dense) on random q/k/v."""

import numpy as np
import paddle
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.model_executor.layers.attention.append_attn_backend import AppendAttentionBackend
from fastdeploy.model_executor.layers.attention.native_attn_backend import NativeAttentionBackend
from fastdeploy.engine.step_runner import StepRunner

SWA = {"sliding_window": 20, "sink_size": 3, "swa_kv_heads": [0, 2]}


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_off", "head_wise_recycle_on"])
def test_paged_backend_matches_dense_backend_step_by_step(make_config, mode):
    cfg = make_config(mode, num_gpu_blocks_override=40, block_size=8, max_num_batched_tokens=24, max_num_seqs=4,
                      max_model_len=256, head_wise_swa_config=SWA, enable_prefix_caching=False)
    runner = StepRunner(cfg)
    paged = runner.attn_backend
    assert isinstance(paged, AppendAttentionBackend)
    dense = NativeAttentionBackend(cfg, paged.rotary)
    rm = ResourceManagerV1(cfg)
    for i, (plen, out) in enumerate([(45, 30), (7, 40), (60, 12)]):
        rm.add_request(Request(f"r{i}", [5] * plen, SamplingParams(max_tokens=out, ignore_eos=True), eos_token_id=2))
    rng = np.random.default_rng(0)
    model = cfg.model_config
    width = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    worst, steps = 0.0, 0
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        meta = runner.ranks.build_forward_meta(runner.build_step_input(batch))
        qkv = paddle.to_tensor(rng.standard_normal((batch.num_tokens, width)).astype(np.float32))
        a = paged.forward(0, qkv, meta).numpy()
        b = dense.forward(0, qkv, meta).numpy()
        worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        for r in batch.requests:
            if r.request.is_finished:
                runner.release(r.request.request_id)
        steps += 1
    assert steps > 20
    if mode == "head_wise_recycle_on":
        assert rm.swa_pages_recycled_total > 0
    assert worst < 1e-5, worst
