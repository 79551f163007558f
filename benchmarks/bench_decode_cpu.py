"""Output tokens/s of `LLM.generate` on a SmolLM2-135M-shaped model with random weights (30 layers,
hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152, tied embeddings; float32), for
N concurrent requests of random prompts with `ignore_eos`. Optionally profiles one run with
cProfile and prints the top entries, to see what a step costs besides the GEMMs.

    python benchmarks/bench_decode_cpu.py [--concurrency 1 8] [--input-len 128] [--output-len 64]
    python benchmarks/bench_decode_cpu.py --concurrency 1 --profile 25
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct   # the real model instead
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct --kv-cache-quant-types none int8 \
        --concurrency 8 --input-len 4096 --decode-steps 24   # decode steps over float32 vs int8 KV pages

    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct --fused-layers-ab --concurrency 1 8 32

    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct --head-wise-ab \
        --concurrency 1 8 32 --input-lens 128 3000 --decode-steps 24   # FD_HEAD_WISE_KV_CACHE=0 vs 1

The checkpoint (ERNIE-4.5 layout, ~540 MB) is written once to --model-dir and reused.

With --head-wise-ab, two engines of the same model take the same prompts, one with
FD_HEAD_WISE_KV_CACHE=0 and one with 1 (a named model's calibrated head-wise configuration applies to
the second only); once both are prefilled they take decode steps in turn (off, on, on, off, off, on...), and
every step is split into its host parts (schedule: recycling and admission; the step input with its
tables; the buffer fill; the attention calls; the rest of the forward; the update) so that what
the flag adds per step is visible. Each row prints the weight bytes from the engines' load logs.

With --kv-cache-quant-types, one engine per KV page format (--kv-cache-quant-type) takes the same N
prompts; once every prompt is prefilled, the engines take decode steps in turn (A, B, A, B...), each
step timed, and the medians give decode tok/s per format next to the first format's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from types import SimpleNamespace

import numpy as np

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)


def add_and_prefill(engine, name, prompts: list, params) -> float:
    """Queue the prompts and step until every one of them decodes; the seconds that took."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    t0 = time.perf_counter()
    while any(r.num_computed_tokens <= r.num_prompt_tokens for r in engine.scheduler.running) or \
            len(engine.scheduler.running) < len(prompts):
        engine.step()
    return time.perf_counter() - t0


