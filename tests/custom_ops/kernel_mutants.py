"""Planted kernel bugs, run through the CUDA-on-CPU executor: a copy of the kernel sources with one
edit, built (reusing the unchanged objects), and one case run in a child process (a bad read may
crash it). Used by test_append_attention_gpu.py and by hand:

    python tests/custom_ops/kernel_mutants.py        # every mutant against its case: caught or not
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str  # under custom_ops/gpu_ops/append_attn
    old: str  # must occur exactly once
    new: str
    case: str  # a name of CASES
    what: str


MUTANTS = {
    "window_edge_off_by_one": Mutant(
        "append_attn_common.cuh", "(!swa || k < sink || k > q - window)", "(!swa || k < sink || k >= q - window)",
        "mixed", "a sliding head sees one key more than its window"),
    "dead_entry_read": Mutant(
        "append_attn_common.cuh", "lb.win_begin = max(first_visible / block_size, lb.sink_end);",
        "lb.win_begin = max(first_visible / block_size - 1, lb.sink_end);",
        "mixed", "a sliding head visits the block before its window, which may be recycled (-1)"),
    "decode_window_edge_off_by_one": Mutant(
        "decode_attention.cu", "key_visible(pos, blk * BS + qk_key, swa, window, sink)",
        "key_visible(pos, blk * BS + qk_key, swa, window + 1, sink)",
        "decodes", "decode: a sliding head sees one key more than its window"),
    "skipped_visible_block": Mutant(
        "append_attn_common.cuh", "lb.count = lb.sink_end + (last + 1 - lb.win_begin);",
        "lb.count = lb.sink_end + (last - lb.win_begin);", "mixed", "the newest live block is not visited"),
    "swapped_kv_scales_decode": Mutant(
        "decode_attention.cu", "v_scale_s[tid] = tid < n_valid ? a.value_scales[base / D + tid] : 0.f;",
        "v_scale_s[tid] = tid < n_valid ? a.key_scales[base / D + tid] : 0.f;",
        "int8", "decode reads V codes with the K scales"),
    "missing_barrier_after_page_lookup": Mutant(
        "decode_attention.cu",
        "    if (tid == 0) page_base_s = page_offset(a, req, head, blk, dead_code);\n    __syncthreads();\n",
        "    if (tid == 0) page_base_s = page_offset(a, req, head, blk, dead_code);\n",
        "mixed", "decode threads may read the page base before thread 0 wrote it (a race)"),
    "missing_barrier_before_scores": Mutant(
        "prefill_attention.cu",
        "        v_scale_s[tid] = valid ? a.value_scales[row] : 0.f;\n      }\n    }\n    __syncthreads();\n",
        "        v_scale_s[tid] = valid ? a.value_scales[row] : 0.f;\n      }\n    }\n",
        "mixed", "prefill scores read K rows other threads have not loaded yet (a race)"),
    "int4_nibbles_swapped_on_write": Mutant(
        "rope_write_cache.cu",
        "fd_kvq::int4_pack(fd_kvq::int4_code(x[0], scales[h]), fd_kvq::int4_code(x[1], scales[h]))",
        "fd_kvq::int4_pack(fd_kvq::int4_code(x[1], scales[h]), fd_kvq::int4_code(x[0], scales[h]))",
        "int4", "the int4 cache write puts a row's odd element in the low nibble"),
    "k8v4_values_read_with_the_key_codec": Mutant(
        "decode_attention.cu", "const float2 v = PV::pair(v_reg[i], kQuantized ? v_scale_s[key] : 0.f);",
        "const float2 v = PK::pair(v_reg[i], kQuantized ? v_scale_s[key] : 0.f);",
        "k8v4", "decode reads k8v4's int4 value bytes as the keys' int8 codes"),
    "int4_codes_read_unsigned": Mutant(
        "append_attn_common.cuh", "float(static_cast<int32_t>(word << (28 - 4 * e)) >> 28)",
        "float((word << (28 - 4 * e)) >> 28)", "int4", "decode reads negative int4 codes as 9..15"),
    "per_head_window_ignored": Mutant(
        "append_attn_common.cuh", "  w.window = max(a.head_windows[head], 0);\n",
        "  w.window = max(a.head_windows[0], 0);\n",
        "per_head", "every KV head slides with head 0's window of head_windows, not its own"),
    "per_head_sink_ignored": Mutant(
        "append_attn_common.cuh", "  w.sink = max(a.head_windows[a.kv_num_heads + head], 0);\n",
        "  w.sink = max(a.head_windows[a.kv_num_heads], 0);\n",
        "per_head", "every KV head keeps head 0's sink of head_windows, not its own"),
    "prefill_masks_with_another_heads_window": Mutant(
        "prefill_attention.cu", "    head_window_s[1] = window;\n", "    head_window_s[1] = max(a.head_windows[0], 1);\n",
        "per_head", "prefill visits each head's own pages but masks its scores with head 0's window"),
}


def mixed_case(rng):
    """Prefill chunks, decodes and verification rows; a sliding head with sink, recycled pages."""
    from gpu_reference import build_case

    return build_case(rng, [(0, 40), (300, 1), (129, 1), (90, 17), (200, 4)], num_heads=8, kv_num_heads=2,
                      head_dim=64, block_size=16, window=48, sink=20, swa_heads=(0,))


def decodes_case(rng):
    """Decodes only, every head sliding with a short window: one key more or less is a large change."""
    from gpu_reference import build_case

    return build_case(rng, [(40, 1), (63, 1), (64, 1), (100, 1), (17, 1)], num_heads=8, kv_num_heads=2,
                      head_dim=64, block_size=16, window=4, sink=0, swa_heads=(0, 1))


def int8_case(rng):
    from gpu_reference import quantize_case

    return quantize_case(mixed_case(rng), "int8")


def int4_case(rng):
    from gpu_reference import quantize_case

    return quantize_case(mixed_case(rng), "block_wise_int4")


def k8v4_case(rng):
    from gpu_reference import quantize_case

    return quantize_case(mixed_case(rng), "k8v4")


def per_head_case(rng):
    """Per-head windows (head_windows [2, kv_num_heads]): a full head and three sliding types, each
    head's dead pages -1; another head's window or sink is what a kernel must not use."""
    from gpu_reference import MIXED_HEAD_WINDOWS, build_case

    return build_case(rng, [(0, 40), (300, 1), (129, 1), (90, 17), (200, 4)], num_heads=8, kv_num_heads=4,
                      head_dim=64, block_size=16, head_windows=MIXED_HEAD_WINDOWS)


CASES = {"mixed": mixed_case, "decodes": decodes_case, "int8": int8_case, "int4": int4_case, "k8v4": k8v4_case,
         "per_head": per_head_case}


def mutated_sources(root: Path, mutant: Mutant) -> Path:
    """A copy of the kernel folder (and the header it includes from cpu_ops) with the edit applied."""
    src = Path(root) / "custom_ops" / "gpu_ops" / "append_attn"
    shutil.copytree(gpu_harness.SOURCE_DIR, src)
    (src.parents[1] / "cpu_ops").mkdir(parents=True)
    shutil.copy(gpu_harness.SHARED_HEADER, src.parents[1] / "cpu_ops")
    path = src / mutant.file
    text = path.read_text()
    assert text.count(mutant.old) == 1, f"{mutant.file}: the mutated text must occur once"
    path.write_text(text.replace(mutant.old, mutant.new))
    return src


def build_mutant(root: Path, mutant: Mutant) -> Path:
    reuse = gpu_harness.cached_build(on_cpu=True).parent
    return gpu_harness.build_on_cpu(Path(root) / "build", source_dir=mutated_sources(root, mutant),
                                    reuse_from=reuse).library


def run_case_in_child(library: Path, case_name: str, seed: int, orders: str = "forward,reverse") -> dict:
    """Runs CASES[case_name] in a child process; returns its report, or {"crashed": returncode}."""
    proc = subprocess.run([sys.executable, __file__, "--child", str(library), case_name, str(seed), orders],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"crashed": proc.returncode, "stderr": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(library: str, case_name: str, seed: int, orders: str) -> dict:
    import numpy as np

    from gpu_reference import QUANT, build_case, reference  # noqa: F401

    rng = np.random.default_rng(seed)
    case = CASES[case_name](rng)
    quantized = case.params.get("cache_quant", 0) != 0
    # The reference of a quantized case is over the float values it was quantized from.
    float_case = CASES["mixed"](np.random.default_rng(seed)) if quantized else case
    ref, _, _ = reference(float_case)
    result = gpu_harness.Harness(library).run(case, orders=orders)
    report = {"status": result.status, "message": result.message, "races": result.races}
    if result.status == 0:
        got = gpu_harness.from_storage(result.out, gpu_harness.BF16).astype(np.float64).reshape(ref.shape)
        report["finite"] = bool(np.isfinite(got).all())
        report["error"] = float(np.linalg.norm(np.nan_to_num(got, nan=1e9) - ref) / np.linalg.norm(ref))
    return report


# the test file's bf16, int8, int4 and k8v4 tolerances
TOLERANCE = {"mixed": 1e-2, "decodes": 1e-2, "int8": 2.5e-2, "int4": 0.25, "k8v4": 0.2, "per_head": 1e-2}


def caught(report: dict, case_name: str) -> bool:
    """Whether the test file's checks would fail on this report."""
    return ("crashed" in report or report["status"] != 0 or bool(report["races"]) or not report["finite"]
            or report["error"] >= TOLERANCE[case_name])


def build_parser():
    import argparse

    parser = argparse.ArgumentParser(description="Plant each kernel bug in a copy of the CUDA sources, run its "
                                                 "case on the CUDA-on-CPU executor, say whether it is caught.")
    parser.add_argument("--only", action="append", choices=sorted(MUTANTS), help="this mutant only (repeatable)")
    parser.add_argument("--seed", type=int, default=1, help="the case's random seed")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    print("unmutated:", run_case_in_child(gpu_harness.cached_build(on_cpu=True), "mixed", args.seed))
    missed = 0
    for name in args.only or list(MUTANTS):
        mutant = MUTANTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            report = run_case_in_child(build_mutant(Path(tmp), mutant), mutant.case, args.seed)
        short = {k: (v[:160] if isinstance(v, str) else v) for k, v in report.items()}
        found = caught(report, mutant.case)
        missed += not found
        print(f"{name}: {'CAUGHT' if found else 'MISSED'} ({mutant.what}) {short}")
    return 1 if missed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # run_case_in_child's process
        print(json.dumps(_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))
        sys.exit(0)
    sys.exit(main())
