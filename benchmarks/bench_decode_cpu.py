"""Output tokens/s of `LLM.generate` on a SmolLM2-135M-shaped model with random weights (30 layers,
hidden 576, 9 heads / 3 KV heads of 64, FFN 1536, vocab 49152, tied embeddings; float32), for
N concurrent requests of random prompts with `ignore_eos` (what a step costs besides the GEMMs:
`python -m cProfile -s tottime benchmarks/bench_decode_cpu.py --concurrency 1`).

    python benchmarks/bench_decode_cpu.py [--concurrency 1 8] [--input-len 128] [--output-len 64]
    FD_HEAD_WISE_KV_CACHE=1 python benchmarks/bench_decode_cpu.py --model ernie-4.5-tiny-swa --tensor-parallel-sizes 1 2 \
        --concurrency 16 --input-len 256   # TP ranks on the CPU: what the process model costs, same tokens
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct   # the real model instead
    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct --kv-cache-quant-types none int8 \
        --concurrency 8 --input-len 4096 --decode-steps 24   # decode steps over float32 vs int8 KV pages

    python benchmarks/bench_decode_cpu.py --model smollm2-135m-instruct --head-wise-ab \
        --concurrency 1 8 32 --input-lens 128 3000 --decode-steps 24   # FD_HEAD_WISE_KV_CACHE=0 vs 1

    python benchmarks/bench_decode_cpu.py --step-breakdown [--model smollm2-135m-instruct] [--steps 100]
    python benchmarks/bench_decode_cpu.py --step-breakdown --clock cpu   # CPU time: robust on a shared machine
    FD_CPU_INT8_ACTIVATIONS=1 python benchmarks/bench_decode_cpu.py --step-breakdown   # the opt-in path

The checkpoint (ERNIE-4.5 layout, ~540 MB) is written once to --model-dir and reused.

The A/B modes take decode steps of their arms in turns (ab_harness.py) once every prompt is prefilled:
- --kv-cache-quant-types: one engine per KV page format (A, B, A, B...); median decode tok/s per format
  next to the first format's;
- --head-wise-ab: two engines of the same model, FD_HEAD_WISE_KV_CACHE=0 and 1 (a named model's
  calibrated head-wise configuration applies to the second only), steps taken off, on, on, off...;
  every step is split into its host parts (schedule; the step input; the buffer fill; the attention
  calls; the rest of the forward; the update) so that what the flag adds per step is visible, and
  each row prints the dense layers' weight storage.

--step-breakdown (the named model smollm2-135m-instruct unless --model says otherwise): where one
request's decode step goes. One engine, one request of --input-len random prompt tokens, greedy; --steps
decode steps are timed, each split by wrapping the engine's parts (schedule, step input, buffer fill, the
forward pass, update, detokenize, output) and every Paddle custom-op call (by op name). "dense" is every
op that multiplies by the weights (linear_blocks*, linear_packed, the fused layer ops, which include their
norms and activation); with every layer in one op (the default, FD_CPU_FUSED_LAYERS=2) that op is its own
line, and FD_CPU_FUSED_LAYERS=1 splits it into dense and attention; "host" is the step's time outside any
custom op. The wrapping adds ~1 us per op call. With `--clock cpu` the main thread's CPU time is counted
(the op's helper thread works in parallel and is not), which a busy machine disturbs least; compare runs
of one clock only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import time

import numpy as np
from ab_harness import median, print_table, take_turns, timed, write_json

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
DENSE_OPS = ("linear_blocks", "linear_blocks_int8", "linear_packed", "linear_unpacked", "norm_qkv_blocks", "mlp_blocks")
NORM_OPS = ("rms_norm_rows", "add_rms_norm_rows", "gated_activation")
# Every layer in one op (FD_CPU_FUSED_LAYERS=2, the default): its dense products, attention and norms together.
STACK_OPS = ("decoder_stack_forward",)


def random_smollm2(path: str) -> str:
    """The random SmolLM2-shaped float32 checkpoint at path (1-D weights ones, matrices N(0, 1 / fan-in)),
    written the first time."""
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from safetensors.numpy import save_file

        from fastdeploy.engine.args_utils import EngineArgs
        from fastdeploy.model_executor.models.decoder import checkpoint_shapes

        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"architectures": ["Ernie4_5_ForCausalLM"], "model_type": "ernie4_5", **SMOLLM2_SHAPE,
                       "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                       "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
                       "fastdeploy_byte_tokenizer": True}, f)
        shapes = checkpoint_shapes(EngineArgs(model=path, block_size=16, num_gpu_blocks_override=32,
                                              max_model_len=256).create_engine_config().model_config)
        rng = np.random.default_rng(0)
        save_file({name: np.ones(s, np.float32) if len(s) == 1 else
                   rng.standard_normal(s, dtype=np.float32) / np.float32(np.sqrt(s[1])) for name, s in shapes.items()},
                  os.path.join(path, "model.safetensors"))
    return path


def load(args, n: int, context: int, **kwargs):
    """An LLM for n requests of `context` tokens (and room for the first steps' tokens)."""
    from fastdeploy import LLM

    kwargs = {"max_num_batched_tokens": 2048, "enable_prefix_caching": False, **kwargs}
    return LLM(model=args.model or random_smollm2(args.model_dir), max_num_seqs=n, max_model_len=context + 16,
               **kwargs)


def random_prompts(engine, n: int, length: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, min(engine.model_config.vocab_size, 30000), length).tolist() for _ in range(n)]


