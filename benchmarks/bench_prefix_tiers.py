"""The prefix cache's host tier (--swap-space) on a real model: no tier vs a tier vs a pool for everything.

A multi-session chat (bench_replicas.workload: --system-prompts shared system prompts of about
--system-tokens tokens of Python's documentation prose, one question per turn), rendered with the
model's chat template: turn k's prompt is turn k-1's prompt token for token, its greedy answer, and the
template's next user turn with a new question. The sessions go round-robin, --concurrency at a time: turn
1 of every session, then turn 2 of every session..., so between two turns of a session the pool serves
all the others, and a pool of --kv-cache-memory bytes (about a quarter of the sessions' histories for
SmolLM2 with the defaults) has evicted most of a session's history by its next turn.

Arms, each one fresh offline engine in this process (FD_ATTENTION_BACKEND=APPEND_ATTN, FD_LOG_INTERVAL=0),
for every FD_HEAD_WISE_KV_CACHE value in --head-wise:

- none:    the pool alone;
- host:    the same pool and a host tier of --swap-space GiB: evicted pages a hit can still read are
           copied there and copied back on a hit (a copy under FD_TIER_LOAD_INLINE_MS, 10 ms, at admission; a
           longer one on the loader's thread while the request waits in the loading state);
- host-wait: the same, every copy on the loader's thread (FD_TIER_LOAD_INLINE_MS=0): what waiting costs;
- ceiling: no tier, a pool --ceiling-factor times as big (it keeps every session).

Per arm, over the measured run (stats deltas after a warm-up request no session shares): prefix hit
rate (hit / query tokens), the share of hit tokens the tier served (as the stats count it, and as the
pages copied back, in whole blocks' tokens), TTFT p50/p99 (first-token time minus
arrival, inside the engine loop), output tokens/s and requests/s; for the tier, what it holds at the end:
bytes, bytes per stored page and per cached token (the tokens of the trie blocks it holds any page of:
head-wise, stale sliding pages are not stored, so a block costs fewer bytes), and the copy-back time per
page and per load beside this machine's numpy copy speed (a 256 MiB array). The greedy tokens of `host`
must equal those of `none` and of `ceiling` at the same flag value (the count of sessions that differ is
printed; the exit status is 1 if any does). The arms host-int8 and host-int4 (only when --arms names them)
keep the tier's pages as int8 / int4 codes (--swap-space-dtype): their answers that differ from `none`'s
are the accuracy cost of the pages that went through the tier.

    python benchmarks/bench_prefix_tiers.py --json docs/tiers_smollm2.json
    python benchmarks/bench_prefix_tiers.py --sessions 8 --turns 2                  # quick
    python benchmarks/bench_prefix_tiers.py --model gemma3 --json docs/tiers_gemma3.json
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
from ab_harness import log, print_table, run_requests, write_json
from bench_replicas import workload

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.models.named_models import NAMED_MODELS, resolve

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m"}  # short names; NAMED_MODELS' work too
ARMS = ("none", "host", "host-wait", "ceiling")
COMPRESSED = ("host-int8", "host-int4")  # the host tier with --swap-space-dtype (not run unless --arms names them)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=sorted(MODELS) + sorted(NAMED_MODELS))
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000, help="about this many tokens per system prompt")
    p.add_argument("--question-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per turn (ignore_eos: always this many)")
    p.add_argument("--concurrency", type=int, default=4, help="sessions whose turns run at once (max_num_seqs)")
    p.add_argument("--seed", type=int, default=0, help="which prose and questions (a held-out run: another seed)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV pool of the none/host arms (default: SmolLM2 160 MiB, 227 blocks of 16 tokens "
                        "with the flag off: a quarter of the default workload's 905 blocks of history; Gemma 3 270m "
                        "120 MiB, 213 of its 853)")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of the host arm's tier")
    p.add_argument("--ceiling-factor", type=float, default=8.0, help="the ceiling arm's pool: this x --kv-cache-memory")
    p.add_argument("--head-wise", nargs="+", default=["0", "1"], help="FD_HEAD_WISE_KV_CACHE values to run")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS + COMPRESSED)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--copy-mib", type=int, default=256, help="the numpy copy measured beside the loads")
    p.add_argument("--json", type=str, default=None)
    return p


DEFAULT_POOL = {"smollm2-135m-instruct": 160 << 20, "gemma-3-270m": 120 << 20}


# -- the workload, in token ids ------------------------------------------------------------------------------
class Chat:
    """Token ids of a conversation that grows by whole turns: each prompt extends the last one exactly.

    The template's text between an answer and the next question's generation prompt is found by rendering
    a placeholder conversation (the text after the placeholder answer), so the answer's own ids are kept
    as generated and never re-tokenized (a template that puts text before the answer, as the plain
    transcript's "Assistant: " does, gets the answer right after its generation prompt, as generated)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def first(self, system: str, question: str) -> list:
        return self.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])

    def next(self, prompt: list, answer: list, question: str) -> list:
        render = self.tokenizer.apply_chat_template
        conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
        asked = render(conv, True)
        answered = render(conv + [{"role": "assistant", "content": "PLACEHOLDER"}], False)
        again = render(conv + [{"role": "assistant", "content": "PLACEHOLDER"}, {"role": "user", "content": question}],
                       True)
        end = answered.find("PLACEHOLDER", len(asked)) + len("PLACEHOLDER")
        if not (answered.startswith(asked) and end > len(asked) and again.startswith(answered)):
            raise SystemExit("the chat template does not render a conversation by appending turns")
        return prompt + list(answer) + self.tokenizer.encode(again[end:])


