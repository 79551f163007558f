"""A restart with the disk tier (--kvcache-storage-backend file): the first turn after it, against a cold start.

The workload is bench_prefix_tiers.py's multi-session chat. Turns 1..T-1 of every session run on an
engine with the host tier (--swap-space) and the disk tier in a fresh directory; the engine then closes
(a clean shutdown writes every cached page a hit can read to files). Turn T of every session then runs
on a new engine, in two arms:

- cold: a restart without the disk tier (an empty cache: every prompt is computed);
- disk: a restart with the same directory (the start-up rebuilds the prefix tree from the files, and
        turn T's hits read them back).

Per FD_HEAD_WISE_KV_CACHE value in --head-wise: the shutdown's write time, the files' bytes and bytes per
cached token (the tokens of the blocks restored), the start-up time of each arm (the disk arm's includes
reading the files' headers), turn T's prefix hit rate, TTFT p50/p99 and wall time, and whether both arms'
greedy tokens are equal (the exit status is 1 if any session differs).

    python benchmarks/bench_tier_restart.py --json docs/tiers_restart_smollm2.json
    python benchmarks/bench_tier_restart.py --model gemma3 --json docs/tiers_restart_gemma3.json
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

from ab_harness import log, print_table, write_json
from bench_prefix_tiers import MODELS, Chat, model_and_pool, run_turn
from bench_replicas import workload

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.models.named_models import NAMED_MODELS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=sorted(MODELS) + sorted(NAMED_MODELS))
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3, help="T: turns 1..T-1 before the restart, turn T after it")
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000, help="about this many tokens per system prompt")
    p.add_argument("--question-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool (default: bench_prefix_tiers')")
    p.add_argument("--swap-space", type=float, default=0.25, help="GiB of the host tier above the disk tier")
    p.add_argument("--head-wise", nargs="+", default=["0", "1"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dir", type=str, default=None, help="where the disk tier's files go (default: a temporary "
                                                           "directory, deleted at the end)")
    p.add_argument("--json", type=str, default=None)
    return p


def make_llm(args, model: str, head_wise: str, directory=None) -> tuple:
    """(engine, seconds to build it)."""
    os.environ.update(FD_ATTENTION_BACKEND="APPEND_ATTN", FD_HEAD_WISE_KV_CACHE=head_wise, FD_LOG_INTERVAL="0")
    tiers = {} if directory is None else {"swap_space": args.swap_space, "kvcache_storage_backend": "file",
                                          "kvcache_storage_path": directory}
    t0 = time.perf_counter()
    llm = LLM(model=model, block_size=args.block_size, max_model_len=args.max_model_len,
              max_num_seqs=args.concurrency, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=True, **tiers)
    return llm, time.perf_counter() - t0


def turn_row(llm: LLM, done: list, wall: float) -> dict:
    stats = llm.engine.get_stats()
    ttft = sorted(1e3 * d[0] for d in done)
    hit, query = stats["prefix_cache_hit_tokens_total"], stats["prefix_cache_query_tokens_total"]
    return {"requests": len(done), "hit_rate": hit / query if query else 0.0, "hit_tokens": hit,
            "query_tokens": query, "ttft_p50_ms": statistics.median(ttft),
            "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], "turn_wall_s": wall,
            "disk_loaded_pages": stats.get("disk_cache_loaded_pages_total", 0),
            "disk_restored_pages": stats.get("disk_cache_restored_pages", 0),
            "disk_load_s": stats.get("disk_cache_load_seconds_total", 0.0),
            "cached_blocks_at_start": None}


def files_bytes(directory: str) -> tuple:
    sizes = [e.stat().st_size for root, _, files in os.walk(directory) for e in os.scandir(root) if e.is_file()]
    return len(sizes), sum(sizes)


def close(llm: LLM) -> None:
    llm.engine.close()
    del llm
    gc.collect()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    model = model_and_pool(args)
    if args.turns < 2:
        raise SystemExit("--turns must be at least 2 (turns before the restart, and one after)")
    systems, sessions = workload(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, checks = [], []
    for head_wise in args.head_wise:
        directory = args.dir or tempfile.mkdtemp(prefix="fd-kv-restart-")
        log(f"== FD_HEAD_WISE_KV_CACHE={head_wise}: turns 1-{args.turns - 1} of {args.sessions} sessions, then a "
            f"clean shutdown into {directory}")
        llm, _ = make_llm(args, model, head_wise, directory)
        chat = Chat(llm.engine.tokenizer)
        prompts, answers = {}, {s: [] for s in range(len(sessions))}
        for turn in range(args.turns - 1):
            run_turn(llm.engine, chat, turn, systems, sessions, prompts, answers, args.concurrency, params)
        t0 = time.perf_counter()
        close(llm)
        persist_s = time.perf_counter() - t0
        files, nbytes = files_bytes(directory)
        log(f"  shutdown: {files} files, {nbytes / 2**20:.1f} MiB in {persist_s:.2f} s")

        turn_answers = {}
        for arm in ("cold", "disk"):
            llm, build_s = make_llm(args, model, head_wise, directory if arm == "disk" else None)
            blocks = llm.engine.get_stats()["prefix_cache_cached_blocks"]
            ans = {s: list(a) for s, a in answers.items()}
            t0 = time.perf_counter()
            done = run_turn(llm.engine, chat, args.turns - 1, systems, sessions, dict(prompts), ans,
                            args.concurrency, params)
            row = {"model": model, "head_wise": int(head_wise), "arm": arm, "startup_s": build_s,
                   **turn_row(llm, done, time.perf_counter() - t0)}
            row["cached_blocks_at_start"] = blocks
            if arm == "disk":
                row.update(shutdown_s=persist_s, files=files, file_bytes=nbytes,
                           file_bytes_per_cached_token=nbytes / (blocks * args.block_size) if blocks else 0.0)
            turn_answers[arm] = {s: a[-1] for s, a in ans.items()}
            rows.append(row)
            log(f"  {arm}: start-up {build_s:.2f} s, hit {row['hit_rate']:.1%}, TTFT p50 {row['ttft_p50_ms']:.0f} ms")
            close(llm)
        checks.append({"head_wise": int(head_wise), "sessions": len(sessions),
                       "differ": sum(turn_answers["cold"][s] != turn_answers["disk"][s] for s in turn_answers["cold"])})
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)

    print_table(rows, [("flag", "head_wise", "d"), ("arm", "arm", ""), ("start-up s", "startup_s", ".2f"),
                       ("blocks at start", "cached_blocks_at_start", "d"), ("hit rate", "hit_rate", ".1%"),
                       ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("p99 ms", "ttft_p99_ms", ".0f"),
                       ("turn s", "turn_wall_s", ".1f"), ("disk pages read", "disk_loaded_pages", "d")],
                title=f"turn {args.turns} after a restart: {model}, {args.sessions} sessions, pool "
                      f"{args.kv_cache_memory >> 20} MiB, host tier {args.swap_space} GiB")
    disk = [r for r in rows if r["arm"] == "disk"]
    print_table(disk, [("flag", "head_wise", "d"), ("shutdown s", "shutdown_s", ".2f"), ("files", "files", "d"),
                       ("MiB", lambda r: r["file_bytes"] / 2**20, ".1f"),
                       ("B/cached token", "file_bytes_per_cached_token", ".0f")], title="the disk tier's files")
    ratios = {}
    for head_wise in args.head_wise:
        by = {r["arm"]: r for r in rows if r["head_wise"] == int(head_wise)}
        ratios[head_wise] = {"ttft_p50_disk_over_cold": by["disk"]["ttft_p50_ms"] / by["cold"]["ttft_p50_ms"],
                             "turn_wall_disk_over_cold": by["disk"]["turn_wall_s"] / by["cold"]["turn_wall_s"]}
    on = next((r for r in disk if r["head_wise"] == 1), None)
    off = next((r for r in disk if r["head_wise"] == 0), None)
    if on and off and off["file_bytes_per_cached_token"]:
        ratios["file_bytes_per_cached_token_on_over_off"] = \
            on["file_bytes_per_cached_token"] / off["file_bytes_per_cached_token"]
    print("\nratios", ratios)
    for c in checks:
        print(f"greedy tokens, flag {c['head_wise']}, disk vs cold: {c['differ']} of {c['sessions']} sessions differ")
    write_json(args.json, {"argv": sys.argv[1:], "args": vars(args), "model": model, "rows": rows, "ratios": ratios,
                           "identical_tokens": checks})
    return 0 if all(c["differ"] == 0 for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
