"""gpt-oss's MoE feed-forward block (`GptOssForCausalLM`), as transformers defines it.

- every layer is MoE; the router is a linear layer with a bias (`mlp.router.weight` `[E, h]`, `mlp.router.bias`);
  each token takes the top-k experts by router logit, weighted by the softmax of those k logits alone;
- an expert is a clamped SwiGLU with biases: gate clamped above at `swiglu_limit`, up clamped to
  [-limit, limit], `(up + 1) * gate * sigmoid(alpha * gate)`, then the down projection;
- the checkpoint stacks the experts (`mlp.experts.gate_up_proj` `[E, h, 2I]` with gate and up interleaved
  along the last axis, `gate_up_proj_bias` `[E, 2I]`, `down_proj` `[E, I, h]`, `down_proj_bias` `[E, h]`,
  all multiplied from the right). `engine_layout` turns them once at load into the engine's `[out, in]`
  weights with gate rows before up rows, so each expert is two row-invariant GEMMs (layers/linear.py).

MXFP4 expert blocks (`*_blocks` / `*_scales`, quantization_config quant_method "mxfp4") are refused at
start-up by name (model_config.py): this engine holds the experts as float weights.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor.host_tensor import host_tensor
from fastdeploy.model_executor.layers.linear import linear

STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
           "mlp.experts.down_proj_bias")


def _names(layer_id: int) -> dict:
    p = f"model.layers.{layer_id}.mlp."
    return {"router": p + "router.weight", "router_bias": p + "router.bias",
            "gate_up": p + "experts.gate_up_proj", "gate_up_bias": p + "experts.gate_up_proj_bias",
            "down": p + "experts.down_proj", "down_bias": p + "experts.down_proj_bias"}


def gpt_oss_moe_shapes(cfg, layer_id: int) -> dict:
    """On-disk shapes of one layer's router and stacked experts."""
    moe, h = cfg.moe, cfg.hidden_size
    e, inter = moe.num_experts, moe.intermediate_size
    n = _names(layer_id)
    return {n["router"]: (e, h), n["router_bias"]: (e,), n["gate_up"]: (e, h, 2 * inter),
            n["gate_up_bias"]: (e, 2 * inter), n["down"]: (e, inter, h), n["down_bias"]: (e, h)}


def engine_layout(name: str, tensor: paddle.Tensor) -> paddle.Tensor:
    """A stacked expert tensor in the engine's layout: gate_up `[E, 2I, h]` (gate rows, then up rows) and its
    bias `[E, 2I]` likewise; down `[E, h, I]`. Other tensors are returned as they are."""
    if name.endswith("mlp.experts.gate_up_proj"):
        return paddle.concat([tensor[:, :, 0::2], tensor[:, :, 1::2]], axis=2).transpose([0, 2, 1]).contiguous()
    if name.endswith("mlp.experts.gate_up_proj_bias"):
        return paddle.concat([tensor[:, 0::2], tensor[:, 1::2]], axis=1).contiguous()
    if name.endswith("mlp.experts.down_proj"):
        return tensor.transpose([0, 2, 1]).contiguous()
    return tensor


class GptOssMoEBlock:
    """One layer's router and experts (one rank: gpt-oss is refused under tensor parallelism)."""

    def __init__(self, cfg, layer_id: int, weights: dict):
        moe = cfg.moe
        self.top_k, self.inter = moe.top_k, moe.intermediate_size
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        n = _names(layer_id)
        self.router, self.router_bias = weights[n["router"]], weights[n["router_bias"]]
        # Per expert, views of the stacked tensors, taken once.
        self.gate_up = [weights[n["gate_up"]][e] for e in range(moe.num_experts)]
        self.gate_up_bias = [weights[n["gate_up_bias"]][e] for e in range(moe.num_experts)]
        self.down = [weights[n["down"]][e] for e in range(moe.num_experts)]
        self.down_bias = [weights[n["down_bias"]][e] for e in range(moe.num_experts)]

    def route(self, x: paddle.Tensor) -> tuple:
        """(expert ids [T, k] int64, combine weights [T, k] float32): the top-k router logits, softmaxed."""
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        logits = linear(x32, self.router.astype("float32")) + self.router_bias.astype("float32")
        top, ids = paddle.topk(logits, k=self.top_k, axis=-1)
        return ids, F.softmax(top, axis=-1)

    def _expert(self, x: paddle.Tensor, e: int) -> paddle.Tensor:
        gate_up = linear(x, self.gate_up[e]) + self.gate_up_bias[e]
        gate = paddle.clip(gate_up[:, :self.inter], max=self.limit)
        up = paddle.clip(gate_up[:, self.inter:], min=-self.limit, max=self.limit)
        return linear((up + 1) * (gate * F.sigmoid(gate * self.alpha)), self.down[e]) + self.down_bias[e]

    def __call__(self, x: paddle.Tensor, num_tokens: int) -> paddle.Tensor:
        """Feed-forward output for `x` [rows, h]; only the first `num_tokens` rows are real tokens."""
        rows, hidden = x.shape
        real = x[:num_tokens]
        ids, weights = self.route(real)
        flat = ids.numpy().reshape(-1)
        # Each (token, slot) pair's expert output lands in its own row, then the k slots are summed in slot
        # order: a token's result does not depend on which other tokens share its experts this step.
        picked = paddle.zeros([num_tokens * self.top_k, hidden], dtype=x.dtype)
        for expert in np.unique(flat):
            slots = np.nonzero(flat == expert)[0]
            ye = self._expert(paddle.gather(real, host_tensor(slots // self.top_k)), int(expert))
            picked = paddle.scatter(picked, host_tensor(slots), ye, overwrite=True)
        combine = weights if weights.dtype == x.dtype else weights.astype(x.dtype)
        out = (picked.reshape([num_tokens, self.top_k, hidden]) * combine.unsqueeze(-1)).sum(axis=1)
        if rows != num_tokens:  # callers may append rows that are not tokens
            out = paddle.concat([out, paddle.zeros([rows - num_tokens, hidden], dtype=out.dtype)], axis=0)
        return out