def decoding(max_tokens: int):
    from fastdeploy import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def add_and_prefill(engine, name, prompts: list, params) -> float:
    """Queue the prompts and step until every one of them decodes; the seconds that took."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    t0 = time.perf_counter()
    while any(r.num_computed_tokens <= r.num_prompt_tokens for r in engine.scheduler.running) or \
            len(engine.scheduler.running) < len(prompts):
        engine.step()
    return time.perf_counter() - t0


def run(llm, n: int, input_len: int, output_len: int, seed: int) -> dict:
    prompts = random_prompts(llm.engine, n, input_len, seed)
    start, steps = time.perf_counter(), llm.engine.engine_steps_total
    outs = llm.generate(prompts, decoding(output_len), use_tqdm=False)
    elapsed, steps = time.perf_counter() - start, llm.engine.engine_steps_total - steps
    tokens = [o.outputs.token_ids for o in outs]
    return {"concurrency": n, "output_tokens": sum(map(len, tokens)), "seconds": elapsed,
            "tok_per_s": sum(map(len, tokens)) / elapsed, "mean_step_ms": 1e3 * elapsed / steps, "tokens": tokens}


def generate_by_concurrency(args) -> list:
    """`LLM.generate` tok/s at every --concurrency, one engine per --tensor-parallel-sizes (a worker process per
    rank beyond one), whose tokens must be the first engine's."""
    from fastdeploy.model_executor.layers import cpu_kernels

    results, first = [], {}
    print(cpu_kernels.describe(), flush=True)
    for tp in args.tensor_parallel_sizes:
        llm = load(args, max(args.concurrency), args.input_len + args.output_len, block_size=16,
                   num_gpu_blocks_override=4096, enable_prefix_caching=None, tensor_parallel_size=tp)
        run(llm, 1, 8, 2, seed=99)  # warm-up: op builds, first-call allocations
        for n in args.concurrency:
            r = run(llm, n, args.input_len, args.output_len, seed=n)
            got = r.pop("tokens")
            same = first.setdefault(n, got) == got
            results.append({**r, "tensor_parallel_size": tp, "same_tokens_as_first_engine": same,
                            "kernels": cpu_kernels.kernel_isas()})
            print(f"TP={tp} N={n:<3} {r['output_tokens']} output tokens in {r['seconds']:.1f} s: {r['tok_per_s']:.1f} "
                  f"tok/s, {r['mean_step_ms']:.1f} ms a step; tokens = the first engine's: {same}", flush=True)
        llm.engine.close()
    return results


def decode_steps_by_format(args) -> list:
    """Median decode-step time of one engine per page format, their steps taking turns."""
    n, formats = args.concurrency[0], args.kv_cache_quant_types
    engines = {q: load(args, n, args.input_len + args.decode_steps, block_size=64, kv_cache_quant_type=q,
                       kv_cache_memory=args.kv_cache_memory).engine for q in formats}
    prompts = random_prompts(engines[formats[0]], n, args.input_len, seed=0)
    for quant, engine in engines.items():
        seconds = add_and_prefill(engine, quant, prompts, decoding(args.decode_steps + 4))
        print(f"[{quant}] {n} x {args.input_len} prompt tokens prefilled in {seconds:.1f} s; "
              f"{engine.get_stats()['kv_pages_total']} KV pages", flush=True)
    times = take_turns(engines, args.decode_steps, lambda q: timed(engines[q].step))
    first = median(times[formats[0]])
    rows = [{"kv_cache_quant_type": q, "concurrency": n, "context": args.input_len, "median_step_ms": median(ts) * 1e3,
             "decode_tok_per_s": n / median(ts), "step_time_x": median(ts) / first, "step_ms": [t * 1e3 for t in ts]}
            for q, ts in times.items()]
    print_table(rows, [("KV pages", "kv_cache_quant_type", ""), ("median step ms", "median_step_ms", ".1f"),
                       ("decode tok/s", "decode_tok_per_s", ".1f"), ("step time x", "step_time_x", ".3f")])
    return rows


