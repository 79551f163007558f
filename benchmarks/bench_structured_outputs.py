"""Structured outputs: decode throughput under a JSON schema vs free text, and grammar compile time.

One engine, N requests at once (default 8), greedy, every request generating exactly --max-tokens
tokens in both arms: free text with ignore_eos, and a JSON schema (an array of at least 100 records)
that cannot close before max_tokens. The arms alternate round by round, the order flipped each
round, so a machine shared with other work slows both alike. Decode tok/s is the batch's output
tokens over the time from the last request's first token to the end (wall time, and CPU time of the
process: the second is less at the mercy of other jobs), and each step's milliseconds outside the
model's forward pass (the engine's own work: scheduling, masks, sampling). Then compile time: each schema
compiled from its text into a matcher on a cold cache, and the same request again (a cache hit: a
copy of the cached matcher), the one-off build of llguidance's tokenizer for the vocabulary, and the
time to compute one step's masks for N requests.

    python benchmarks/bench_structured_outputs.py --model smollm2-135m-instruct --json /tmp/structured.json
    python benchmarks/bench_structured_outputs.py --model smollm2-135m-instruct --concurrency 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from ab_harness import median, run_requests, summary, take_turns, write_json

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
    "active": {"type": "boolean"}, "role": {"enum": ["admin", "editor", "viewer"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "name", "active", "role"]}
THROUGHPUT_SCHEMA = {"type": "array", "items": RECORD, "minItems": 100}  # longer than any --max-tokens
COMPILE_SCHEMAS = {
    "record": RECORD,
    "nested_order": {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"}, "customer": RECORD,
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 999},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"]}},
        "status": {"enum": ["new", "paid", "shipped", "delivered", "returned"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["order_id", "customer", "items", "status"]},
    "array_of_records": THROUGHPUT_SCHEMA,
}
PROMPT = "List the users of the system as JSON records with id, name, email, active, role and tags."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="model path or name (None: the tiny preset)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


class ForwardClock:
    """Time spent in the model's forward pass (the ranks' execute_model): the rest of a step is the
    engine's own work, where a grammar's cost shows without the forward pass's noise."""

    def __init__(self, runner):
        self.seconds, self.steps = 0.0, 0
        forward = runner.ranks.execute_model

        def timed(step):
            start = time.perf_counter()
            try:
                return forward(step)
            finally:
                self.seconds += time.perf_counter() - start
                self.steps += 1

        runner.ranks.execute_model = timed


def _run_batch(llm, params, n: int) -> dict:
    """Submit n chat requests at once, step the engine to the end; decode tok/s after the last first token."""
    engine, clock = llm.engine, llm.engine.runner.forward_clock
    forward_s, steps = clock.seconds, clock.steps
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    got = run_requests(engine, {f"bench-{time.monotonic_ns()}-{i}": prompt for i in range(n)}, params)
    end, cpu_end = got["end"], time.process_time()
    decode_start, cpu_start = max(got["first"].values())  # the clocks when the last first token came
    tokens = sum(len(o.outputs.token_ids) for o in got["outputs"])
    decode_tokens = tokens - n  # the tokens after each request's first
    # Per CPU second of this process (all its threads) too: less at the mercy of other jobs on a shared
    # machine than wall time, and it counts the grammar threads' work.
    forward_s, steps = clock.seconds - forward_s, clock.steps - steps
    return {"decode_tok_s": decode_tokens / (end - decode_start),
            "ms_per_step_outside_forward": (end - got["start"] - forward_s) / steps * 1e3,
            "ms_per_step_forward": forward_s / steps * 1e3,
            "decode_tok_per_cpu_s": decode_tokens / (cpu_end - cpu_start), "total_s": end - got["start"],
            "tokens": tokens, "texts": [o.outputs.text for o in got["outputs"]]}


def compile_times(backend) -> dict:
    """ms per schema: cold compile (text -> matcher) and a cache hit; plus the tokenizer build."""
    from fastdeploy.model_executor.guided_decoding import GuidedDecodingParams
    from fastdeploy.model_executor.guided_decoding import backend as backend_module

    backend.lltokenizer  # noqa: B018  (built once per engine, at its first constrained request)
    result = {"tokenizer_build_ms": backend.tokenizer_build_seconds * 1e3, "schemas": {}}
    for name, schema in COMPILE_SCHEMAS.items():
        colds, hits = [], []
        for _ in range(3):
            backend._compiled.clear()
            backend_module._grammar.cache_clear()
            t0 = time.perf_counter()
            backend.matcher(GuidedDecodingParams(json=schema))
            t1 = time.perf_counter()
            backend.matcher(GuidedDecodingParams(json=schema))
            colds.append((t1 - t0) * 1e3)
            hits.append((time.perf_counter() - t1) * 1e3)
        result["schemas"][name] = {"compile_ms": statistics.median(colds), "cache_hit_ms": statistics.median(hits)}
    result["mask_ms"] = mask_times(backend)
    return result


