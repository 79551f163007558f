"""What a GPU would tell us about the CUDA AppendAttention kernels, without one: per kernel instantiation
and architecture, registers, spills, static + dynamic shared memory per block, and the theoretical
occupancy those allow on sm_80 and sm_90.

One nvcc build (tests/custom_ops/gpu_harness.cached_build: each .cu compiled once for sm_80 and sm_90
with --resource-usage, the PTX kept) gives ptxas's report (registers, spill bytes, static shared
memory) and each kernel's __launch_bounds__ (threads per block, the PTX's .maxntid). Dynamic shared
memory is a launch argument: it comes from the built library's append_attention_dynamic_smem_bytes(),
which returns the constants the launches pass. Occupancy follows the CUDA occupancy calculator's rules
(cuda_occupancy.h) with the per-SM limits in ARCH_LIMITS, the largest shared-memory carveout assumed.

    python tests/custom_ops/kernel_resources.py [--json resources.json] [--markdown]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/custom_ops: the harness
import gpu_harness  # noqa: E402

KB = 1024
# Per-SM and per-block limits of the two architectures the kernels are built for (CUDA programming
# guide, compute capability table; granularities as in cuda_occupancy.h for major 8 and 9).
ARCH_LIMITS = {
    "sm_80": dict(regs_per_sm=65536, regs_per_block=65536, max_regs_per_thread=255, max_threads_per_sm=2048,
                  max_blocks_per_sm=32, smem_per_sm=164 * KB, smem_per_block=163 * KB, static_smem_per_block=48 * KB,
                  reserved_smem_per_block=1 * KB, smem_granularity=128, reg_granularity=256, sub_partitions=4),
    "sm_90": dict(regs_per_sm=65536, regs_per_block=65536, max_regs_per_thread=255, max_threads_per_sm=2048,
                  max_blocks_per_sm=32, smem_per_sm=228 * KB, smem_per_block=227 * KB, static_smem_per_block=48 * KB,
                  reserved_smem_per_block=1 * KB, smem_granularity=128, reg_granularity=256, sub_partitions=4),
}
# The kernels' names -> AppendAttnKernel (append_attn_api.cuh), for their dynamic shared memory.
KERNEL_IDS = {"rope_write_cache_kernel": 0, "rope_write_quantized_kernel": 0, "prefill_tile_prefix_kernel": 1,
              "prefill_attention_kernel": 2, "decode_attention_kernel": 3, "decode_merge_kernel": 4,
              "stitch_heads_kernel": 5}
DECODE_PATH = ("decode_attention_kernel", "decode_merge_kernel")
# Shapes of real models (q heads, KV heads, head_dim) at which the shape-dependent dynamic shared memory
# (the quantized cache write stages a token's rows) is evaluated.
MODEL_SHAPES = {"Gemma-3-270M": (4, 1, 256), "Gemma-3-4B": (8, 4, 256), "SmolLM2-135M": (9, 3, 64),
                "ERNIE-4.5-21B-A3B": (20, 4, 128)}
# The attention kernels' lane codecs (<T, key codec, value codec, D, BS>) -> the lane's format
PAGE_FORMATS = {"FloatPages": gpu_harness.CACHE_FLOAT, "Int8Pair": gpu_harness.CACHE_INT8,
                "E4M3Pair": gpu_harness.CACHE_FP8_E4M3, "NibblePages": gpu_harness.CACHE_INT4}
# rope_write_quantized_kernel<T, KeyCode, ValueCode>: a Code type's name -> its lane's format
WRITE_CODES = {"signed char": gpu_harness.CACHE_INT8, "e4m3": gpu_harness.CACHE_FP8_E4M3,
               "Int4Pair": gpu_harness.CACHE_INT4}


def page_format(key_format: int, value_format: int) -> int:
    """AppendAttnCacheQuant of a (key lane, value lane) pair: the lanes' own format, or k8v4."""
    if key_format == value_format:
        return key_format
    assert (key_format, value_format) == (gpu_harness.CACHE_INT8, gpu_harness.CACHE_INT4), (key_format, value_format)
    return gpu_harness.CACHE_K8V4


def _lane_format(names: dict, arg: str) -> int:
    return next(v for k, v in names.items() if k in arg)


@dataclasses.dataclass
class KernelUsage:
    """ptxas's report of one kernel instantiation on one architecture."""

    source: str
    mangled: str
    arch: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    static_smem_bytes: int
    name: str = ""  # demangled
    threads: int = 0  # __launch_bounds__


_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_resource_usage(source: str, text: str) -> list[KernelUsage]:
    """The kernels of one nvcc --resource-usage report (ptxas prints entry, frame, then usage lines)."""
    found, current = [], None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = dict(source=source, mangled=m.group(1), arch=m.group(2))
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            found.append(KernelUsage(registers=int(m.group(1)), static_smem_bytes=int(smem.group(1)) if smem else 0,
                                     **current))
            current = None
    return found


