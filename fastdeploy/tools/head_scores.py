"""Training-free scores of how much each (layer, KV head) needs full attention (high = keep full).

Two one-pass scorers, read by a probe on the dense reference backend (probed_attention.py) while
the engine runs calibration text with full attention everywhere; both look only at queries far
enough (t >= sink + window) for sliding to matter, and at the keys a sliding head would lose
(sink <= j <= t - window):

- `outside_mass`: the attention probability on those keys, averaged over the KV head's GQA group
  of query heads and over positions;
- `output_change`: the squared change of the layer's attention output (through o_proj) if this KV
  head alone slid, relative to the output's squared norm — DuoAttention's question, answered
  locally in one pass.

A third, `ablation_kl` (ablation_kl_scores), slides one (layer, head) at a time and measures the
KL of the model's next-token distribution: the most direct and the most expensive (one pass per pair).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F

ONE_PASS_SCORERS = ("outside_mass", "output_change")


class WindowProbe:
    """probe(backend, layer_id, qkv, meta) accumulating both one-pass scores."""

    def __init__(self, model, num_layers: int, num_kv_heads: int, window: int, sink: int):
        self.model, self.window, self.sink = model, window, sink
        self.sums = {name: np.zeros((num_layers, num_kv_heads)) for name in ONE_PASS_SCORERS}
        self.counts = np.zeros(num_layers)

    def scores(self) -> dict:
        return {name: s / np.maximum(self.counts, 1)[:, None] for name, s in self.sums.items()}

    def __call__(self, backend, layer_id, qkv, meta) -> None:
        nh, kvh, d = backend.num_heads, backend.kv_num_heads, backend.head_dim
        group = nh // kvh
        o_proj = self.model.weights[f"model.layers.{layer_id}.self_attn.o_proj.weight"].astype("float32")
        o_heads = o_proj.reshape([o_proj.shape[0], nh, d]).transpose([1, 2, 0])  # [nh, d, hidden]
        for start, n, q, keys, values in backend.request_tensors(layer_id, qkv, meta):
            first = max(start, self.sink + self.window)
            if first >= start + n:
                continue
            q_far = q[first - start:].transpose([1, 0, 2])                       # [nh, m, d]
            total = start + n
            t = np.arange(first, total)[:, None]
            j = np.arange(total)[None, :]
            causal = j <= t
            keep = causal & ((j < self.sink) | (j > t - self.window))
            lost = paddle.to_tensor((causal & ~keep).astype(np.float32))
            scores = paddle.matmul(q_far, keys.transpose([1, 2, 0])) / math.sqrt(d)  # [nh, m, total]
            neg = paddle.full_like(scores, float("-inf"))
            probs = F.softmax(paddle.where(paddle.to_tensor(causal), scores, neg), axis=-1)
            probs_swa = F.softmax(paddle.where(paddle.to_tensor(keep), scores, neg), axis=-1)
            mass = (probs * lost).sum(axis=-1)                                       # [nh, m]
            v = values.transpose([1, 0, 2])                                          # [nh, total, d]
            full_out = paddle.matmul(probs, v)
            change = paddle.matmul(full_out - paddle.matmul(probs_swa, v), o_heads)  # [nh, m, hidden]
            change = change.reshape([kvh, group, change.shape[1], change.shape[2]]).sum(axis=1)
            reference = (paddle.matmul(full_out, o_heads).sum(axis=0) ** 2).sum(axis=-1)  # [m]
            rel = (change ** 2).sum(axis=-1) / (reference + 1e-20)                   # [kvh, m]
            m = q_far.shape[1]
            self.sums["outside_mass"][layer_id] += mass.reshape([kvh, group, m]).mean(axis=1).sum(axis=-1).numpy()
            self.sums["output_change"][layer_id] += rel.sum(axis=-1).numpy()
            self.counts[layer_id] += m


def one_pass_scores(llm, segments: list, window: int, sink: int, log=print) -> dict:
    """Both one-pass scores ([num_layers, num_kv_heads] each) over the calibration segments."""
    from fastdeploy.tools.probed_attention import install
    from fastdeploy.tools.prompt_logits import prompt_logprobs

    cfg = llm.engine.model_config
    probe = WindowProbe(llm.engine.runner.model, cfg.num_hidden_layers, cfg.num_key_value_heads, window, sink)
    install(llm, np.zeros((cfg.num_hidden_layers, cfg.num_key_value_heads), bool), window, sink, probe)
    for i, seg in enumerate(segments):
        prompt_logprobs(llm, seg, lambda start, lp: None)
        log(f"[find_swa_heads] one-pass scores: segment {i + 1}/{len(segments)} ({len(seg)} tokens)")
    return probe.scores()


def ablation_kl_scores(llm, segments: list, window: int, sink: int, log=print) -> np.ndarray:
    """[num_layers, num_kv_heads]: mean KL(full || only this pair slides) at positions >= sink + window."""
    from fastdeploy.tools.probed_attention import install
    from fastdeploy.tools.prompt_logits import prompt_logprobs

    cfg = llm.engine.model_config
    num_layers, num_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    first = sink + window

    def run(mask) -> list:
        install(llm, mask, window, sink)
        out = []
        for seg in segments:
            rows = []
            prompt_logprobs(llm, seg, lambda start, lp: rows.append(lp[max(0, first - start):])
                            if start + lp.shape[0] > first else None)
            out.append(np.concatenate(rows))
        return out

    full = run(np.zeros((num_layers, num_kv), bool))
    scores = np.zeros((num_layers, num_kv))
    for layer in range(num_layers):
        for head in range(num_kv):
            mask = np.zeros((num_layers, num_kv), bool)
            mask[layer, head] = True
            kls = [kl_rows(f, c) for f, c in zip(full, run(mask))]
            scores[layer, head] = float(np.concatenate(kls).mean())
        log(f"[find_swa_heads] ablation KL: layer {layer + 1}/{num_layers} {np.round(scores[layer], 5).tolist()}")
    return scores


def kl_rows(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL(p || q) per row of two log-prob matrices (float64 sums)."""
    return (np.exp(p_log.astype(np.float64)) * (p_log.astype(np.float64) - q_log)).sum(axis=-1)
