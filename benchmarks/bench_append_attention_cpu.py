"""Decode-step time of the CPU append_attention op: full heads vs SWA heads, 1-D masked vs head-wise.

For each context length every arm runs one decode step (one new token per
request) over the same cache:
  full           all KV heads full attention (1-D table)
  k SWA 1d-mask  k SWA heads, every page visited and out-of-window scores
                 masked (visit_all_pages=True), as upstream does with a 1-D table
  k SWA headwise k SWA heads, head-wise table whose dead pages (retention
                 rule, docs/retention_rule.md) are -1 and skipped
Reported: median time per step over --reps runs, and speed-up vs "full"; then one request
prefilling --prefill-lens tokens in one step (the tiled path), in ms and attention GFLOP/s.
The issue's target: all-SWA head-wise at 64k <= 0.1x the full arm.
A second table compares 1 vs 2 threads (FD_CPU_ATTN_NUM_THREADS). With --page-formats, a third
table times the full-attention decode step over pages of each format (float32, bfloat16, int8,
float8_e4m3fn, int4, k8v4: the quantized pages of --kv-cache-quant-type int8 / block_wise_fp8 /
block_wise_int4 / k8v4, int4 as codes two per uint8, k8v4 int8 keys beside int4 values), interleaved,
against the first format. With --score-mods, a table times the full decode step with learned sinks
(gpt-oss: a logit per q head in every softmax's denominator), soft-capping (Gemma 2: tanh on every score) and
both, interleaved, against neither.

    python benchmarks/bench_append_attention_cpu.py [--contexts 4096 16384 65536] [--json out.json]
    python benchmarks/bench_append_attention_cpu.py --batch 32 --contexts 2048 --num-heads 9 --kv-heads 3 \
        --head-dim 64 --page-formats float32 bfloat16 int8 int4 k8v4 --skip-arms --prefill-lens 4096  # SmolLM2's
    python benchmarks/bench_append_attention_cpu.py --batch 32 --contexts 2048 --num-heads 9 --kv-heads 3 \
        --head-dim 64 --score-mods --skip-arms --prefill-lens 2048  # the sink and soft-cap terms at SmolLM2's shapes
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np

import fastdeploy  # noqa: F401,I001  (before paddle: it filters Paddle's import-time ccache warning)
import paddle

from fastdeploy.cache_manager.head_wise import dead_block_range
from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import compile_flags, set_cpu_options

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ab_harness import log, median, print_table, take_turns, timed, write_json  # noqa: E402


# Page formats of --kv-cache-quant-type int8 / block_wise_fp8 / block_wise_int4 / k8v4 (cache dtypes, int4: uint8
# pairs); k8v4's lanes differ (LANES: key format, value format).
QUANTIZED = ("int8", "float8_e4m3fn", "int4", "k8v4")
LANES = {"k8v4": ("int8", "int4")}


def lane_formats(page_format: str) -> tuple:
    """(key lane format, value lane format) of a page format."""
    return LANES.get(page_format, (page_format, page_format))


def cache_shape_and_dtype(shape: list, page_format: str):
    """A lane's shape and paddle dtype for a page format (int4: head_dim / 2 bytes of code pairs)."""
    if page_format == "int4":
        return shape[:-1] + [shape[-1] // 2], "uint8"
    return shape, page_format


def random_int4_pairs(shape: list, seed: int) -> paddle.Tensor:
    """Bytes of two codes in -7..7 (what the op writes), even element in the low nibble."""
    codes = np.random.default_rng(seed).integers(-7, 8, size=shape[:-1] + [2 * shape[-1]])
    nibbles = codes & 0xF
    return paddle.to_tensor((nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8))


class DecodeStep:
    """One decode step of `batch` requests at `context` cached tokens, cache shared by all arms."""

    def __init__(self, args, context: int, page_dtype: str = None):
        self.args, self.context = args, context
        H, bs, D = args.kv_heads, args.block_size, args.head_dim
        self.blocks_per_req = math.ceil((context + 1) / bs)
        num_blocks = args.batch * self.blocks_per_req
        cache_shape = [num_blocks, H, bs, D]
        # Values only need to be finite and varied; the op's cost does not depend on them.
        page_dtype = page_dtype or args.dtype
        quantized = page_dtype in QUANTIZED

        def lane(fmt: str, seed: int) -> paddle.Tensor:
            if fmt == "int4":
                return random_int4_pairs(cache_shape_and_dtype(cache_shape, "int4")[0], seed)
            if fmt == "int8":
                return paddle.uniform(cache_shape, min=-100, max=100).astype("int8")
            return paddle.uniform(cache_shape, min=-1, max=1).astype(fmt)

        key_format, value_format = lane_formats(page_dtype)
        self.key_cache, self.value_cache = lane(key_format, 1), lane(value_format, 2)
        scales = (lambda: paddle.uniform(cache_shape[:3], min=0.01, max=0.02)) if quantized \
            else (lambda: paddle.zeros([1], "float32"))
        self.scales = dict(key_cache_scales=scales(), value_cache_scales=scales())
        self.table_1d = np.arange(num_blocks, dtype=np.int32).reshape(args.batch, self.blocks_per_req)
        i32 = lambda a: paddle.to_tensor(np.asarray(a, np.int32))  # noqa: E731
        b = args.batch
        self.lens = dict(
            seq_lens_encoder=i32(np.zeros(b)),
            seq_lens_decoder=i32(np.full(b, context)),
            seq_lens_this_time=i32(np.ones(b)),
            cu_seqlens_q=i32(np.arange(b + 1)),
        )
        inv_freq = 10000.0 ** (-np.arange(0, D, 2) / D)
        angle = np.arange(context + 1)[:, None] * inv_freq[None, :]
        self.cos = paddle.to_tensor(np.cos(angle).astype(np.float32))
        self.sin = paddle.to_tensor(np.sin(angle).astype(np.float32))
        self.qkv = paddle.uniform([b, (args.num_heads + 2 * H) * D], min=-1, max=1)

    def head_wise_table(self, head_windows: np.ndarray) -> np.ndarray:
        """Pages b*H + h of the 1-D blocks; dead blocks of SWA heads recycled to -1."""
        a, H = self.args, self.args.kv_heads
        table = self.table_1d[:, None, :] * H + np.arange(H, dtype=np.int32)[None, :, None]
        dead = dead_block_range(self.context, a.window, a.sink, a.block_size)
        table[:, head_windows[0] > 0, dead.start:dead.stop] = -1
        return np.ascontiguousarray(table)

    def arm(self, swa_heads: int, mode: str, mods: str = "none"):
        """A zero-argument callable running one step of this arm (with the score mods SCORE_MODS[mods])."""
        a = self.args
        windows = head_windows(a.kv_heads, swa_heads, a.window, a.sink)
        table = self.head_wise_table(windows) if mode == "headwise" else self.table_1d
        tensors = dict(
            qkv=self.qkv, key_cache=self.key_cache, value_cache=self.value_cache, **self.lens,
            block_tables=paddle.to_tensor(table), rotary_cos=self.cos, rotary_sin=self.sin,
            head_windows=paddle.to_tensor(windows), **self.scales,
        )
        attrs = dict(num_heads=a.num_heads, kv_num_heads=a.kv_heads, head_dim=a.head_dim,
                     visit_all_pages=mode == "1d-mask", **score_mods(a.num_heads, mods))
        return lambda: append_attention(**tensors, **attrs)


# Score mods: (learned sink logits, softcap). 50: Gemma 2's attention cap.
SCORE_MODS = {"none": (False, 0.0), "sinks": (True, 0.0), "softcap": (False, 50.0), "sinks+softcap": (True, 50.0)}


def score_mods(num_heads: int, mods: str) -> dict:
    """The op's attention_sinks / softcap arguments of SCORE_MODS[mods]."""
    sinks, softcap = SCORE_MODS[mods]
    logits = paddle.to_tensor(np.random.default_rng(3).normal(0, 1, num_heads).astype(np.float32)) if sinks else None
    return dict(attention_sinks=logits, softcap=softcap)


def head_windows(kv_heads: int, swa_heads: int, window: int, sink: int) -> np.ndarray:
    """The op's head_windows [2, kv_heads]: the first `swa_heads` KV heads slide with (window, sink), the
    others are full (window 0)."""
    rows = np.zeros((2, kv_heads), np.int32)
    rows[:, :swa_heads] = np.array([[window], [sink]], np.int32)
    return rows


def prefill_step(args, tokens: int, swa_heads: int, page_dtype: str = None, mods: str = "none"):
    """A zero-argument callable: one request prefilling `tokens` tokens in one step (the tiled path),
    its first `swa_heads` KV heads sliding; and the step's attention FLOPs (scores + weighted values
    over the keys each query sees)."""
    H, bs, D = args.kv_heads, args.block_size, args.head_dim
    page_dtype = page_dtype or args.dtype
    blocks = math.ceil(tokens / bs)
    shape = [blocks, H, bs, D]
    i32 = lambda a: paddle.to_tensor(np.asarray(a, np.int32))  # noqa: E731
    inv_freq = 10000.0 ** (-np.arange(0, D, 2) / D)
    angle = np.arange(tokens)[:, None] * inv_freq[None, :]
    key_lane, value_lane = (cache_shape_and_dtype(shape, fmt) for fmt in lane_formats(page_dtype))
    tensors = dict(
        qkv=paddle.uniform([tokens, (args.num_heads + 2 * H) * D], min=-1, max=1),
        key_cache=paddle.zeros(*key_lane), value_cache=paddle.zeros(*value_lane),
        key_cache_scales=paddle.zeros(shape[:3] if page_dtype in QUANTIZED else [1], "float32"),
        value_cache_scales=paddle.zeros(shape[:3] if page_dtype in QUANTIZED else [1], "float32"),
        seq_lens_encoder=i32([tokens]), seq_lens_decoder=i32([0]), seq_lens_this_time=i32([tokens]),
        cu_seqlens_q=i32([0, tokens]), block_tables=paddle.to_tensor(np.arange(blocks, dtype=np.int32)[None]),
        rotary_cos=paddle.to_tensor(np.cos(angle).astype(np.float32)),
        rotary_sin=paddle.to_tensor(np.sin(angle).astype(np.float32)),
        head_windows=paddle.to_tensor(head_windows(H, swa_heads, args.window, args.sink)))
    attrs = dict(num_heads=args.num_heads, kv_num_heads=H, head_dim=D, visit_all_pages=False,
                 **score_mods(args.num_heads, mods))
    seen = np.arange(1, tokens + 1)
    keys = sum(np.minimum(seen, args.window + args.sink).sum() if h < swa_heads else seen.sum() for h in range(H))
    flops = 4.0 * keys * (args.num_heads // H) * D
    return (lambda: append_attention(**tensors, **attrs)), flops


def time_arms(fns: dict, reps: int) -> dict:
    """{name: (median, best)} wall ms. Arms take turns within every rep (ab_harness.py), so load from
    other processes on a shared machine spreads evenly over all arms."""
    for fn in fns.values():
        fn()  # warm-up: page faults, allocator
    got = take_turns(fns, reps, lambda name: timed(fns[name]) * 1e3)
    return {name: (median(v), min(v)) for name, v in got.items()}


def page_format_rows(args, ctx: int) -> list:
    """The full decode step (1-D table) over the same geometry in each --page-formats format, timed
    interleaved; the bytes of its K/V pages (scales included) next to the time."""
    steps = {fmt: DecodeStep(args, ctx, fmt) for fmt in args.page_formats}
    times = time_arms({fmt: step.arm(0, "1d") for fmt, step in steps.items()}, args.reps)
    first = times[args.page_formats[0]][0]
    rows = []
    for fmt, step in steps.items():
        kv = sum(math.prod(t.shape) * t.element_size() for t in (step.key_cache, step.value_cache))
        kv += sum(math.prod(t.shape) * 4 for t in step.scales.values()) if fmt in QUANTIZED else 0
        ms, best = times[fmt]
        rows.append(dict(context=ctx, page_format=fmt, ms=ms, best_ms=best, kv_mb=kv / 2**20, vs_first=ms / first))
    return rows


def score_mod_rows(args, ctx: int) -> list:
    """The full decode step (1-D table) with each of SCORE_MODS, timed interleaved, against none."""
    step = DecodeStep(args, ctx)
    times = time_arms({mods: step.arm(0, "1d", mods) for mods in SCORE_MODS}, args.reps)
    return [dict(context=ctx, mods=mods, ms=ms, best_ms=best, vs_none=ms / times["none"][0])
            for mods, (ms, best) in times.items()]


def prefill_rows(args, arms_: dict) -> list:
    """One request prefilling each of --prefill-lens tokens in one step, per arm (name -> (swa_heads, page
    format[, score mods])), interleaved; time against the first arm and attention GFLOP/s."""
    rows = []
    for tokens in args.prefill_lens:
        steps = {name: prefill_step(args, tokens, *spec) for name, spec in arms_.items()}
        times = time_arms({name: fn for name, (fn, _) in steps.items()}, args.reps)
        first = next(iter(times.values()))[0]
        rows += [dict(tokens=tokens, arm=name, ms=times[name][0], vs_first=times[name][0] / first,
                      gflops=flops / (times[name][0] / 1e3) / 1e9) for name, (_, flops) in steps.items()]
    return rows


def decode_rows(args, ctx: int) -> tuple:
    """Every arm's decode step at one context, and the 1 vs 2 thread rows of the full and all-SWA arms."""
    log(f"context {ctx}: allocating the cache ({args.batch} requests, {args.dtype})")
    step = DecodeStep(args, ctx)
    specs = list(arms(args.kv_heads))
    times = time_arms({name: step.arm(k, mode) for name, k, mode in specs}, args.reps)
    full_ms = times["full"][0]
    rows = [dict(context=ctx, arm=name, swa_heads=k, mode=mode, threads=args.threads, ms=times[name][0],
                 best_ms=times[name][1], vs_full=times[name][0] / full_ms, speedup=full_ms / times[name][0])
            for name, k, mode in specs]
    thread_rows = []
    for name, k, mode in [("full", 0, "1d"), (f"{args.kv_heads} SWA headwise", args.kv_heads, "headwise")]:
        fn = step.arm(k, mode)
        per = time_arms({n: lambda n=n: (set_cpu_options(attn_threads=n), fn()) for n in (1, 2)}, args.reps)
        set_cpu_options(attn_threads=args.threads)
        thread_rows.append(dict(context=ctx, arm=name, ms_1_thread=per[1][0], ms_2_threads=per[2][0],
                                scaling=per[1][0] / per[2][0]))
    return rows, thread_rows


def arms(kv_heads: int):
    yield "full", 0, "1d"
    for k in sorted({1, min(2, kv_heads), kv_heads}):
        for mode in ("1d-mask", "headwise"):
            yield f"{k} SWA {mode}", k, mode


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=20, help="q heads (ERNIE-4.5-21B-A3B: 20)")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="cache dtype")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="threads for the main table")
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[2048],
                   help="also time one request prefilling this many tokens in one step")
    p.add_argument("--page-formats", nargs="*", default=[],
                   choices=["float32", "bfloat16", "int8", "float8_e4m3fn", "int4", "k8v4"],
                   help="also time the full decode step over pages of each format (vs the first one)")
    p.add_argument("--score-mods", action="store_true",
                   help="also time the full decode step with learned sinks, soft-capping and both (vs neither)")
    p.add_argument("--skip-arms", action="store_true", help="only the --page-formats / --score-mods tables (and prefill)")
    p.add_argument("--json", metavar="PATH")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    set_cpu_options(attn_threads=args.threads)
    log(f"compile flags: {' '.join(compile_flags())}")
    out = {"config": vars(args), "compile_flags": compile_flags()}
    shape = (f"batch {args.batch}, q heads {args.num_heads}, kv heads {args.kv_heads}, head_dim {args.head_dim}, "
             f"block {args.block_size}, {args.threads} threads, median of {args.reps} (arms interleaved in every rep)")
    if args.page_formats:
        out["page_formats"] = [r for ctx in args.contexts for r in page_format_rows(args, ctx)]
        print_table(out["page_formats"], [("context", "context", ""), ("pages", "page_format", ""),
                                          ("ms/step", "ms", ".2f"), ("best", "best_ms", ".2f"), ("KV MB", "kv_mb", ".1f"),
                                          (f"x {args.page_formats[0]}", "vs_first", ".3f")],
                    title=f"decode step over each page format, full attention: {shape}")
        out["prefill_page_formats"] = prefill_rows(args, {fmt: (0, fmt) for fmt in args.page_formats})
        print_table(out["prefill_page_formats"], [("tokens", "tokens", ""), ("pages", "arm", ""),
                                                  ("ms/step", "ms", ".2f"), (f"x {args.page_formats[0]}", "vs_first", ".3f")],
                    title="one request prefilling in one step over each page format (full attention, tiled path)")
    if args.score_mods:
        out["score_mods"] = [r for ctx in args.contexts for r in score_mod_rows(args, ctx)]
        print_table(out["score_mods"], [("context", "context", ""), ("score mods", "mods", ""), ("ms/step", "ms", ".3f"),
                                        ("best", "best_ms", ".3f"), ("x none", "vs_none", ".3f")],
                    title=f"decode step with learned sinks / soft-capping (cap 50), full attention: {shape}")
        out["prefill_score_mods"] = prefill_rows(args, {mods: (0, None, mods) for mods in SCORE_MODS})
        print_table(out["prefill_score_mods"], [("tokens", "tokens", ""), ("score mods", "arm", ""),
                                                ("ms/step", "ms", ".2f"), ("x none", "vs_first", ".3f")],
                    title="one request prefilling in one step with each score mod (full attention, tiled path)")
    if not args.skip_arms:
        got = [decode_rows(args, ctx) for ctx in args.contexts]
        out["steps"], out["threads"] = [r for rows, _ in got for r in rows], [r for _, rows in got for r in rows]
        print_table(out["steps"], [("context", "context", ""), ("arm", "arm", ""), ("ms/step", "ms", ".2f"),
                                   ("best", "best_ms", ".2f"), ("x full", "vs_full", ".3f"), ("speed-up", "speedup", ".1f")],
                    title=f"append_attention CPU decode step: {shape}; W={args.window}, S={args.sink}, cache {args.dtype}")
        print_table(out["threads"], [("context", "context", ""), ("arm", "arm", ""), ("1 thread", "ms_1_thread", ".2f"),
                                     ("2 threads", "ms_2_threads", ".2f"), ("scaling", "scaling", ".2f")])
        out["prefill"] = prefill_rows(args, {"full": (0, None), f"{args.kv_heads} SWA": (args.kv_heads, None)})
        print_table(out["prefill"], [("tokens", "tokens", ""), ("arm", "arm", ""), ("ms/step", "ms", ".2f"),
                                     ("GFLOP/s", "gflops", ".1f")], title="one request prefilling in one step (tiled path)")
        last = max(args.contexts)
        target = next(r for r in out["steps"] if r["context"] == last and r["mode"] == "headwise"
                      and r["swa_heads"] == args.kv_heads)
        out.update(target_ratio=target["vs_full"], target_met=target["vs_full"] <= 0.1)
        print(f"\ntarget (all-SWA head-wise at {last} <= 0.1x full): {target['vs_full']:.3f}x -> "
              f"{'met' if out['target_met'] else 'NOT met'}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
