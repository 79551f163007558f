"""The MoE block against an independent float64 reference of PaddleFormers' routing (the same
semantics are checked against PaddleFormers itself in test_paddleformers_oracle.py)."""

import numpy as np
import paddle
import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor.models.decoder import CausalLM

LAYER = 1  # tiny-moe: layer 0 dense, layers 1..3 MoE


@pytest.fixture(scope="module")
def model():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FD_HEAD_WISE_KV_CACHE", "0")
        cfg = EngineArgs(model="tiny-moe", block_size=16, num_gpu_blocks_override=8).create_engine_config()
    return CausalLM.load(cfg.model_config)


def reference(model, x: np.ndarray, use_bias: bool = True) -> tuple:
    """float64: softmax router, top-k of probs + correction bias, unbiased weights renormalised,
    routed experts + shared experts. Returns (output, picked experts per token as sets)."""
    moe, p = model.config.moe, f"model.layers.{LAYER}.mlp."
    w = {k: v.numpy().astype(np.float64) for k, v in model.weights.items() if k.startswith(p)}

    def mlp(h, prefix):
        gate, up = h @ w[prefix + "gate_proj.weight"].T, h @ w[prefix + "up_proj.weight"].T
        return (gate / (1 + np.exp(-gate)) * up) @ w[prefix + "down_proj.weight"].T

    logits = x @ w[p + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    scores = probs + (w[p + "moe_statics.e_score_correction_bias"][0] if use_bias else 0)
    out, picked = np.zeros_like(x), []
    for t in range(x.shape[0]):
        top = np.argsort(-scores[t], kind="stable")[:moe.top_k]
        weights = probs[t, top] / probs[t, top].sum()
        out[t] = sum(wt * mlp(x[t:t + 1], f"{p}experts.{e}.")[0] for wt, e in zip(weights, top))
        picked.append(set(top.tolist()))
    return out + mlp(x, p + "shared_experts."), picked


def test_moe_block_matches_the_float64_reference(model):
    x = np.random.default_rng(0).normal(0, 1, (13, model.config.hidden_size))
    block = model.moe[LAYER]
    rows = 16  # padded like a step: the padding rows must not disturb the real ones
    xt = paddle.to_tensor(np.concatenate([x, np.zeros((rows - 13, x.shape[1]))]).astype(np.float32))
    got = block(xt, 13).numpy()[:13]
    want, picked = reference(model, x)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    ids, _ = block.route(paddle.to_tensor(x.astype(np.float32)))
    assert [set(r) for r in ids.numpy().tolist()] == picked


def test_correction_bias_changes_which_experts_are_picked(model):
    """Else the test above could not tell a router that ignores the bias from one that uses it."""
    x = np.random.default_rng(1).normal(0, 1, (64, model.config.hidden_size))
    _, with_bias = reference(model, x, use_bias=True)
    _, without = reference(model, x, use_bias=False)
    assert with_bias != without
