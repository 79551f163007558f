"""ERNIE-4.5 MoE feed-forward block (`Ernie4_5_MoeForCausalLM`, the ERNIE-4.5-21B-A3B architecture).

Routing as PaddleFormers defines it for inference:
- layer `i` is MoE iff `(i + 1) % moe_layer_interval == 0` and
  `moe_layer_start_index <= i <= moe_layer_end_index`; the others keep the dense MLP;
- router logits in float32 (`mlp.gate.weight`, `[num_experts, hidden]`), softmax probabilities;
- experts are picked by top-k of `probs + moe_statics.e_score_correction_bias`, but weighted by the
  unbiased probabilities of the picked experts, renormalised to sum to one (floor `moe_norm_min`);
- shared experts (`moe_num_shared_experts` of them, stored as one MLP of that many times the
  expert width) see every token and are added unweighted; no token is ever dropped.

Every expert's weights stay separate, named as in the checkpoint
(`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`), so they can be sliced by name.
On CPU the tokens are grouped by expert: one GEMM per projection per active expert.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor.host_tensor import host_tensor
# Row-invariant GEMM (layers/linear.py): an expert's GEMM gives a token the same bits whichever
# other tokens share that expert this step (batch composition differs between memory modes).
from fastdeploy.model_executor.layers.linear import linear


def is_moe_layer(cfg, layer_id: int) -> bool:
    moe = getattr(cfg, "moe", None)
    if moe is None:
        return False
    return ((layer_id + 1) % moe.layer_interval == 0
            and moe.layer_start_index <= layer_id <= moe.layer_end_index)


def _prefix(layer_id: int) -> str:
    return f"model.layers.{layer_id}.mlp."


def expert_names(layer_id: int, expert: int) -> dict:
    p = f"{_prefix(layer_id)}experts.{expert}."
    return {k: f"{p}{k}_proj.weight" for k in ("gate", "up", "down")}


def shared_expert_names(layer_id: int) -> dict:
    p = f"{_prefix(layer_id)}shared_experts."
    return {k: f"{p}{k}_proj.weight" for k in ("gate", "up", "down")}


def moe_shapes(cfg, layer_id: int) -> dict:
    """On-disk shapes of one MoE layer's feed-forward parameters."""
    moe, h = cfg.moe, cfg.hidden_size
    p = _prefix(layer_id)
    shapes = {p + "gate.weight": (moe.num_experts, h)}
    if moe.use_correction_bias:
        shapes[p + "moe_statics.e_score_correction_bias"] = (1, moe.num_experts)
    for e in range(moe.num_experts):
        n = expert_names(layer_id, e)
        shapes.update({n["gate"]: (moe.intermediate_size, h), n["up"]: (moe.intermediate_size, h),
                       n["down"]: (h, moe.intermediate_size)})
    if moe.num_shared_experts:
        width = moe.intermediate_size * moe.num_shared_experts
        n = shared_expert_names(layer_id)
        shapes.update({n["gate"]: (width, h), n["up"]: (width, h), n["down"]: (h, width)})
    return shapes


class MoEBlock:
    """One layer's routed experts + shared experts. Weights are looked up by checkpoint name at each
    call, so a tensor replaced in the model's dict after loading (e.g. sliced for tensor
    parallelism) is the one used."""

    def __init__(self, cfg, layer_id: int, weights: dict):
        moe = cfg.moe
        self.top_k, self.norm_min = moe.top_k, moe.norm_min
        self.weights = weights
        p = _prefix(layer_id)
        self.router_name = p + "gate.weight"                                               # [E, h] float32
        self.bias_name = p + "moe_statics.e_score_correction_bias" if moe.use_correction_bias else None
        self.expert_names = [expert_names(layer_id, e) for e in range(moe.num_experts)]
        self.shared_names = shared_expert_names(layer_id) if moe.num_shared_experts else None

    def _mlp(self, x: paddle.Tensor, names: dict) -> paddle.Tensor:
        w = self.weights
        return linear(F.silu(linear(x, w[names["gate"]])) * linear(x, w[names["up"]]), w[names["down"]])

    def route(self, x: paddle.Tensor) -> tuple:
        """(expert ids [T, k] int64, combine weights [T, k] float32) for the tokens `x` [T, h]."""
        x32 = x if x.dtype == paddle.float32 else x.astype("float32")
        probs = F.softmax(linear(x32, self.weights[self.router_name]), axis=-1)  # [T, E]
        bias = None if self.bias_name is None else self.weights[self.bias_name].reshape([-1])
        scores = probs if bias is None else probs + bias
        _, ids = paddle.topk(scores, k=self.top_k, axis=-1)
        weights = paddle.take_along_axis(probs, ids, axis=-1)
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=self.norm_min)
        return ids, weights

    def __call__(self, x: paddle.Tensor, num_tokens: int) -> paddle.Tensor:
        """Feed-forward output for `x` [rows, h]; only the first `num_tokens` rows are real tokens."""
        rows, hidden = x.shape
        real = x[:num_tokens]
        ids, weights = self.route(real)
        ids_np = ids.numpy()
        # Each (token, slot) pair's expert output lands in its own row, then the k slots are summed
        # in slot order: the result does not depend on the order experts are visited.
        picked = paddle.zeros([num_tokens * self.top_k, hidden], dtype=x.dtype)
        flat = ids_np.reshape(-1)
        for expert in np.unique(flat):
            slots = np.nonzero(flat == expert)[0]
            tokens = slots // self.top_k
            xe = paddle.gather(real, host_tensor(tokens))
            ye = self._mlp(xe, self.expert_names[int(expert)])
            picked = paddle.scatter(picked, host_tensor(slots), ye, overwrite=True)
        combine = weights if weights.dtype == x.dtype else weights.astype(x.dtype)
        out = (picked.reshape([num_tokens, self.top_k, hidden]) * combine.unsqueeze(-1)).sum(axis=1)
        if rows != num_tokens:  # callers may append rows that are not tokens
            out = paddle.concat([out, paddle.zeros([rows - num_tokens, hidden], dtype=out.dtype)], axis=0)
        if self.shared_names is not None:
            out = out + self._mlp(x, self.shared_names)
        return out
