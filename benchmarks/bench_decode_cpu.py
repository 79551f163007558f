"""Output tokens/s of `LLM.generate` on a SmolLM2-135M-shaped model with random weights (30 layers,
hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152, tied embeddings; float32), for
N concurrent requests of random prompts with `ignore_eos`. Optionally profiles one run with
cProfile and prints the top entries, to see what a step costs besides the GEMMs.

    python benchmarks/bench_decode_cpu.py [--concurrency 1 8] [--input-len 128] [--output-len 64]
    python benchmarks/bench_decode_cpu.py --concurrency 1 --profile 25
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct   # the real model instead

The checkpoint (ERNIE-4.5 layout, ~540 MB) is written once to --model-dir and reused.
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
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)

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