def run_turn(engine, chat: Chat, turn: int, systems, sessions, prompts: dict, answers: dict, concurrency: int,
             params) -> list:
    """Turn `turn` (0-based) of every session, `concurrency` sessions at a time; each session's prompt extends
    its last one (prompts, answers: session -> its last prompt, its answers so far; both updated). Returns
    (TTFT seconds, prompt tokens, output tokens) per request."""
    done = []
    for start in range(0, len(sessions), concurrency):
        wave = {}
        for s in range(start, min(start + concurrency, len(sessions))):
            index, questions = sessions[s]
            wave[f"s{s}-t{turn}"] = (chat.first(systems[index], questions[0]) if turn == 0 else
                                     chat.next(prompts[s], answers[s][-1], questions[turn]))
        got = run_requests(engine, wave, params)
        for (rid, prompt), out in zip(wave.items(), got["outputs"]):
            s = int(rid[1:].split("-")[0])
            prompts[s] = prompt
            answers[s].append(list(out.outputs.token_ids))
            done.append((out.metrics["first_token_time"] - out.metrics["arrival_time"], len(prompt),
                         len(out.outputs.token_ids)))
    return done


def drive(llm: LLM, args, systems, sessions, params) -> dict:
    """Every turn of every session, round-robin, --concurrency sessions at a time; stats deltas after a
    warm-up request."""
    engine, chat = llm.engine, Chat(llm.engine.tokenizer)
    warm = chat.first("You are a calculator.", " ".join(str(i * 7919 % 1000) for i in range(50)))
    run_requests(engine, {"warm-up": warm}, params)
    base = engine.get_stats()
    prompts, answers, ttft, out_tokens, prompt_tokens = {}, {s: [] for s in range(len(sessions))}, [], 0, 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        for first, n_prompt, n_out in run_turn(engine, chat, turn, systems, sessions, prompts, answers,
                                               args.concurrency, params):
            ttft.append(first)
            prompt_tokens += n_prompt
            out_tokens += n_out
        log(f"  turn {turn + 1}/{args.turns} done, {time.perf_counter() - t0:.0f} s")
    wall = time.perf_counter() - t0
    end = engine.get_stats()
    delta = {k: end[k] - base[k] for k in end if k.endswith("_total") and isinstance(end[k], (int, float))}
    hit, query = delta["prefix_cache_hit_tokens_total"], delta["prefix_cache_query_tokens_total"]
    ttft.sort()
    row = {
        "requests": len(ttft), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens, "wall_s": wall,
        "hit_rate": hit / query if query else 0.0, "hit_tokens": hit, "query_tokens": query,
        "host_hit_tokens": delta.get("prefix_cache_host_hit_tokens_total", 0),
        "ttft_p50_ms": 1e3 * statistics.median(ttft), "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "ttft_mean_ms": 1e3 * statistics.mean(ttft),
        "output_tok_s": out_tokens / wall, "requests_s": len(ttft) / wall,
        "evictions": delta.get("prefix_cache_evictions_total", 0), "preemptions": delta.get("num_preemptions_total", 0),
        "swa_pages_recycled": delta.get("swa_pages_recycled_total", 0),
        "kv_pages_total": end["kv_pages_total"], "kv_pages_per_block": end["kv_pages_per_block"],
        "prefix_cache_cached_pages": end["prefix_cache_cached_pages"],
        "prefix_cache_cached_blocks": end["prefix_cache_cached_blocks"],
    }
    row["host_hit_share"] = row["host_hit_tokens"] / hit if hit else 0.0
    if "host_cache_bytes" in end:
        row.update(host_tier_stats(llm, end, delta, args.block_size))
        row["host_loaded_share"] = row["host_loaded_tokens"] / hit if hit else 0.0
    return {"row": row, "answers": answers}