class StepParts:
    """Time of a step's parts, by wrapping the engine's own methods (no change to the engine) and, inside
    `counting_ops()`, every Paddle custom-op call (as "op:<name>"). A timer on the attention backend makes
    the model take the per-layer calls (the whole stack in one op runs only on the bare backend:
    runs_cpu_op), so `attention=False` leaves it bare."""

    WRAPPED = {"schedule": ("scheduler", "schedule"), "step_input": ("runner.batch", "step_input"),
               "buffers": ("runner.ranks", "build_forward_meta"), "attention": ("runner.ranks.attn_backend", "forward"),
               "forward": ("runner.ranks.model", "forward"), "update": ("scheduler", "update_from_output"),
               "detokenize": ("tokenizer", "decode_incremental"), "output": ("", "_output")}
    HOST = ("schedule", "step_input", "buffers", "update", "detokenize", "output")

    def __init__(self, engine, clock=time.perf_counter, attention: bool = True):
        self.clock, self.times = clock, {}
        for part, (path, name) in self.WRAPPED.items():
            if part == "attention" and not attention:
                continue
            owner = functools.reduce(getattr, path.split(".") if path else [], engine)
            setattr(owner, name, functools.partial(self._timed, part, getattr(owner, name)))

    def _timed(self, part: str, inner, *a, **k):
        t0 = self.clock()
        try:
            return inner(*a, **k)
        finally:
            self.times[part] = self.times.get(part, 0.0) + self.clock() - t0

    @contextlib.contextmanager
    def counting_ops(self):
        from paddle import _C_ops

        run_op = _C_ops._run_custom_op
        _C_ops._run_custom_op = lambda name, *a: self._timed("op:" + name, run_op, name, *a)
        try:
            yield
        finally:
            _C_ops._run_custom_op = run_op

    def take(self) -> dict:
        """Seconds per part since the last take (0 for a part not called)."""
        out, self.times = {**dict.fromkeys(self.WRAPPED, 0.0), **self.times}, {}
        return out


def host_parts_repeated(engine, reps: int) -> dict:
    """Median ms of the host parts that can be rerun on one scheduled decode batch without changing
    anything (the step input, the buffer fill, every layer's attention call: it writes the same K/V
    into the same page cells): far less noise than a whole step. The batch then runs."""
    import paddle

    runner, ranks, cfg = engine.runner, engine.runner.ranks, engine.model_config
    batch = engine.scheduler.schedule()
    step = runner.build_step_input(batch)  # takes the step's table changes: the real step below sends them
    meta = ranks.build_forward_meta(step)
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    qkv = paddle.to_tensor(np.random.default_rng(0).standard_normal((int(step.cu_seqlens_q[-1]), width))
                           .astype(np.float32))
    backend, layers = ranks.attn_backend, range(cfg.num_hidden_layers)
    parts = {"step_input": lambda: runner.build_step_input(batch), "buffers": lambda: ranks.build_forward_meta(step),
             "attention_all_layers": lambda: [backend.forward(layer, qkv, meta) for layer in layers]}
    out = {part: median([timed(fn) for _ in range(reps)]) * 1e3 for part, fn in parts.items()}
    runner.batch._released = list(step.table_updates)  # the workers keep the table: its changes go once more
    tokens, logprobs, _ = runner.execute(batch)  # the real step, so the engine stays consistent
    engine.scheduler.update_from_output(batch, tokens, logprobs)
    return out