def _shapes(c) -> dict:
    """The checkpoint's tensors, `[out, in]` (the names every supported architecture shares)."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (c.intermediate_size, h),
                       p + "mlp.up_proj.weight": (c.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, c.intermediate_size)})
    return shapes


def write_checkpoint(path: str) -> str:
    from safetensors.numpy import save_file

    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["Ernie4_5_ForCausalLM"], "model_type": "ernie4_5", **SMOLLM2_SHAPE,
              "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
              "fastdeploy_byte_tokenizer": True}
    rng = np.random.default_rng(0)
    weights = {}
    for name, shape in _shapes(SimpleNamespace(**SMOLLM2_SHAPE)).items():
        if len(shape) == 1:
            weights[name] = np.ones(shape, np.float32)
        else:
            weights[name] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[1])).astype(np.float32)
    save_file(weights, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def run(llm, n: int, input_len: int, output_len: int, seed: int) -> dict:
    from fastdeploy import SamplingParams

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 259, input_len).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs.token_ids) for o in outs)
    return {"concurrency": n, "output_tokens": tokens, "seconds": elapsed, "tok_per_s": tokens / elapsed}


def decode_steps_by_format(args) -> list:
    """Median decode-step time of one engine per page format, their steps interleaved."""
    from fastdeploy import LLM, SamplingParams

    rng = np.random.default_rng(0)
    n = args.concurrency[0]
    engines = {}
    for quant in args.kv_cache_quant_types:
        llm = LLM(model=args.model or write_checkpoint(args.model_dir), block_size=64, max_num_seqs=n,
                  max_model_len=args.input_len + args.decode_steps + 16, max_num_batched_tokens=2048,
                  kv_cache_memory=args.kv_cache_memory, kv_cache_quant_type=quant, enable_prefix_caching=False)
        engines[quant] = llm.engine
    vocab = next(iter(engines.values())).model_config.vocab_size
    prompts = [rng.integers(3, min(vocab, 30000), args.input_len).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=args.decode_steps + 4, ignore_eos=True)
    for quant, engine in engines.items():
        seconds = add_and_prefill(engine, quant, prompts, params)
        print(f"[{quant}] {n} x {args.input_len} prompt tokens prefilled in {seconds:.1f} s; "
              f"{engine.get_stats()['kv_pages_total']} KV pages", flush=True)
    times = {q: [] for q in engines}
    for _ in range(args.decode_steps):
        for quant, engine in engines.items():
            t0 = time.perf_counter()
            engine.step()
            times[quant].append(time.perf_counter() - t0)
    first = float(np.median(times[args.kv_cache_quant_types[0]]))
    rows = []
    for quant, ts in times.items():
        med = float(np.median(ts))
        rows.append({"kv_cache_quant_type": quant, "concurrency": n, "context": args.input_len,
                     "median_step_ms": med * 1e3, "decode_tok_per_s": n / med, "step_time_x": med / first,
                     "step_ms": [t * 1e3 for t in ts]})
        print(f"{quant:<16} median decode step {med * 1e3:7.1f} ms  {n / med:7.1f} tok/s  x{med / first:.3f}",
              flush=True)
    return rows


def fused_layers_ab(args) -> list:
    """Median decode step of one engine with its layers as two op calls each around the attention op
    (FD_CPU_FUSED_LAYERS=1) vs every layer in one op call (2, the default): the model's level is set
    between steps, so the two arms take turns on the same requests (1, 2, 2, 1, 1, 2, ...) at the same
    contexts."""
    from fastdeploy import LLM, SamplingParams

    rows = []
    for n in args.concurrency:
        llm = LLM(model=args.model or write_checkpoint(args.model_dir), block_size=64, max_num_seqs=n,
                  max_model_len=args.input_len + 2 * args.decode_steps + 16, max_num_batched_tokens=2048,
                  kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        rng = np.random.default_rng(n)
        prompts = [rng.integers(3, min(vocab, 30000), args.input_len).tolist() for _ in range(n)]
        params = SamplingParams(temperature=0, max_tokens=2 * args.decode_steps + 4, ignore_eos=True)
        add_and_prefill(engine, "ab", prompts, params)
        times = {1: [], 2: []}
        for i in range(2 * args.decode_steps):
            arm = engine.runner.model.fused_layers_level = (1, 2, 2, 1)[i % 4]
            t0 = time.perf_counter()
            engine.step()
            times[arm].append(time.perf_counter() - t0)
        per_layer, stack = (float(np.median(times[a])) for a in (1, 2))
        rows.append({"concurrency": n, "context": args.input_len, "per_layer_step_ms": per_layer * 1e3,
                     "stack_step_ms": stack * 1e3, "stack_speedup": per_layer / stack})
        print(f"N={n:<3} context {args.input_len}: median decode step {per_layer * 1e3:7.2f} ms with two op calls "
              f"a layer, {stack * 1e3:7.2f} ms with every layer in one op call: x{per_layer / stack:.3f}", flush=True)
        while engine.has_unfinished_requests():
            engine.step()
    return rows


class StepParts:
    """Wall time of a step's parts, by wrapping the engine's own methods (no change to the engine)."""

    PARTS = ("schedule", "step_input", "buffers", "attention", "forward", "update")

    def __init__(self, engine):
        runner = engine.runner.ranks
        self.times = {p: 0.0 for p in self.PARTS}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "build_step_input", "step_input")
        self._wrap(runner, "build_forward_meta", "buffers")
        self._wrap(runner.attn_backend, "forward", "attention")
        self._wrap(runner.model, "forward", "forward")
        self._wrap(engine.scheduler, "update_from_output", "update")

    def _wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.times[part] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def take(self) -> dict:
        out, self.times = self.times, {p: 0.0 for p in self.PARTS}
        return out


def host_parts_repeated(engine, reps: int) -> dict:
    """Median ms of the host parts that can be rerun on one scheduled decode batch without changing
    anything (the step input with its tables, the buffer fill, every layer's attention call: it writes
    the same K/V into the same page cells): far less noise than a whole step. The batch then runs."""
    import paddle

    runner, ranks = engine.runner, engine.runner.ranks
    batch = engine.scheduler.schedule()

    def median_ms(fn) -> float:
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts)) * 1e3

    step = runner.build_step_input(batch)
    meta = ranks.build_forward_meta(step)
    cfg = engine.model_config
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    qkv = paddle.to_tensor(np.random.default_rng(0).standard_normal((int(step.cu_seqlens_q[-1]), width))
                           .astype(np.float32))
    backend, layers = ranks.attn_backend, range(cfg.num_hidden_layers)
    out = {"step_input": median_ms(lambda: runner.build_step_input(batch)),
           "buffers": median_ms(lambda: ranks.build_forward_meta(step)),
           "attention_all_layers": median_ms(lambda: [backend.forward(l, qkv, meta) for l in layers])}
    tokens, logprobs, _ = runner.execute(batch)  # the real step, so the engine stays consistent
    engine.scheduler.update_from_output(batch, tokens, logprobs)
    return out


def head_wise_ab(args) -> list:
    """Flag off vs on: median decode step and its host parts, steps interleaved, per (N, context)."""
    import gc
    import logging

    from fastdeploy import LLM, SamplingParams, envs

    rows = []
    for input_len in args.input_lens:
        for n in args.concurrency:
            engines, parts, storage = {}, {}, {}
            rng = np.random.default_rng(input_len + n)
            blocks = n * -(-(input_len + args.decode_steps + 8) // 16) + 8  # the same KV blocks in both arms
            for flag in (0, 1):
                records = []
                handler = logging.Handler()
                handler.emit = lambda record: records.append(record.getMessage())
                logging.getLogger("fastdeploy.model").addHandler(handler)
                with envs.override(FD_HEAD_WISE_KV_CACHE=flag):
                    llm = LLM(model=args.model or write_checkpoint(args.model_dir), block_size=16, max_num_seqs=n,
                              max_model_len=input_len + args.decode_steps + 16, max_num_batched_tokens=2048,
                              num_gpu_blocks_override=blocks, enable_prefix_caching=False)
                logging.getLogger("fastdeploy.model").removeHandler(handler)
                storage[flag] = next((m.split(": ", 1)[1] for m in records if m.startswith("dense layers:")),
                                     llm.engine.runner.model.dense_layer_storage())
                engines[flag] = llm.engine
            vocab = engines[0].model_config.vocab_size
            prompts = [rng.integers(3, min(vocab, 30000), input_len).tolist() for _ in range(n)]
            # Enough tokens for the timed steps, the repeated parts' two steps and chunked prefill's early tokens.
            params = SamplingParams(temperature=0, max_tokens=args.decode_steps + 16, ignore_eos=True)
            for flag, engine in engines.items():
                engine.add_request(f"warm-{flag}", prompts[0][:8], SamplingParams(temperature=0, max_tokens=2))
                while engine.has_unfinished_requests():
                    engine.step()
                seconds = add_and_prefill(engine, flag, prompts, params)
                print(f"[flag {flag}] {n} x {input_len} prompt tokens prefilled in {seconds:.1f} s", flush=True)
                parts[flag] = StepParts(engine)
            times = {f: [] for f in engines}
            split = {f: [] for f in engines}
            for i in range(args.decode_steps):
                for flag in (0, 1) if i % 2 == 0 else (1, 0):  # alternate which arm goes first
                    engine = engines[flag]
                    parts[flag].take()
                    t0 = time.perf_counter()
                    engine.step()
                    times[flag].append(time.perf_counter() - t0)
                    split[flag].append(parts[flag].take())
            repeated = {}
            for _ in range(2):  # interleaved too
                for flag, engine in engines.items():
                    got = host_parts_repeated(engine, args.repeats)
                    repeated[flag] = {k: min(v, repeated.get(flag, got)[k]) for k, v in got.items()}
            off = float(np.median(times[0]))
            for flag in engines:
                med = float(np.median(times[flag]))
                part_ms = {p: float(np.median([s[p] for s in split[flag]])) * 1e3 for p in StepParts.PARTS}
                part_ms["dense"] = part_ms["forward"] - part_ms["attention"]
                # Host time: the step outside the model's GEMMs and attention calls.
                part_ms["host"] = float(np.median([t - s["forward"] for t, s in zip(times[flag], split[flag])])) * 1e3
                row = {"head_wise_kv_cache": flag, "concurrency": n, "context": input_len,
                       "weights": storage[flag], "median_step_ms": med * 1e3, "decode_tok_per_s": n / med,
                       "speed_x_off": off / med, "parts_ms": part_ms, "repeated_ms": repeated[flag]}
                rows.append(row)
                print(f"N={n:<3} ctx={input_len:<5} flag {flag}: {med * 1e3:7.2f} ms/step {n / med:7.1f} tok/s "
                      f"x{off / med:.3f} of off | host {part_ms['host']:.2f} ms (schedule {part_ms['schedule']:.2f}, "
                      f"step input {part_ms['step_input']:.2f}, buffers {part_ms['buffers']:.2f}, update "
                      f"{part_ms['update']:.2f}) attention {part_ms['attention']:.2f} dense {part_ms['dense']:.2f} | "
                      f"weights {storage[flag]}", flush=True)
                r = repeated[flag]
                print(f"{'':22}repeated on one batch: step input {r['step_input']:.3f} ms, buffers {r['buffers']:.3f} "
                      f"ms, attention (all layers) {r['attention_all_layers']:.3f} ms", flush=True)
            for engine in engines.values():
                engine.close()
            del engines, parts
            gc.collect()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy",
                                                         "smollm2-shaped-random"))
    ap.add_argument("--model", help="a model name, directory or GGUF file instead of the random SmolLM2-shaped one")
    ap.add_argument("--profile", type=int, default=0, help="cProfile the last run; print this many entries")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--kv-cache-quant-types", nargs="+", default=None, choices=["none", "int8", "block_wise_fp8", "block_wise_int4"],
                    help="compare decode steps over these KV page formats (one engine each, steps interleaved)")
    ap.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per format")
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30,
                    help="KV bytes of each engine (formats, fused-layers A/B)")
    ap.add_argument("--head-wise-ab", action="store_true",
                    help="FD_HEAD_WISE_KV_CACHE=0 vs 1 on the same prompts, decode steps interleaved, with each "
                         "step's host parts, at every --concurrency and --input-lens")
    ap.add_argument("--fused-layers-ab", action="store_true",
                    help="FD_CPU_FUSED_LAYERS=1 (two op calls a layer) vs 2 (every layer in one op call): one "
                         "engine per --concurrency, decode steps alternating between the two")
    ap.add_argument("--repeats", type=int, default=50, help="--head-wise-ab: reruns of each repeatable host part")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[128, 3000],
                    help="prompt lengths (contexts) of --head-wise-ab")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    mode = head_wise_ab if args.head_wise_ab else decode_steps_by_format if args.kv_cache_quant_types else \
        fused_layers_ab if args.fused_layers_ab else None
    if mode is not None:
        rows = mode(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
        return

    from fastdeploy import LLM

    llm = LLM(model=args.model or write_checkpoint(args.model_dir), block_size=16, max_num_seqs=max(args.concurrency),
              max_model_len=args.input_len + args.output_len + 16, num_gpu_blocks_override=4096,
              max_num_batched_tokens=2048)
    run(llm, 1, 8, 2, seed=99)  # warm-up: op builds, first-call allocations
    results = []
    for i, n in enumerate(args.concurrency):
        profiler = cProfile.Profile() if args.profile and i == len(args.concurrency) - 1 else None
        if profiler:
            profiler.enable()
        results.append(run(llm, n, args.input_len, args.output_len, seed=n))
        if profiler:
            profiler.disable()
        r = results[-1]
        print(f"N={n:<3} {r['output_tokens']} output tokens in {r['seconds']:.1f} s: {r['tok_per_s']:.1f} tok/s",
              flush=True)
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
            print(text.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