def host_tier_stats(llm: LLM, end: dict, delta: dict, block_size: int) -> dict:
    """What the tier holds at the end and what its copies cost over the run.

    Tokens the tier covers: the trie blocks it holds at least one page of, x block_size (head-wise it
    holds only some of a block's pages: stale sliding pages are never stored). The stats' own arithmetic,
    host_cache_pages x block_size / kv_pages_per_block, counts these in 1-D mode, where an entry is a
    whole block; head-wise, kv_pages_per_block is 1 (a table entry is one page of one layer's KV head),
    so it counts every page as a block: it is kept beside ("tokens_by_pages") but not used."""
    pages, nbytes = end["host_cache_pages"], end["host_cache_bytes"]
    tier = llm.engine.scheduler.kv_cache_manager.pages.prefix_cache.lower
    blocks = len({id(h[0]) for h in (tier.holder(e) for e in range(tier.num_entries)) if h is not None})
    slots = llm.engine.scheduler.kv_cache_manager.layout.num_slots  # pages of one block, as the stats count them
    loaded, loads = delta["host_cache_loaded_pages_total"], delta["host_cache_loads_total"]
    load_s = delta["host_cache_load_seconds_total"]
    per_page = nbytes / pages if pages else 0.0
    return {
        "host_cache_pages": pages, "host_cache_pages_total": end["host_cache_pages_total"],
        "host_cache_bytes": nbytes, "host_bytes_per_page": per_page, "host_blocks": blocks,
        "host_tokens": blocks * block_size, "host_tokens_by_pages": pages * block_size / end["kv_pages_per_block"],
        "host_block_fill": pages / (blocks * slots) if blocks else 0.0,
        "host_bytes_per_cached_token": nbytes / (blocks * block_size) if blocks else 0.0,
        "host_stored_pages": delta["host_cache_stored_pages_total"],
        "host_evicted_pages": delta["host_cache_evicted_pages_total"],
        "host_loaded_pages": loaded, "host_loads": loads, "host_load_s": load_s,
        "host_store_s": delta["host_cache_store_seconds_total"],
        "host_load_us_per_page": 1e6 * load_s / loaded if loaded else 0.0,
        "host_load_ms_per_load": 1e3 * load_s / loads if loads else 0.0,
        "host_load_gb_s": loaded * per_page / load_s / 1e9 if load_s else 0.0,
        # the pages copied back, as tokens of whole blocks: comparable across the flag, unlike
        # prefix_cache_host_hit_tokens_total, which counts a hit's tokens from its first block the pool
        # lacks any page of (head-wise: one missing page counts the whole rest of the hit)
        "host_loaded_tokens": loaded * block_size / slots,
    }


