"""GFLOP/s of the model's dense layers on the CPU: Paddle's matmul vs the packed kernel (a
layers/linear.py `Linear`, what the decoder runs) vs the same tiles packing the weight per call
(`linear()`) vs numpy, for SmolLM2-135M's shapes at several row counts, next to this machine's
float32 GEMM peak (2048^3 through numpy's BLAS) measured in the same run.

    python benchmarks/bench_linear_cpu.py [--rows 1 8 32 128 2048] [--seconds 0.3] [--json out.json]

numpy's BLAS is whatever numpy was built with (named below).

`--clock cpu` divides by the process's CPU time instead of wall time: on a machine shared with
other jobs it measures how much work each GEMM costs, whoever else runs (compare single-threaded
runs that way; a second thread's spin-waits count as CPU time).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import paddle

from fastdeploy.model_executor.layers.cpu_kernels import kernel_isas
from fastdeploy.model_executor.layers.linear import Linear, linear
from fastdeploy.worker.host_memory import keep_freed_host_memory

# (name, in, out) of SmolLM2-135M (hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152).
SHAPES = [
    ("q_proj", 576, 576),
    ("k/v_proj", 576, 192),
    ("qkv fused", 576, 960),
    ("o_proj", 576, 576),
    ("gate/up", 576, 1536),
    ("gate_up fused", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
]


CLOCK = time.perf_counter


def gflops(fn, flops: float, seconds: float) -> float:
    fn()  # warm-up: first-call packing, allocator
    n, start = 0, CLOCK()
    while True:
        fn()
        n += 1
        elapsed = CLOCK() - start
        if elapsed >= seconds and n >= 2:
            return flops * n / elapsed / 1e9


def numpy_blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        blas = [p for p in threadpool_info() if p.get("user_api") == "blas"]
        return ", ".join(f"{p['internal_api']} {p.get('version')} {p.get('architecture')} x{p['num_threads']}"
                         for p in blas) or "unknown"
    except ImportError:
        return "unknown (threadpoolctl not installed)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 2048])
    ap.add_argument("--seconds", type=float, default=0.3, help="timing window per cell")
    ap.add_argument("--shapes", nargs="*", help="only these shape names")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--json", help="also write the table here")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    keep_freed_host_memory()  # as a CPU worker runs (large outputs do not page-fault every call)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time

    rng = np.random.default_rng(0)
    peak_x = rng.standard_normal((2048, 2048)).astype(np.float32)
    peak = gflops(lambda: peak_x @ peak_x, 2 * 2048 ** 3, max(args.seconds, 1.0))
    tiles = kernel_isas()["dense"]
    print(f"dense-layer tiles: {tiles}; numpy BLAS: {numpy_blas()}")
    print(f"GEMM peak (2048^3 float32 through numpy's BLAS): {peak:.0f} GFLOP/s ({args.clock} clock)\n")
    print(f"{'shape':<14} {'[M, in] x [in, out]':<24} {'paddle':>8} {'packed':>8} {'unpacked':>9} {'numpy':>8} "
          f"{'packed/paddle':>14} {'packed/peak':>12}")
    rows = []
    for name, k, n in SHAPES:
        if args.shapes and name not in args.shapes:
            continue
        w = rng.standard_normal((n, k)).astype(np.float32)
        w_pd = paddle.to_tensor(w)
        packed = Linear([w_pd])
        w_np_t = np.ascontiguousarray(w.T)
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            x_pd = paddle.to_tensor(x)
            flops = 2.0 * m * k * n
            cell = {
                "shape": name, "m": m, "k": k, "n": n,
                "paddle": gflops(lambda: paddle.matmul(x_pd, w_pd, transpose_y=True), flops, args.seconds),
                "packed": gflops(lambda: packed(x_pd), flops, args.seconds),
                "unpacked": gflops(lambda: linear(x_pd, w_pd), flops, args.seconds),
                "numpy": gflops(lambda: x @ w_np_t, flops, args.seconds),
            }
            rows.append(cell)
            print(f"{name:<14} {f'[{m}, {k}] x [{k}, {n}]':<24} {cell['paddle']:>8.1f} {cell['packed']:>8.1f} "
                  f"{cell['unpacked']:>9.1f} {cell['numpy']:>8.1f} {cell['packed'] / cell['paddle']:>13.1f}x "
                  f"{cell['packed'] / peak:>11.0%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"clock": args.clock, "peak_gflops": peak, "tiles": tiles, "numpy_blas": numpy_blas(), "cells": rows}, f, indent=2)


if __name__ == "__main__":
    main()