def launch_bounds(ptx: str) -> dict[str, int]:
    """mangled kernel name -> threads of its .maxntid (from __launch_bounds__)."""
    bounds = {}
    for m in re.finditer(r"\.entry\s+(\S+)\s*\((.*?)\)\s*((?:\.\w+[^\n]*\n\s*)*)", ptx, re.S):
        nt = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", m.group(3))
        if nt:
            bounds[m.group(1)] = int(nt.group(1)) * int(nt.group(2)) * int(nt.group(3))
    return bounds


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if tool is None:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    short = [re.sub(r"append_attn::(\(anonymous namespace\)::)?", "", line).replace("(Args, int)", "(...)")
             for line in out.splitlines()]
    return dict(zip(names, short))


def occupancy(arch: str, registers: int, threads: int, smem_bytes: int) -> dict:
    """Blocks and warps per SM the limits allow for one kernel (cuda_occupancy.h's rules, max carveout)."""
    lim = ARCH_LIMITS[arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // lim["reg_granularity"]) * lim["reg_granularity"]
    sub = lim["sub_partitions"]
    assumed_per_block = regs_per_warp * (-(-warps // sub) * sub)  # the hardware's per-block check
    if registers > lim["max_regs_per_thread"] or assumed_per_block > lim["regs_per_block"]:
        by_regs = 0
    else:
        by_regs = (lim["regs_per_sm"] // sub // regs_per_warp) * sub // warps if regs_per_warp else 10**9
    smem_alloc = -(-(smem_bytes + lim["reserved_smem_per_block"]) // lim["smem_granularity"]) * lim["smem_granularity"]
    by_smem = 0 if smem_bytes > lim["smem_per_block"] else lim["smem_per_sm"] // smem_alloc
    by_threads = lim["max_threads_per_sm"] // (warps * 32)
    blocks = min(lim["max_blocks_per_sm"], by_threads, by_regs, by_smem)
    limits = (("blocks", lim["max_blocks_per_sm"]), ("threads", by_threads), ("registers", by_regs),
              ("shared memory", by_smem))
    limiter = " + ".join(name for name, n in limits if n == blocks)  # every limit that binds
    return dict(blocks_per_sm=blocks, warps_per_sm=blocks * warps,
                occupancy=blocks * warps / (lim["max_threads_per_sm"] // 32), limited_by=limiter)


def _template_args(name: str) -> list[str]:
    """Top-level template arguments of `kernel<A, B<C>, 128, 64>(...)`."""
    inner = name[name.index("<") + 1:name.rindex(">")] if "<" in name else ""
    args, depth, cur = [], 0, ""
    for ch in inner:
        depth += (ch == "<") - (ch == ">")
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [a for a in [*args, cur.strip()] if a]


def _dynamic_smem(lib, kernel: str, name: str) -> dict[str, int]:
    """{shape label: bytes} of the launch's dynamic shared memory for this instantiation."""
    args = _template_args(name)

    def ask(head_dim: int, block_size: int, cache_quant: int, num_heads: int, kv_heads: int) -> int:
        p = gpu_harness._Params(dtype=gpu_harness.BF16, token_num=1, bsz=1, num_heads=num_heads,
                                kv_num_heads=kv_heads, head_dim=head_dim, block_size=block_size, num_blocks=1,
                                max_blocks_per_seq=1, head_wise_table=1, max_position=1, visit_all_pages=0,
                                dual_pass=0, kv_slots=0, cache_quant=cache_quant)
        got = lib.append_attention_dynamic_smem_bytes(ctypes.byref(p), KERNEL_IDS[kernel])
        return int(got)

    if kernel == "prefill_attention_kernel":  # <T, KeyPages, ValuePages, D, BS>: the page format and D
        quant = page_format(_lane_format(PAGE_FORMATS, args[1]), _lane_format(PAGE_FORMATS, args[2]))
        return {"": ask(int(args[3]), int(args[4]), quant, 8, 1)}
    if kernel == "rope_write_quantized_kernel":  # <T, KeyCode, ValueCode>: depends on the model's heads
        quant = page_format(_lane_format(WRITE_CODES, args[1]), _lane_format(WRITE_CODES, args[2]))
        return {model: ask(d, 64, quant, nh, kvh) for model, (nh, kvh, d) in MODEL_SHAPES.items()}
    return {"": ask(128, 64, gpu_harness.CACHE_FLOAT, 8, 1)}  # the other kernels: 0 at every shape


def collect(jobs: int | None = None) -> dict:
    lib_path = gpu_harness.cached_build(jobs=jobs)
    build_dir = lib_path.parent
    lib = gpu_harness.bind(ctypes.CDLL(str(lib_path)), gpu_harness.C_ABI)
    usages, bounds = [], {}
    for src in gpu_harness.cuda_sources():
        if src.name == "harness.cu":  # the test harness's own fill kernels are not the op's
            continue
        usages += parse_resource_usage(src.name, (build_dir / f"{src.stem}.resource_usage.txt").read_text())
        for ptx in (build_dir / "keep").glob(f"{src.stem}.*.ptx"):
            bounds.update(launch_bounds(ptx.read_text()))
    names = demangle(sorted({u.mangled for u in usages}))
    rows = []
    for u in usages:
        u.name = names[u.mangled]
        u.threads = bounds.get(u.mangled, 0)
        if not u.threads:
            raise RuntimeError(f"{u.name}: no __launch_bounds__ in the PTX (its threads per block are unknown)")
        kernel = u.name.split("<")[0].split("(")[0].split()[-1]
        for shape, dyn in _dynamic_smem(lib, kernel, u.name).items():
            total = u.static_smem_bytes + dyn
            row = dict(dataclasses.asdict(u), kernel=kernel, shape=shape, dynamic_smem_bytes=dyn,
                       smem_per_block=total, smem_within_block_limit=total <= ARCH_LIMITS[u.arch]["smem_per_block"],
                       decode_path=kernel in DECODE_PATH)
            row.update(occupancy(u.arch, u.registers, u.threads, total))
            rows.append(row)
    rows.sort(key=lambda r: (r["arch"], r["source"], r["name"], r["shape"]))
    return dict(nvcc=_nvcc_version(), limits=ARCH_LIMITS, model_shapes=MODEL_SHAPES, kernels=rows)


def _nvcc_version() -> str:
    out = subprocess.run([gpu_harness.find_nvcc(), "--version"], capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1] if out.strip() else ""


def markdown(report: dict) -> str:
    """One row per bf16 instantiation (and model shape) with sm_80 / sm_90 side by side; the fp16 twins
    are summarised under the table (all rows are in --json)."""
    rows = {}
    for r in report["kernels"]:
        rows.setdefault((r["name"].split("(")[0], r["shape"]), {})[r["arch"]] = r
    lines = ["| kernel | shape | regs | spill st/ld B | smem static + dynamic B | threads | blocks/SM | warps/SM "
             "| limited by |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    twins = []
    for (name, shape), arch in rows.items():
        a, b = arch["sm_80"], arch["sm_90"]
        if "__half" in name:
            bf16 = rows.get((name.replace("__half", "__nv_bfloat16"), shape))
            if bf16:
                twins += [(abs(arch[x]["registers"] - bf16[x]["registers"]),
                           abs(arch[x]["blocks_per_sm"] - bf16[x]["blocks_per_sm"])) for x in arch]
                continue

        def both(key):
            return str(a[key]) if a[key] == b[key] else f"{a[key]} / {b[key]}"

        spill = f"{a['spill_store_bytes']}/{a['spill_load_bytes']}"
        if (b["spill_store_bytes"], b["spill_load_bytes"]) != (a["spill_store_bytes"], a["spill_load_bytes"]):
            spill += f" / {b['spill_store_bytes']}/{b['spill_load_bytes']}"
        short = name.replace("void ", "").replace("__nv_bfloat16", "bf16").replace("BytePages<signed char, Int8Pair>",
                                                                               "Int8Pages")
        short = short.replace("BytePages<unsigned char, E4M3Pair>", "E4M3Pages").replace("FloatPages<bf16>", "FloatPages")
        lines.append(f"| `{short}` | {shape or '-'} | {both('registers')} | {spill} | "
                     f"{a['static_smem_bytes']} + {a['dynamic_smem_bytes']} | {a['threads']} | {both('blocks_per_sm')} | "
                     f"{both('warps_per_sm')} | {both('limited_by')} |")
    regs, blocks = (max(t[i] for t in twins) if twins else 0 for i in (0, 1))
    note = (f"\n\nTwo values: sm_80 / sm_90. The fp16 twins of the float-page kernels differ from these by at most "
            f"{regs} registers and {blocks} blocks per SM (every row: --json).")
    return "\n".join(lines) + note


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--markdown", action="store_true", help="print a Markdown table instead of plain text")
    ap.add_argument("--jobs", type=int, default=None, help="parallel nvcc compiles (default: CPU count, at least 2)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if gpu_harness.find_nvcc() is None:
        print("nvcc not found: nothing to report (install the CUDA toolkit)")
        return 0
    report = collect(args.jobs)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        print(markdown(report))
    else:
        for r in report["kernels"]:
            print(f"{r['arch']} {r['name'].split('(')[0]:<90} {r['shape']:<18} regs {r['registers']:>3} "
                  f"spill {r['spill_store_bytes']}/{r['spill_load_bytes']} smem {r['static_smem_bytes']}+"
                  f"{r['dynamic_smem_bytes']} threads {r['threads']:>4} -> {r['blocks_per_sm']} blocks "
                  f"{r['warps_per_sm']} warps/SM ({r['limited_by']})")
    spills = [r for r in report["kernels"] if r["decode_path"] and r["spill_store_bytes"] + r["spill_load_bytes"]]
    over = [r for r in report["kernels"] if not r["smem_within_block_limit"]]
    print(f"{len(report['kernels'])} rows ({report['nvcc']}); decode-path kernels with spills: {len(spills)}; "
          f"over the per-block shared memory limit: {len(over)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