def mask_times(backend, rows: int = 8) -> float:
    """Median ms to compute one step's masks for `rows` requests under the throughput schema, the
    matchers walking a realistic answer token by token (each step a new parser state, as in decoding):
    the work the background thread does beside each forward pass."""
    from fastdeploy.model_executor.guided_decoding import GuidedDecodingParams
    from fastdeploy.model_executor.guided_decoding.masks import GrammarState, _compute, _workers

    answer = backend._tokenizer.encode("[" + ",".join(
        f'{{"id":{i},"name":"User {i}","email":"user{i}@example.com","active":true,"role":"editor",'
        f'"tags":["a","b"]}}' for i in range(4)))
    states = [GrammarState(backend.matcher(GuidedDecodingParams(json=THROUGHPUT_SCHEMA)), backend.vocab_size,
                           backend.eos_ids) for _ in range(rows)]
    _, executor = _workers()
    work = [(i, state, []) for i, state in enumerate(states)]
    times = []
    for token in answer:
        start = time.perf_counter()
        _compute(executor, work)
        times.append((time.perf_counter() - start) * 1e3)
        for state in states:
            state.accept([token])
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.model_executor.guided_decoding import GuidedDecodingParams

    model = None if args.model in ("", "None") else args.model
    llm = LLM(model, max_num_seqs=args.concurrency, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.max_tokens + 128)
    llm.engine.runner.forward_clock = ForwardClock(llm.engine.runner)
    arms = {"free": SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
            "json_schema": SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                          guided_decoding=GuidedDecodingParams(json=THROUGHPUT_SCHEMA))}
    _run_batch(llm, arms["json_schema"], args.concurrency)  # warm-up: tokenizer build, compile, caches
    _run_batch(llm, arms["free"], args.concurrency)

    def report_round(r, runs):
        free, schema = runs["free"][-1], runs["json_schema"][-1]
        assert all(t.startswith("[") for t in schema["texts"]), schema["texts"][0][:80]
        print(f"round {r}: free {free['decode_tok_s']:.1f} tok/s, json_schema {schema['decode_tok_s']:.1f} tok/s, "
              f"ratio {schema['decode_tok_s'] / free['decode_tok_s']:.3f}; per CPU second "
              f"{free['decode_tok_per_cpu_s']:.1f} vs {schema['decode_tok_per_cpu_s']:.1f}, ratio "
              f"{schema['decode_tok_per_cpu_s'] / free['decode_tok_per_cpu_s']:.3f}; ms per step outside the "
              f"forward pass {free['ms_per_step_outside_forward']:.1f} vs {schema['ms_per_step_outside_forward']:.1f} "
              f"(forward {free['ms_per_step_forward']:.0f} vs {schema['ms_per_step_forward']:.0f} ms)", flush=True)

    runs = take_turns(arms, args.rounds, lambda name: _run_batch(llm, arms[name], args.concurrency), rotate=True,
                      between=report_round)
    per_round = {m: {name: [run[m] for run in runs[name]] for name in arms} for m in
                 ("decode_tok_s", "decode_tok_per_cpu_s", "ms_per_step_outside_forward", "ms_per_step_forward")}
    wall, cpu = (summary(per_round[m], "free") for m in ("decode_tok_s", "decode_tok_per_cpu_s"))
    compiled = compile_times(llm.engine.guided)
    result = {"model": args.model, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "decode_tok_s": wall["median"], "per_round": per_round["decode_tok_s"],
              "ratio_per_round": wall["ratios"]["json_schema"], "ratio_median": median(wall["ratios"]["json_schema"]),
              "decode_tok_per_cpu_s": cpu["median"], "cpu_ratio_per_round": cpu["ratios"]["json_schema"],
              "cpu_ratio_median": median(cpu["ratios"]["json_schema"]),
              **{m: summary(per_round[m], "free")["median"] for m in ("ms_per_step_outside_forward",
                                                                       "ms_per_step_forward")},
              "compile": compiled, "example_output": runs["json_schema"][-1]["texts"][0][:200]}
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=1))
    write_json(args.json, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
