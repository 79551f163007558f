"""CUDA AppendAttention: 2-D (head-wise) table vs the upstream 1-D arms, in one call.

Builds the ctypes harness with nvcc, checks every arm against the float64 reference on a small
case, then times ERNIE-4.5-21B-A3B attention shapes (20 q heads, 4 KV heads, head_dim 128,
block 64; KV head 0 sliding-window with W = 4096 and 1024, sink 64):

  decode  batch 64 at context 16k (TBT per layer)   prefill  one 8k-token prompt (TTFT per layer)

Arms (recycling off, so every table addresses the same bytes):
  1-D dual pass     upstream: an all-SWA pass and an all-full pass, masked, stitched per head
  1-D masked        one pass over every page of [0, t], out-of-window scores masked
  2-D skip          one pass, each head walks its own table and skips pages outside its window
  1-D skip (ref)    the 2-D kernel path on the 1-D table: shows the gain is the skipping

Decode also reports achieved HBM bandwidth (K+V bytes the arm must read / time) against a
measured device-to-device copy. A last table times the 2-D decode over quantized pages
(--kv-cache-quant-type int8 / block_wise_fp8: 8-bit codes, block_wise_int4: 4-bit codes two per
byte, k8v4: int8 keys beside int4 values; each + a float32 scale per row) against bf16
pages, after checking them against the float64 reference. Without a GPU it builds (when nvcc
exists), says so, exits 0.

    python benchmarks/bench_append_attention_gpu.py [--json out.json] [--iters 20]
        [--page-formats int8 block_wise_fp8 block_wise_int4 k8v4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fastdeploy.cache_manager.head_wise import num_dead_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "custom_ops"))
import gpu_harness  # noqa: E402
from ab_harness import print_table  # noqa: E402
from gpu_harness import BF16, Case  # noqa: E402
from gpu_reference import QUANT, build_case, quantize_case, reference, relative_error, rotary_tables  # noqa: E402
from reference_attention import head_window_array  # noqa: E402

NUM_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 20, 4, 128, 64
SINK = 64
SWA_HEADS = (0,)
ARMS = {
    "1-D dual pass": dict(head_wise_table=0, visit_all_pages=1, dual_pass=1),
    "1-D masked": dict(head_wise_table=0, visit_all_pages=1, dual_pass=0),
    "2-D skip": dict(head_wise_table=1, visit_all_pages=0, dual_pass=0),
    "1-D skip (ref)": dict(head_wise_table=0, visit_all_pages=0, dual_pass=0),
}


def workload_case(bsz: int, cached: int, new: int, window: int, arm: dict) -> Case:
    """Metadata-only case (qkv and caches are generated on the device by the harness)."""
    need = -(-(cached + new) // BLOCK)
    blocks = np.arange(bsz * need, dtype=np.int32).reshape(bsz, need)
    if arm["head_wise_table"]:
        # recycling off: head h of block b is page b * H + h, the bytes the 1-D table addresses
        tables = (blocks[:, None, :] * KV_HEADS + np.arange(KV_HEADS)[None, :, None]).astype(np.int32)
    else:
        tables = blocks
    max_position = cached + new + 1
    cos, sin = rotary_tables(max_position, HEAD_DIM)
    head_windows = head_window_array(KV_HEADS, window, SINK, SWA_HEADS)  # [2, kv_heads]: the SWA heads' (W, S)
    this_time = np.full(bsz, new, dtype=np.int32)
    params = dict(
        dtype=BF16, token_num=bsz * new, bsz=bsz, num_heads=NUM_HEADS, kv_num_heads=KV_HEADS,
        head_dim=HEAD_DIM, block_size=BLOCK, num_blocks=bsz * need, max_blocks_per_seq=need,
        max_position=max_position, **arm,
    )
    return Case(
        params=params, qkv=None, key_cache=None, value_cache=None,
        seq_lens_encoder=np.where(cached == 0, this_time, 0).astype(np.int32),
        seq_lens_decoder=np.full(bsz, cached, dtype=np.int32),
        seq_lens_this_time=this_time,
        cu_seqlens_q=np.arange(bsz + 1, dtype=np.int32) * new,
        block_tables=tables, rotary_cos=cos, rotary_sin=sin, head_windows=head_windows, out=None,
    )


def decode_pages_read(pos: int, window: int, arm: dict) -> int:
    """KV pages one decode query reads over all heads (per K or V)."""
    all_pages = pos // BLOCK + 1
    if arm["visit_all_pages"]:
        return all_pages * KV_HEADS * (2 if arm["dual_pass"] else 1)
    # The query at `pos` sees what a future query sees after pos processed tokens (docs/retention_rule.md).
    swa_pages = all_pages - num_dead_blocks(pos, window, SINK, BLOCK)
    return len(SWA_HEADS) * swa_pages + (KV_HEADS - len(SWA_HEADS)) * all_pages


def check_arms(harness) -> dict[str, float]:
    """Every arm vs the float64 reference on a small mixed batch with these shapes."""
    errors = {}
    rng = np.random.default_rng(0)
    requests = [(0, 200), (700, 1), (300, 40), (1500, 1)]
    for name, arm in ARMS.items():
        head_wise = bool(arm["head_wise_table"])
        case = build_case(
            rng, requests, num_heads=NUM_HEADS, kv_num_heads=KV_HEADS, head_dim=HEAD_DIM,
            block_size=BLOCK, window=256, sink=SINK, swa_heads=SWA_HEADS,
            head_wise=head_wise, recycle=head_wise,
        ).with_params(visit_all_pages=arm["visit_all_pages"], dual_pass=arm["dual_pass"])
        result = harness.run(case)
        if result.status != 0:
            raise SystemExit(f"{name}: kernel failed: {result.message}")
        ref, _, _ = reference(case)
        errors[name] = relative_error(result.out, ref, BF16)
    return errors


def check_page_formats(harness, formats=tuple(QUANT)) -> dict[str, float]:
    """The 2-D arm over quantized pages vs the float64 reference over the original float values (the
    format's error: the CPU op measures int8 ~8e-3, e4m3 ~3.5e-2 on random normal K/V; int4 pages
    ~1.5e-1 on the kernel tests' random rows)."""
    errors = {}
    rng = np.random.default_rng(1)
    for fmt in formats:
        case = build_case(rng, [(0, 200), (700, 1), (300, 40), (1500, 1)], num_heads=NUM_HEADS,
                          kv_num_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK, window=256,
                          sink=SINK, swa_heads=SWA_HEADS)
        result = harness.run(quantize_case(case, fmt))
        if result.status != 0:
            raise SystemExit(f"{fmt} pages: kernel failed: {result.message}")
        ref, _, _ = reference(case)
        errors[fmt] = relative_error(result.out, ref, BF16)
    return errors


def page_format_rows(harness, window: int, iters: int, formats=tuple(QUANT)) -> list:
    """Decode b64 ctx16k, 2-D skip, over bf16 / int8 / e4m3 / int4 pages: time and the page bytes read."""
    rows, base = [], None
    w = dict(bsz=64, cached=16384, new=1)
    arm = ARMS["2-D skip"]
    for name, quant in (("bf16", gpu_harness.CACHE_FLOAT), *((f, QUANT[f]) for f in formats)):
        case = workload_case(w["bsz"], w["cached"], w["new"], window, arm).with_params(cache_quant=quant)
        res = harness.run(case, fill_on_device=True, warmup=3, iters=iters)
        if res.status != 0:
            raise SystemExit(f"{name} pages: failed: {res.message}")
        # a page row of K + V: each lane's codes (bf16: 2 bytes an element, 8-bit: 1, int4: half) and,
        # quantized, its scale; k8v4's lanes differ (int8 keys, int4 values)
        eight_bit, four_bit = HEAD_DIM + 4, HEAD_DIM // 2 + 4
        kv_row_bytes = {gpu_harness.CACHE_FLOAT: 2 * 2 * HEAD_DIM, gpu_harness.CACHE_INT4: 2 * four_bit,
                        gpu_harness.CACHE_K8V4: eight_bit + four_bit}.get(quant, 2 * eight_bit)
        kv_bytes = w["bsz"] * decode_pages_read(w["cached"], window, arm) * BLOCK * kv_row_bytes
        base = base or res.avg_ms
        rows.append(dict(pages=name, window=window, ms=round(res.avg_ms, 4), vs_bf16=round(res.avg_ms / base, 3),
                         kv_mb_read=round(kv_bytes / 2**20, 1), hbm_gbps=round(kv_bytes / (res.avg_ms * 1e-3) / 1e9, 1)))
    return rows


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown GPU"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown GPU"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--iters", type=int, default=20, help="timed decode launches per arm")
    parser.add_argument("--prefill-iters", type=int, default=5, help="timed prefill launches")
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 1024])
    parser.add_argument("--page-formats", nargs="+", choices=list(QUANT), default=list(QUANT),
                        help="quantized page formats (--kv-cache-quant-type names) checked and timed against "
                             "bf16 pages (default: all)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    report: dict = {"gpu": False}

    def finish(code: int = 0) -> int:
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return code

    if gpu_harness.find_nvcc() is None:
        print("nvcc not found: cannot build the CUDA harness; nothing to do")
        report["built"] = False
        return finish()
    t0 = time.perf_counter()
    library = gpu_harness.cached_build(jobs=os.cpu_count())
    report["build_seconds"] = round(time.perf_counter() - t0, 1)
    report["built"] = True
    print(f"harness built in {report['build_seconds']:.1f}s: {library}")
    harness = gpu_harness.Harness(library)
    if gpu_harness.driver_gpu_count() == 0 or harness.device_count() <= 0:
        print("no GPU visible: the kernels compiled; skipping correctness check and timings")
        return finish()
    report["gpu"] = True
    report["device"] = gpu_name()
    print(f"device: {report['device']}")

    errors = check_arms(harness)
    report["check_rel_error"] = errors
    print("check vs float64 reference (bf16, ||out-ref||/||ref||): " +
          ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    if max(errors.values()) >= 1e-2:
        print("FAILED: an arm disagrees with the reference; timings would be meaningless")
        return finish(1)

    copy_gbps = harness.copy_bandwidth_gbps(1 << 31, 10)
    report["copy_bandwidth_gbps"] = round(copy_gbps, 1)
    print(f"device copy bandwidth (read + write): {copy_gbps:.0f} GB/s")

    workloads = {
        "decode b64 ctx16k": dict(bsz=64, cached=16384, new=1, iters=args.iters, warmup=3),
        "prefill 8k": dict(bsz=1, cached=0, new=8192, iters=args.prefill_iters, warmup=1),
    }
    rows = []
    for window in args.windows:
        for wname, w in workloads.items():
            times = {}
            for arm_name, arm in ARMS.items():
                case = workload_case(w["bsz"], w["cached"], w["new"], window, arm)
                res = harness.run(case, fill_on_device=True, warmup=w["warmup"], iters=w["iters"])
                if res.status != 0:
                    print(f"{wname} W={window} {arm_name}: failed: {res.message}")
                    return finish(1)
                times[arm_name] = res.avg_ms
                row = dict(workload=wname, window=window, arm=arm_name, ms=round(res.avg_ms, 4))
                if w["new"] == 1:
                    kv_bytes = (w["bsz"] * decode_pages_read(w["cached"], window, arm)
                                * BLOCK * HEAD_DIM * 2 * 2)
                    row["hbm_gbps"] = round(kv_bytes / (res.avg_ms * 1e-3) / 1e9, 1)
                rows.append(row)
            base = times["2-D skip"]
            for row in rows[-len(ARMS):]:
                row["speedup_of_2d"] = round(times[row["arm"]] / base, 3)
    report["results"] = rows

    print_table(rows, [("workload", "workload", ""), ("W", "window", ""), ("arm", "arm", ""), ("ms", "ms", ".3f"),
                       ("2-D speed-up", "speedup_of_2d", ".2f"), ("HBM GB/s", lambda r: r.get("hbm_gbps", "-"), ""),
                       ("% copy", lambda r: f"{r['hbm_gbps'] / copy_gbps:.0%}" if "hbm_gbps" in r else "", "")])
    verdicts = []
    for row in rows:
        if row["arm"] in ("1-D dual pass", "1-D masked"):
            ok = row["speedup_of_2d"] >= 1.05
            verdicts.append(ok)
            print(f"2-D vs {row['arm']:<14} {row['workload']:<20} W={row['window']:<5}: "
                  f"{(row['speedup_of_2d'] - 1) * 100:+.1f}% {'(>= 5%: pass)' if ok else '(< 5%)'}")
    report["all_speedups_at_least_5pct"] = all(verdicts)

    quant_errors = check_page_formats(harness, args.page_formats)
    report["page_format_check_rel_error"] = quant_errors
    print("\nquantized pages vs float64 over the float values: " +
          ", ".join(f"{k} {v:.2e}" for k, v in quant_errors.items()))
    formats = page_format_rows(harness, args.windows[0], args.iters, args.page_formats)
    report["page_formats"] = formats
    print_table(formats, [("W", "window", ""), ("pages", "pages", ""), ("ms", "ms", ".3f"), ("x bf16", "vs_bf16", ".3f"),
                          ("MB read", "kv_mb_read", ".1f"), ("GB/s", "hbm_gbps", ".0f")],
                title="decode b64 ctx16k, 2-D skip, per page format")
    return finish()


if __name__ == "__main__":
    sys.exit(main())