def copy_speed(mib: int) -> float:
    """GB/s of a numpy copy of `mib` MiB into an allocated array (best of 5)."""
    src = np.ones(mib << 20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages
    best = min(_timed_copy(dst, src) for _ in range(5))
    return src.nbytes / best / 1e9


def _timed_copy(dst, src) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def make_llm(args, model: str, head_wise: str, arm: str) -> LLM:
    os.environ.update(FD_ATTENTION_BACKEND="APPEND_ATTN", FD_HEAD_WISE_KV_CACHE=head_wise, FD_LOG_INTERVAL="0",
                      FD_TIER_LOAD_INLINE_MS="0" if arm == "host-wait" else os.environ.get("FD_TIER_LOAD_INLINE_MS", "10"))
    memory = int(args.kv_cache_memory * (args.ceiling_factor if arm == "ceiling" else 1))
    return LLM(model=model, block_size=args.block_size, max_model_len=args.max_model_len,
               max_num_seqs=args.concurrency, kv_cache_memory=memory, enable_prefix_caching=True,
               swap_space=args.swap_space if arm.startswith("host") else None,
               swap_space_dtype=arm.split("-")[1] if arm in COMPRESSED else None)


def differing(a: dict, b: dict) -> int:
    """Sessions whose answers (every turn's greedy tokens) differ."""
    return sum(a[s] != b[s] for s in a)


def model_and_pool(args) -> str:
    """The named model (installed, or a ValueError that says how to install it); fills in the default pool."""
    model = MODELS.get(args.model, args.model)
    resolve(model)
    if args.kv_cache_memory is None:
        args.kv_cache_memory = DEFAULT_POOL.get(model, 128 << 20)
    return model


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    model = model_and_pool(args)
    systems, sessions = workload(args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    gbs = copy_speed(args.copy_mib)
    log(f"{model}: {args.sessions} sessions x {args.turns} turns, {args.system_prompts} system prompts, pool "
        f"{args.kv_cache_memory >> 20} MiB, tier {args.swap_space} GiB; numpy copy {gbs:.1f} GB/s")
    rows, answers = [], {}
    for head_wise in args.head_wise:
        for arm in args.arms:
            log(f"== FD_HEAD_WISE_KV_CACHE={head_wise} {arm}")
            t0 = time.perf_counter()
            llm = make_llm(args, model, head_wise, arm)
            got = drive(llm, args, systems, sessions, params)
            llm.engine.close()
            del llm
            gc.collect()
            row = {"model": model, "head_wise": int(head_wise), "arm": arm,
                   "kv_cache_memory": int(args.kv_cache_memory * (args.ceiling_factor if arm == "ceiling" else 1)),
                   "swap_space_gib": args.swap_space if arm.startswith("host") else 0, **got["row"],
                   "numpy_copy_gb_s": copy_speed(args.copy_mib) if arm.startswith("host") else gbs}
            answers[head_wise, arm] = got["answers"]
            rows.append(row)
            log(f"  {arm}: hit {row['hit_rate']:.1%} (host {row['host_hit_share']:.1%}), TTFT p50 "
                f"{row['ttft_p50_ms']:.0f} ms, {row['output_tok_s']:.1f} out tok/s; arm {time.perf_counter() - t0:.0f} s")

    # greedy tokens: the tier must not change them
    checks = []
    for head_wise in args.head_wise:
        # (a compressed tier's pages are quantized on the way through: its count measures that cost)
        for a, b in (("host", "none"), ("host", "ceiling"), ("none", "ceiling"), ("host-wait", "none"), ("host-int8", "none"),
                     ("host-int4", "none")):
            if (head_wise, a) in answers and (head_wise, b) in answers:
                checks.append({"head_wise": int(head_wise), "arms": f"{a} vs {b}", "sessions": len(sessions),
                               "differ": differing(answers[head_wise, a], answers[head_wise, b]),
                               "turns_differ": sum(x != y for s in answers[head_wise, a]
                                                   for x, y in zip(answers[head_wise, a][s], answers[head_wise, b][s])),
                               "turns": sum(len(t) for t in answers[head_wise, a].values())})

    cols = [("flag", "head_wise", "d"), ("arm", "arm", ""), ("pool MiB", lambda r: r["kv_cache_memory"] / 2**20, ".0f"),
            ("hit rate", "hit_rate", ".1%"), ("host share", "host_hit_share", ".1%"),
            ("loaded share", lambda r: r.get("host_loaded_share", 0.0), ".1%"),
            ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("p99 ms", "ttft_p99_ms", ".0f"),
            ("out tok/s", "output_tok_s", ".1f"), ("req/s", "requests_s", ".2f"), ("evict", "evictions", "d"),
            ("wall s", "wall_s", ".0f")]
    print_table(rows, cols, title=f"prefix cache tiers: {model}, {args.sessions} sessions x {args.turns} turns, "
                                  f"{args.system_prompts} x ~{args.system_tokens}-token system prompts, "
                                  f"concurrency {args.concurrency}, block {args.block_size}")
    tier_rows = [r for r in rows if "host_cache_bytes" in r]
    if tier_rows:
        print_table(tier_rows, [
            ("flag", "head_wise", "d"), ("tier MiB", lambda r: r["host_cache_bytes"] / 2**20, ".1f"),
            ("pages", "host_cache_pages", "d"), ("B/page", "host_bytes_per_page", ".0f"),
            ("blocks", "host_blocks", "d"), ("fill", "host_block_fill", ".1%"),
            ("B/cached tok", "host_bytes_per_cached_token", ".0f"), ("stored", "host_stored_pages", "d"),
            ("loaded", "host_loaded_pages", "d"), ("loads", "host_loads", "d"),
            ("us/page", "host_load_us_per_page", ".2f"), ("ms/load", "host_load_ms_per_load", ".3f"),
            ("load GB/s", "host_load_gb_s", ".2f"), ("numpy GB/s", "numpy_copy_gb_s", ".2f")],
            title="host tier at the end of the run (pages as the stats count them: one KV head of a block in "
                  "1-D mode, one layer's KV head head-wise; fill: pages held / pages of the blocks held)")

    ratios = {}
    for head_wise in args.head_wise:
        by = {r["arm"]: r for r in rows if r["head_wise"] == int(head_wise)}
        out = {}
        if "host" in by and "none" in by:
            out["ttft_p50_host_over_none"] = by["host"]["ttft_p50_ms"] / by["none"]["ttft_p50_ms"]
            out["output_tok_s_host_over_none"] = by["host"]["output_tok_s"] / by["none"]["output_tok_s"]
        if "host" in by and "host-wait" in by:  # what waiting in the loading state for every copy costs
            out["ttft_p50_host_wait_over_host"] = by["host-wait"]["ttft_p50_ms"] / by["host"]["ttft_p50_ms"]
        if "host" in by and "ceiling" in by and by["ceiling"]["hit_rate"]:
            out["hit_rate_host_over_ceiling"] = by["host"]["hit_rate"] / by["ceiling"]["hit_rate"]
        if "none" in by and "ceiling" in by and by["ceiling"]["hit_rate"]:
            out["hit_rate_none_over_ceiling"] = by["none"]["hit_rate"] / by["ceiling"]["hit_rate"]
        ratios[head_wise] = out
    print("\nratios")
    for head_wise, out in ratios.items():
        print(f"  flag {head_wise}: " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))
    on = next((r for r in tier_rows if r["head_wise"] == 1), None)
    off = next((r for r in tier_rows if r["head_wise"] == 0), None)
    if on and off and off["host_bytes_per_cached_token"]:
        ratios["bytes_per_cached_token_on_over_off"] = \
            on["host_bytes_per_cached_token"] / off["host_bytes_per_cached_token"]
        print(f"  host tier bytes per cached token, flag on / off: "
              f"{on['host_bytes_per_cached_token']:.0f} / {off['host_bytes_per_cached_token']:.0f} = "
              f"{ratios['bytes_per_cached_token_on_over_off']:.3f}")
    print("\ngreedy tokens")
    for c in checks:
        print(f"  flag {c['head_wise']}, {c['arms']}: {c['differ']} of {c['sessions']} sessions differ "
              f"({c['turns_differ']} of {c['turns']} answers)")
    write_json(args.json, {"argv": sys.argv[1:], "args": vars(args), "model": model, "numpy_copy_gb_s": gbs,
                           "rows": rows, "ratios": ratios, "identical_tokens": checks})
    return 0 if all(c["differ"] == 0 for c in checks if not c["arms"].startswith("host-int")) else 1


if __name__ == "__main__":
    sys.exit(main())
