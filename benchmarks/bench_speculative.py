"""Speculative decoding A/B: the same model with and without n-gram drafts, in one process, interleaved.

Two engines stay loaded side by side (speculation off / on) and every measurement alternates
between them, prompt by prompt, with the order flipped each round, so a machine shared with other
work slows both arms alike. Prints medians and the per-round ratios:

- one stream, copy-heavy tasks (the answer repeats text of the prompt: a paragraph repeated, a
  list reformatted, sentences extracted, code returned with a change) and open chat: output tok/s
  over the request (prefill included) and decode tok/s (first token to last), drafts' acceptance
  rate and the tokens a verification step yields on average;
- N requests at once (copy-heavy and chat prompts mixed): output tok/s of the batch.

Greedy tokens must be identical in both arms (checked; the exit code is 1 otherwise).

    python benchmarks/bench_speculative.py --model smollm2-135m-instruct --json /tmp/spec.json
    python benchmarks/bench_speculative.py --batch-sizes 1 2 4 8 16 32 --no-single-stream \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": null}'

The second command measures the crossover: speculation forced on at every batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ab_harness import median, print_table, run_requests, summary, turns, write_json

COPY_TASKS = {
    "repeat": "Repeat the following paragraph exactly, word for word:\n\nThe quick brown fox jumps over the lazy "
              "dog. The dog was not amused, and it decided to chase the fox across the field until both of them "
              "were tired and went home to sleep.",
    "list": "Convert this comma-separated list into a bulleted markdown list, one item per line: apples, bananas, "
            "cherries, dates, elderberries, figs, grapes, honeydew melons, kiwis, lemons, mangoes, nectarines",
    "extract": "Extract every sentence that mentions a date from this text and list them:\n\nThe project started on "
               "March 3, 2021. The team met every week. On June 12, 2021 the first prototype was shown to "
               "customers. Feedback was positive. The final release happened on January 20, 2022, after many "
               "tests.",
    "code": "Add a docstring to this Python function and return the complete function:\n\n```python\n"
            "def compute_total(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
            "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
            "    total = subtotal + tax\n    return round(total, 2)\n```",
}
CHAT_TASKS = {
    "habits": "What are three good habits for staying healthy? Explain briefly.",
    "poem": "Write a short poem about the sea at night.",
    "advice": "I am starting to learn to cook. What should I learn first, and why?",
}
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}
# The report's table columns (ab_harness.print_table): both tables', then the one-stream table's decode ones.
COLUMNS = [("tokens", "output_tokens", "d"), ("tok/s off", "tok_s_off", ".1f"), ("tok/s on", "tok_s_on", ".1f"),
           ("ratio", "ratio", ".2f"), ("accepted", "acceptance_rate", ".0%"),
           ("tok/step", "mean_accepted_length", ".2f"),
           ("ratios per round", lambda row: " ".join(f"{x:.2f}" for x in row["ratios"]), "")]
DECODE_COLUMNS = [("decode off", "decode_tok_s_off", ".1f"), ("decode on", "decode_tok_s_on", ".1f"),
                  ("ratio", "decode_ratio", ".2f")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC),
                   help="the ON arm's --speculative-config (JSON)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160, help="per request (greedy; the model's EOS ends it)")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 32])
    p.add_argument("--no-single-stream", action="store_true", help="only the batched runs")
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="bytes per engine")
    p.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-batched-bench binary: each round also runs it on the model's GGUF file "
                        "(128 prompt + 128 output tokens, one stream, 2 threads) and reports its decode tok/s")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def llama_cpp_decode_tok_s(binary: str, gguf: str) -> float:
    """llama.cpp's single-stream decode speed (S_TG t/s of llama-batched-bench's table)."""
    from llama_cpp_bench import batched_bench

    return batched_bench(binary, gguf, prompt_len=128, output_len=128, parallel=1)["decode_tok_s"]


def make_engines(args) -> dict:
    from fastdeploy import LLM

    common = dict(model=args.model, max_model_len=2048, max_num_seqs=max([1, *args.batch_sizes]),
                  kv_cache_memory=args.kv_cache_memory)
    return {"off": LLM(**common).engine, "on": LLM(speculative_config=args.speculative_config, **common).engine}


def spec_counters(engine) -> tuple:
    s = engine.get_stats()
    return (s.get("spec_decode_num_draft_tokens_total", 0), s.get("spec_decode_num_accepted_tokens_total", 0),
            s.get("spec_decode_num_drafts_total", 0))


def run_batch(engine, prompts: list, max_tokens: int) -> dict:
    """All prompts at once; tokens per request, wall time, first-token to last-token time (one request)."""
    from fastdeploy import SamplingParams

    before = spec_counters(engine)
    got = run_requests(engine, {f"b{time.monotonic_ns()}-{i}": p for i, p in enumerate(prompts)},
                       SamplingParams(temperature=0, max_tokens=max_tokens))
    drafted, accepted, verify_steps = (b - a for a, b in zip(before, spec_counters(engine)))
    return {"tokens": [o.outputs.token_ids for o in got["outputs"]], "elapsed": got["end"] - got["start"],
            "decode_s": got["end"] - min(wall for wall, _ in got["first"].values()),
            "drafted": drafted, "accepted": accepted, "verify_steps": verify_steps}


def interleaved(engines: dict, jobs: list, rounds: int, max_tokens: int, between=None) -> dict:
    """jobs: [(task, [prompt ids])]; each round runs every job in both arms back to back, the arms'
    order flipped every round; `between()` (if given) runs once per round too. Returns per arm and task
    a list (per round) of the runs."""
    results = {arm: {task: [] for task, _ in jobs} for arm in engines}
    for _, order in turns(engines, rounds, rotate=True):
        for task, prompts in jobs:
            for arm in order:
                results[arm][task].append(run_batch(engines[arm], prompts, max_tokens))
        if between is not None:
            between()
    return results


def summarize(off_runs: list, on_runs: list, single: bool) -> dict:
    def tok_s(run, decode=False):
        n = sum(len(t) for t in run["tokens"])
        if decode:  # one stream: tokens after each request's first over the time after it
            return (n - run.get("requests", 1)) / run["decode_s"] if run["decode_s"] > 0 else float("nan")
        return n / run["elapsed"]

    drafted, accepted, steps = (sum(r[k] for r in on_runs) for k in ("drafted", "accepted", "verify_steps"))
    speed = summary({"off": [tok_s(r) for r in off_runs], "on": [tok_s(r) for r in on_runs]}, "off")
    out = {"tok_s_off": speed["median"]["off"], "tok_s_on": speed["median"]["on"],
           "ratio": median(speed["ratios"]["on"]), "ratios": speed["ratios"]["on"],
           "output_tokens": sum(len(t) for t in off_runs[0]["tokens"]),
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "mean_accepted_length": (steps + accepted) / steps if steps else 0.0,
           "identical_tokens": all(a["tokens"] == b["tokens"] for a, b in zip(off_runs, on_runs))}
    if single:
        decode = summary({"off": [tok_s(r, True) for r in off_runs], "on": [tok_s(r, True) for r in on_runs]}, "off")
        out.update(decode_tok_s_off=decode["median"]["off"], decode_tok_s_on=decode["median"]["on"],
                   decode_ratio=median(decode["ratios"]["on"]), decode_ratios=decode["ratios"]["on"])
    return out


def merged_rounds(runs_by_task: dict, tasks: list) -> list:
    """The runs of several single-stream tasks summed round by round: one run per round."""
    keys = ("elapsed", "decode_s", "drafted", "accepted", "verify_steps")
    return [{"tokens": [t for task in tasks for t in runs_by_task[task][r]["tokens"]], "requests": len(tasks),
             **{k: sum(runs_by_task[task][r][k] for task in tasks) for k in keys}}
            for r in range(len(runs_by_task[tasks[0]]))]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        engines = make_engines(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = engines["off"].tokenizer
    chat = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}], True)  # noqa: E731
    copy_prompts = {name: chat(text) for name, text in COPY_TASKS.items()}
    chat_prompts = {name: chat(text) for name, text in CHAT_TASKS.items()}
    for engine in engines.values():  # warm-up: ops built and loaded outside the timed runs
        run_batch(engine, [copy_prompts["list"]], 8)

    report = {"model": args.model, "speculative_config": json.loads(args.speculative_config), "rounds": args.rounds,
              "max_tokens": args.max_tokens, "single_stream": {}, "batched": {}}
    if not args.no_single_stream:
        jobs = [(name, [p]) for name, p in {**copy_prompts, **chat_prompts}.items()]
        llama_cpp = []
        between = None
        if args.llama_batched_bench:
            gguf = engines["off"].fd_config.model_config.model
            between = lambda: llama_cpp.append(llama_cpp_decode_tok_s(args.llama_batched_bench, gguf))  # noqa: E731
        results = interleaved(engines, jobs, args.rounds, args.max_tokens, between)
        rows = {name: summarize(results["off"][name], results["on"][name], True) for name, _ in jobs}
        for group, tasks in (("copy", list(COPY_TASKS)), ("chat", list(CHAT_TASKS))):
            merged = {arm: merged_rounds(results[arm], tasks) for arm in ("off", "on")}
            rows[group] = {**summarize(merged["off"], merged["on"], True), "tasks": tasks}
        print_table([{"task": name.upper() if name in ("copy", "chat") else f"  {name}", **row}
                     for name, row in rows.items()],
                    [("task", "task", "")] + COLUMNS[:4] + DECODE_COLUMNS + COLUMNS[4:],
                    title=f"one stream, {args.model}, {args.rounds} rounds interleaved; tok/s = output tokens over "
                          "the request; decode = after the first token")
        report["single_stream"] = rows
        if llama_cpp:
            report["llama_cpp_decode_tok_s"] = llama_cpp
            print(f"llama.cpp llama-batched-bench on the same GGUF file (128 prompt + 128 output tokens, one "
                  f"stream, 2 threads), decode tok/s per round: {' '.join(f'{x:.1f}' for x in llama_cpp)}")
    if args.batch_sizes:
        mixed = list(copy_prompts.values()) + list(chat_prompts.values())
        jobs = [(f"N={n}", [mixed[i % len(mixed)] for i in range(n)]) for n in args.batch_sizes]
        results = interleaved(engines, jobs, args.rounds, args.max_tokens)
        report["batched"] = {task: summarize(results["off"][task], results["on"][task], False) for task, _ in jobs}
        print_table([{"batch": task, **row} for task, row in report["batched"].items()],
                    [("batch", "batch", "")] + COLUMNS,
                    title="N requests at once (copy-heavy and chat prompts mixed), output tok/s of the batch")
    identical = all(r["identical_tokens"] for part in ("single_stream", "batched") for r in report[part].values())
    report["identical_tokens"] = identical
    print(f"\nidentical tokens with and without speculation: {identical}")
    write_json(args.json, report)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
