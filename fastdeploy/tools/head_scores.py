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

ONE_PASS_SCORERS = ("outside_mass", "output_change")


class WindowProbe:
    """probe(backend, layer_id, qkv, meta) accumulating both one-pass scores for each window of
    `windows`, all over the same queries (t >= sink + the largest window), so that the scores of one
    head under different windows compare (the window menu, window_menu.py). `scored_from`, where set (one
    request at a time), scores only the queries from that position on: the question and answer of a
    retrieval prompt, where sliding decides whether the needle is still seen."""

    def __init__(self, model, num_layers: int, num_kv_heads: int, windows, sink: int):
        self.model, self.windows, self.sink = model, tuple(int(w) for w in windows), sink
        self.sums = {w: {name: np.zeros((num_layers, num_kv_heads)) for name in ONE_PASS_SCORERS}
                     for w in self.windows}
        self.counts = np.zeros(num_layers)
        self.scored_from = 0

    def scores(self) -> dict:
        """{window: {scorer: [num_layers, num_kv_heads]}}."""
        return {w: {name: s / np.maximum(self.counts, 1)[:, None] for name, s in sums.items()}
                for w, sums in self.sums.items()}

    def __call__(self, backend, layer_id, qkv, meta) -> None:
        # numpy, float32: Paddle's CPU softmax over long rows is several times slower than this
        nh, kvh, d = backend.num_heads, backend.kv_num_heads, backend.head_dim
        group = nh // kvh
        o_proj = self.model.weights[f"model.layers.{layer_id}.self_attn.o_proj.weight"].astype("float32").numpy()
        o_heads = o_proj.reshape(o_proj.shape[0], nh, d).transpose(1, 2, 0)            # [nh, d, hidden]
        for start, n, q, keys, values in backend.request_tensors(layer_id, qkv, meta):
            first = max(start, self.sink + max(self.windows), self.scored_from)
            if first >= start + n:
                continue
            q_far = q[first - start:].numpy().transpose(1, 0, 2)                      # [nh, m, d]
            k, v = keys.numpy().transpose(1, 2, 0), values.numpy().transpose(1, 0, 2)  # [nh, d, L], [nh, L, d]
            total = start + n
            t = np.arange(first, total)[:, None]
            j = np.arange(total)[None, :]
            causal = j <= t
            scores = np.matmul(q_far, k) / np.float32(math.sqrt(d))                  # [nh, m, L]
            probs = _softmax(np.where(causal, scores, -np.inf))
            full_out = np.matmul(probs, v)
            m = q_far.shape[1]
            reference = (np.matmul(full_out, o_heads).sum(axis=0) ** 2).sum(axis=-1)  # [m]
            for window in self.windows:
                keep = causal & ((j < self.sink) | (j > t - window))
                probs_swa = _softmax(np.where(keep, scores, -np.inf))
                mass = np.where(causal & ~keep, probs, 0).sum(axis=-1)                # [nh, m]
                change = np.matmul(full_out - np.matmul(probs_swa, v), o_heads)       # [nh, m, hidden]
                change = change.reshape(kvh, group, m, -1).sum(axis=1)
                rel = (change ** 2).sum(axis=-1) / (reference + 1e-20)                # [kvh, m]
                sums = self.sums[window]
                sums["outside_mass"][layer_id] += mass.reshape(kvh, group, m).mean(axis=1).sum(axis=-1)
                sums["output_change"][layer_id] += rel.sum(axis=-1)
            self.counts[layer_id] += m


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def one_pass_scores(llm, segments: list, window: int, sink: int, log=print) -> dict:
    """Both one-pass scores ([num_layers, num_kv_heads] each) over the calibration segments."""
    return one_pass_scores_by_window(llm, segments, (window,), sink, log)[window]


def one_pass_scores_by_window(llm, segments: list, windows, sink: int, log=print, last_queries: int = 0) -> dict:
    """{window: both one-pass scores} over the calibration segments, in one pass, on common queries (with
    `last_queries`, only each segment's last that many: retrieval prompts' question and answer)."""
    from fastdeploy.engine.request import SamplingParams
    from fastdeploy.tools.probed_attention import install

    cfg = llm.engine.model_config
    probe = WindowProbe(llm.engine.runner.model, cfg.num_hidden_layers, cfg.num_key_value_heads, windows, sink)
    install(llm, np.zeros((cfg.num_hidden_layers, cfg.num_key_value_heads), bool), max(windows), sink, probe)
    for i, seg in enumerate(segments):
        probe.scored_from = len(seg) - last_queries if last_queries else 0
        llm.generate([list(seg)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        if (i + 1) % max(1, len(segments) // 8) == 0 or i + 1 == len(segments):
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
