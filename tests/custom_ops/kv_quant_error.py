"""Relative RMS error of quantized KV pages on a real model's own K/V, by the numpy page rule.

Prefills one prompt of docs prose into float32 pages of the real engine, reads every layer's K
(after RoPE) and V rows back, and applies tests/custom_ops/reference_kv_quant.py's rule to them: int8
and int4 (block_wise_int4), keys and values each with and without the Hadamard rotation, and, for
int4, the alternatives a different rule could take (a scale per 32 or 16 values; a 15-level codebook
at normal quantiles with the one scale). Where the page error comes from, without running the model
once per variant (docs/swa_quality.md, 4-bit KV pages).

    python tests/custom_ops/kv_quant_error.py --model smollm2-135m-instruct --tokens 2000
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/custom_ops: the numpy page rule
from reference_kv_quant import dequantize_rows, hadamard, quantize_rows  # noqa: E402

# 15 symmetric levels at the normal distribution's quantiles, the largest at 1 (absmax).
_NORMAL = np.array([NormalDist().inv_cdf((k + 0.5) / 15) for k in range(15)])
NORMAL_LEVELS = _NORMAL / _NORMAL.max()


def model_rows(model: str, tokens: int) -> dict:
    """{"K": rows, "V": rows} float64 [n, head_dim] of every layer and KV head for one prompt."""
    os.environ.update(FD_HEAD_WISE_KV_CACHE="0", FD_ATTENTION_BACKEND="APPEND_ATTN")
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.input.tokenizer_loader import load_tokenizer

    llm = LLM(model=model, max_model_len=tokens + 64, enable_prefix_caching=False)
    prose = "".join((REPO / "docs" / f"{n}.md").read_text() for n in ("memory_model", "swa_quality", "scheduler"))
    ids = load_tokenizer(llm.engine.model_config).encode(prose)[:tokens]
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    backend = llm.engine.runner.attn_backend
    out = {}
    for name, lanes in (("K", backend.lane_keys), ("V", backend.lane_values)):
        rows = np.concatenate([lane.numpy().reshape(-1, lane.shape[-1]) for lane in lanes]).astype(np.float64)
        out[name] = rows[np.abs(rows).sum(-1) > 0]  # the rows the prompt wrote
    llm.engine.close()
    return out


def rule(rows: np.ndarray, fmt: str, rotated: bool) -> np.ndarray:
    x = hadamard(rows) if rotated else rows
    codes, scales = quantize_rows(x.astype(np.float32), fmt)
    deq = dequantize_rows(codes, scales).astype(np.float64)
    return hadamard(deq) / rows.shape[-1] if rotated else deq


def int4_groups(x: np.ndarray, group: int) -> np.ndarray:
    g = x.reshape(x.shape[0], -1, group)
    s = np.abs(g).max(-1, keepdims=True) / 7
    s = np.where(s > 0, s, 1)
    return (np.clip(np.rint(g / s), -7, 7) * s).reshape(x.shape)


def int4_normal_levels(x: np.ndarray) -> np.ndarray:
    s = np.abs(x).max(-1, keepdims=True)
    s = np.where(s > 0, s, 1)
    return NORMAL_LEVELS[np.abs((x / s)[..., None] - NORMAL_LEVELS).argmin(-1)] * s


def relative_rms(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(((approx - exact) ** 2).sum() / (exact ** 2).sum()))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", type=int, default=2000, help="prompt tokens (docs prose)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = model_rows(args.model, args.tokens)
    print(f"{args.model}: {len(rows['K'])} K and V rows; relative RMS error of the pages' values")
    for name, x in rows.items():
        for fmt in ("int8", "block_wise_int4"):
            for rotated in (False, True):
                print(f"  {name} {fmt:<16} rotated={rotated!s:<5} {relative_rms(rule(x, fmt, rotated), x):.4f}")
        y = hadamard(x) if name == "K" else x  # the rule's rows (keys rotated)
        for label, approx in (("int4, a scale per 32 values", int4_groups(y, 32)),
                              ("int4, a scale per 16 values", int4_groups(y, 16)),
                              ("int4, 15 levels at normal quantiles", int4_normal_levels(y))):
            print(f"  {name} {label:<38} {relative_rms(approx, y):.4f}")


if __name__ == "__main__":
    main()