def head_wise_ab(args) -> list:
    """Flag off vs on: median decode step and its host parts, the steps taking turns, per (N, context).
    The attention calls' timer puts both arms on the per-layer op calls (StepParts)."""
    from fastdeploy import envs

    rows = []
    for input_len in args.input_lens:
        for n in args.concurrency:
            blocks = n * -(-(input_len + args.decode_steps + 8) // 16) + 8  # the same KV blocks in both arms
            engines = {}
            for flag in (0, 1):
                with envs.override(FD_HEAD_WISE_KV_CACHE=flag):
                    engines[flag] = load(args, n, input_len + args.decode_steps, block_size=16,
                                         num_gpu_blocks_override=blocks).engine
            prompts = random_prompts(engines[0], n, input_len, seed=input_len + n)
            parts = {}
            for flag, engine in engines.items():
                engine.add_request(f"warm-{flag}", prompts[0][:8], decoding(2))
                while engine.has_unfinished_requests():
                    engine.step()
                # Enough tokens for the timed steps, the repeated parts' two steps and chunked prefill's early ones.
                seconds = add_and_prefill(engine, flag, prompts, decoding(args.decode_steps + 16))
                print(f"[flag {flag}] {n} x {input_len} prompt tokens prefilled in {seconds:.1f} s", flush=True)
                parts[flag] = StepParts(engine)

            def step(flag):
                parts[flag].take()
                return timed(engines[flag].step), parts[flag].take()

            got = take_turns((0, 1), args.decode_steps, step, rotate=True)
            reps = take_turns((0, 1), 2, lambda flag: host_parts_repeated(engines[flag], args.repeats))
            off = median([t for t, _ in got[0]])
            for flag, engine in engines.items():
                med = median([t for t, _ in got[flag]])
                part_ms = {p: median([s[p] for _, s in got[flag]]) * 1e3 for p in StepParts.WRAPPED}
                part_ms["dense"] = part_ms["forward"] - part_ms["attention"]
                # Host time: the step outside the model's GEMMs and attention calls.
                part_ms["host"] = median([t - s["forward"] for t, s in got[flag]]) * 1e3
                repeated = {k: min(r[k] for r in reps[flag]) for k in reps[flag][0]}
                storage = engine.runner.model.dense_layer_storage()
                rows.append({"head_wise_kv_cache": flag, "concurrency": n, "context": input_len, "weights": storage,
                             "median_step_ms": med * 1e3, "decode_tok_per_s": n / med, "speed_x_off": off / med,
                             "parts_ms": part_ms, "repeated_ms": repeated})
                print(f"N={n:<3} ctx={input_len:<5} flag {flag}: {med * 1e3:7.2f} ms/step {n / med:7.1f} tok/s "
                      f"x{off / med:.3f} of off | host {part_ms['host']:.2f} ms (" +
                      ", ".join(f"{p} {part_ms[p]:.2f}" for p in StepParts.HOST) + f") attention "
                      f"{part_ms['attention']:.2f} dense {part_ms['dense']:.2f} | weights {storage}\n{'':22}repeated "
                      "on one batch: " + ", ".join(f"{k} {v:.3f} ms" for k, v in repeated.items()), flush=True)
            for engine in engines.values():
                engine.close()
            del engines, parts
            gc.collect()
    return rows


def kv_bytes_read(engine, context: int) -> int:
    """Bytes of K/V pages one request's decode token reads at `context` (every layer's KV heads, a sliding
    head its sink + window only; a quantized row with its float32 scale)."""
    import paddle

    backend = engine.runner.ranks.attn_backend
    total = 0
    for layer, (windows, _) in enumerate(backend.layer_args):
        keys = sum(min(context, w + s) if w else context for w, s in zip(*windows.numpy().tolist()))
        for lane in (backend.key_caches[layer], backend.value_caches[layer]):
            quantized = lane.dtype not in (paddle.float32, paddle.bfloat16, paddle.float16)
            total += keys * (lane.shape[-1] * lane.element_size() + (4 if quantized else 0))
    return total


def decode_roofline(engine, context: int, bandwidth_gbs: float) -> dict:
    """The one-stream decode bound the memory read bandwidth implies: (bytes of the weights + the K/V one
    token reads) / bandwidth."""
    weights, kv = engine.runner.model.dense_layer_bytes(), kv_bytes_read(engine, context)
    return {"read_bandwidth_gbs": bandwidth_gbs, "weight_bytes": weights, "kv_bytes": kv,
            "roofline_tok_per_s": bandwidth_gbs * 1e9 / (weights + kv)}


def step_breakdown(args) -> dict:
    """One request's decode step split into host parts, dense products, attention and norms (per op), next
    to the decode bound the machine's memory read bandwidth implies."""
    from fastdeploy.model_executor.layers import cpu_kernels

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    args.model = args.model or "smollm2-135m-instruct"
    engine = load(args, 4, args.input_len + args.decode_steps + 48, block_size=64,
                  max_num_batched_tokens=None).engine
    add_and_prefill(engine, "r", random_prompts(engine, 1, args.input_len, seed=0), decoding(args.decode_steps + 16))
    for _ in range(5):
        engine.step()
    parts = StepParts(engine, clock, attention=False)
    with parts.counting_ops():
        steps = [timed(engine.step, clock) for _ in range(args.decode_steps)]
    per = {k: v / len(steps) * 1e3 for k, v in parts.take().items()}
    ops = {k[3:]: v for k, v in per.items() if k.startswith("op:")}
    groups = {"stack": STACK_OPS, "dense": DENSE_OPS, "norms": NORM_OPS}
    ms = {g: sum(v for k, v in ops.items() if k in names) for g, names in groups.items()}
    ms["attention"] = sum(v for k, v in ops.items() if "attention" in k)
    ms["other_ops"] = sum(ops.values()) - sum(ms.values())
    ms["step"], ms["step_median"] = float(np.mean(steps)) * 1e3, median(steps) * 1e3
    ms["host"] = ms["step"] - sum(ops.values())
    flags = {k: os.environ[k] for k in ("FD_CPU_INT8_ACTIVATIONS", "FD_CPU_FUSED_LAYERS", "FD_CPU_GGUF_BLOCKS")
             if k in os.environ}
    limit = decode_roofline(engine, args.input_len + 5 + len(steps) // 2, cpu_kernels.memory_read_gbs())
    print(f"{args.model}, 1 request, {args.input_len} prompt tokens, {len(steps)} decode steps, clock {args.clock}, "
          f"flags {flags or 'default'}, load average {os.getloadavg()[0]:.1f}\n{cpu_kernels.describe()}")
    print(f"step mean {ms['step']:.2f} ms (median {ms['step_median']:.2f} ms, {1e3 / ms['step']:.1f} tok/s); "
          f"roofline {limit['roofline_tok_per_s']:.1f} tok/s ({(limit['weight_bytes'] + limit['kv_bytes']) / 1e6:.1f} MB "
          f"a token at {limit['read_bandwidth_gbs']:.1f} GB/s read): {1e3 / ms['step_median'] / limit['roofline_tok_per_s']:.0%} "
          "of it (median step)")
    if ms["stack"]:
        print(f"  every layer in one op (dense products, attention, norms) {ms['stack']:6.2f} ms")
    print(f"  dense products (weights) {ms['dense']:6.2f} ms   attention {ms['attention']:6.2f} ms   norms + "
          f"activation {ms['norms']:6.2f} ms   other ops {ms['other_ops']:6.2f} ms")
    print(f"  host (outside ops)       {ms['host']:6.2f} ms, of which: "
          + ", ".join(f"{p} {per[p]:.2f}" for p in StepParts.HOST if per[p])
          + f"; forward's Python {per['forward'] - sum(ops.values()):.2f}")
    print("  ops per step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
    return {"model": args.model, "clock": args.clock, "flags": flags, "steps": len(steps), "ms": ms,
            "host_parts_ms": {p: per[p] for p in StepParts.HOST}, "ops_ms": ops, "cpu": cpu_kernels.cpu_name(),
            "kernels": cpu_kernels.kernel_isas(), **limit,
            "roofline_fraction": 1e3 / ms["step_median"] / limit["roofline_tok_per_s"]}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1],
                    help="one engine per size, each at every --concurrency (paddle.distributed ranks, gloo on CPU)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy",
                                                         "smollm2-shaped-random"))
    ap.add_argument("--model", help="a model name, directory or GGUF file instead of the random SmolLM2-shaped one")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--kv-cache-quant-types", nargs="+", default=None,
                    choices=["none", "int8", "block_wise_fp8", "block_wise_int4"],
                    help="compare decode steps over these KV page formats (one engine each, steps interleaved)")
    ap.add_argument("--decode-steps", "--steps", type=int, default=None,
                    help="timed decode steps per arm (default 24; --step-breakdown: 100)")
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30,
                    help="KV bytes of each engine (formats)")
    ap.add_argument("--head-wise-ab", action="store_true",
                    help="FD_HEAD_WISE_KV_CACHE=0 vs 1 on the same prompts, decode steps interleaved, with each "
                         "step's host parts, at every --concurrency and --input-lens")
    ap.add_argument("--repeats", type=int, default=50, help="--head-wise-ab: reruns of each repeatable host part")
    ap.add_argument("--input-lens", type=int, nargs="+", default=[128, 3000],
                    help="prompt lengths (contexts) of --head-wise-ab")
    ap.add_argument("--step-breakdown", action="store_true",
                    help="one request's decode step split into host, dense products, attention and norms "
                         "(--model default: smollm2-135m-instruct)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="--step-breakdown: wall time, or the main thread's CPU time (pin to one core to count "
                         "all the work)")
    args = ap.parse_args(argv)
    if args.decode_steps is None:
        args.decode_steps = 100 if args.step_breakdown else 24
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    mode = step_breakdown if args.step_breakdown else head_wise_ab if args.head_wise_ab else \
        decode_steps_by_format if args.kv_cache_quant_types else generate_by_concurrency
    write_json(args.json, mode(args))


if __name__ == "__main__":
    main()
