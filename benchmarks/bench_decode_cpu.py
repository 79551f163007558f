"""Output tokens/s of `LLM.generate` on a SmolLM2-135M-shaped model with random weights (30 layers,
hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152, tied embeddings; float32), for
N concurrent requests of random prompts with `ignore_eos`. Optionally profiles one run with
cProfile and prints the top entries, to see what a step costs besides the GEMMs.

    python benchmarks/bench_decode_cpu.py [--concurrency 1 8] [--input-len 128] [--output-len 64]
    python benchmarks/bench_decode_cpu.py --concurrency 1 --profile 25
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct   # the real model instead
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct --kv-cache-quant-types none int8 \
        --concurrency 8 --input-len 4096 --decode-steps 24   # decode steps over float32 vs int8 KV pages

The checkpoint (ERNIE-4.5 layout, ~540 MB) is written once to --model-dir and reused.

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
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{quant}-{i}", prompt, params)
        t0 = time.perf_counter()
        while any(r.num_computed_tokens <= r.num_prompt_tokens for r in engine.scheduler.running) or \
                len(engine.scheduler.running) < n:
            engine.step()
        print(f"[{quant}] {n} x {args.input_len} prompt tokens prefilled in {time.perf_counter() - t0:.1f} s; "
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
    ap.add_argument("--kv-cache-quant-types", nargs="+", default=None, choices=["none", "int8", "block_wise_fp8"],
                    help="compare decode steps over these KV page formats (one engine each, steps interleaved)")
    ap.add_argument("--decode-steps", type=int, default=24, help="timed decode steps per format")
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="KV bytes of each engine (formats)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.kv_cache_quant_types:
        rows = decode_steps_by_format(args)
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
