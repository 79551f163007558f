"""How much accuracy sliding KV heads cost: `python benchmarks/eval_swa_quality.py --model M --configs FILE`.

For every SWA configuration (a `head_wise_swa` section: one list of KV heads, one list per layer,
uneven counts too; null = full attention) this runs the engine and reports, against full attention:

- KL(full || config) and top-1 agreement of the next-token distributions on held-out text
  (pydoc_data.topics, the part the head finder never saw), bucketed by position — below
  sink + window both must be exactly 0 / 100%, a check of the whole path;
- perplexity on the same text;
- synthetic retrieval over context length x depth: a pass key in repeated filler, and several
  keys (door codes) in prose of which one is asked for — in the filler prose written here
  ("multikey") or in pydoc_data's reference text ("multikey-docs"); fixed seeds, the model's chat
  template, the answer's first words given after the generation prompt;
- greedy chat continuations (`--parts chat`): CHAT_PROMPTS in the model's chat template, each
  config's greedy tokens against the first config's (the float32 full-attention run);
- the page-need ceiling at the evaluated lengths, at the prefill peak and once decoding (the engine's
  own slot layout and cache_manager/head_wise.py PageLayout, every sliding type recycling).

Which path runs a configuration: full attention on the 1-D paged path (APPEND_ATTN); a servable
configuration (the same count in every layer) on the head-wise paged path with recycling ON
(FD_HEAD_WISE_KV_CACHE=1, APPEND_ATTN); one the engine cannot serve (uneven counts) on the dense
reference with per-(layer, head) masks (NATIVE_ATTN), compared with a full-attention run on that same
backend. Results are written to --json after every configuration; a rerun skips the finished ones.

The configs file is a JSON list of {"name": ..., "head_wise_swa": {...} or null}, or `--standard
FINDER_JSON` builds the table of docs/swa_quality.md from a find_swa_heads output. A config may
also name `"kv_cache_quant_type"` (int8 / block_wise_fp8 / block_wise_int4: quantized KV pages, compared
with the same float32 full-attention reference; `--kv-cache-quant-type` sets it for configs that do
not), `"kv_quant_rotation": false` (int8 / int4 keys stored without their Hadamard rotation,
FD_KV_QUANT_ROTATION=0: what the rotation buys), `"kv_quant_value_rotation": true` (values rotated
too, FD_KV_QUANT_ROTATE_VALUES=1) and
`"head_wise_kv_cache": true` for a full-attention config on head-wise pages (a model's own sliding
layers then recycle through slots: Gemma 3). Quantized rows report `kv_pages_x`: the pages the same
KV memory holds against float32 pages, times the page-need ceiling.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastdeploy.model_executor.layers.quantization import kv_cache as kv_quant  # noqa: E402
from fastdeploy.tools import swa_patterns  # noqa: E402
from fastdeploy.tools.calibration_text import held_out_text, token_segments  # noqa: E402

CHUNK = 512  # prefill chunk: bounds the per-step logits matrix (chunk x vocab float32)
# A result row's page variant where a file written before the key existed lacks it.
DEFAULT_VARIANT = {"kv_cache_quant_type": "none", "kv_quant_rotation": True, "kv_quant_value_rotation": False}


def log(msg: str) -> None:
    print(f"[eval_swa_quality {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- configurations ----------------------------------------------------------------------------
def standard_configs(finder_json: str, num_layers: int, num_kv: int, random_seeds=(0, 1, 2)) -> list:
    """none, the fixture (head 0 everywhere), each single head, random per-layer choices, the finder's
    choice at 1 and 2 heads per layer (every scorer), and the global-ranking variants."""
    doc = json.load(open(finder_json))
    w, s = doc["window"], doc["sink"]

    def cfg(name, layers):
        return {"name": name, "head_wise_swa": swa_patterns.section(layers, w, s)}

    out = [{"name": "full", "head_wise_swa": None}]
    out += [cfg(f"head {h} everywhere" + (" (fixture)" if h == 0 else ""), [[h]] * num_layers) for h in range(num_kv)]
    out += [cfg(f"random seed {seed}", swa_patterns.random_per_layer(num_layers, num_kv, 1, seed))
            for seed in random_seeds]
    for k in (1, 2):
        for name, scores in doc["scores"].items():
            scores = np.array(scores)
            out.append(cfg(f"finder {name} k={k}", swa_patterns.lowest_per_layer(scores, k)))
            out.append(cfg(f"global {name} k={k}", swa_patterns.lowest_global(scores, k * num_layers)))
    out += [cfg(f"random seed {seed} k=2", swa_patterns.random_per_layer(num_layers, num_kv, 2, seed))
            for seed in random_seeds]
    return out


def exact_span(spec: dict, num_layers: int, num_kv: int) -> int:
    """Positions below which every sliding head still sees every key: the smallest window + sink of the
    spec's sliding heads (each head's own with per-head windows)."""
    from fastdeploy.config import HeadWiseSWAConfig

    parsed = HeadWiseSWAConfig.from_dict(spec, num_kv, num_layers)
    return min(sum(parsed.head_type(layer, h)) for layer in range(num_layers) for h in parsed.heads_of_layer(layer))


def path_of(spec, num_layers: int) -> str:
    """Every SWA configuration is tried on the paged path (slots and lanes serve uneven per-layer sets
    too); build_llm falls back to the masked dense reference for a spec the engine refuses."""
    return "full" if spec is None else "paged"


def build_llm(model: str, spec, path: str, max_model_len: int, prefix_caching: bool, max_num_seqs: int = 1,
              quant: str = "none", head_wise: bool = False, rotation: bool = True, value_rotation: bool = False,
              kv_cache_memory=None):
    """The engine for one configuration. A servable per-layer spec the engine does not accept yet
    falls back to the masked dense reference (returned path says which ran). `quant`: the KV page
    format (kv_cache_quant_type); `head_wise`: full attention on head-wise pages; `rotation=False`:
    int8 / int4 keys stored unrotated (FD_KV_QUANT_ROTATION=0, a CPU-op measurement knob);
    `value_rotation=True`: values stored rotated too (FD_KV_QUANT_ROTATE_VALUES=1, the same kind)."""
    from fastdeploy import LLM
    from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import set_cpu_options
    from fastdeploy.tools.probed_attention import install

    common = dict(model=model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=CHUNK, enable_prefix_caching=prefix_caching, kv_cache_memory=kv_cache_memory)
    set_cpu_options(kv_key_rotation=rotation, kv_value_rotation=value_rotation)
    if quant != "none":
        if path in ("native", "native-full"):
            raise ValueError("quantized KV pages need the paged path; this config runs on NATIVE_ATTN")
        common["kv_cache_quant_type"] = quant
    if path == "paged":
        os.environ.update(FD_HEAD_WISE_KV_CACHE="1", FD_HEAD_WISE_SWA_RECYCLE="1", FD_ATTENTION_BACKEND="APPEND_ATTN")
        try:
            return LLM(head_wise_swa_config=spec, **common), "paged"
        except ValueError as exc:
            log(f"the engine cannot serve this spec ({exc}); evaluating it with NATIVE_ATTN masks")
            path = "native"
    native = path in ("native", "native-full")
    os.environ.update(FD_HEAD_WISE_KV_CACHE="1" if head_wise and not native else "0", FD_HEAD_WISE_SWA_RECYCLE="1",
                      FD_ATTENTION_BACKEND="NATIVE_ATTN" if native else "APPEND_ATTN")
    if native:
        common["enable_prefix_caching"] = False  # the dense reference keeps K/V per request
    llm = LLM(**common)
    if path in ("native", "native-full"):
        cfg = llm.engine.model_config
        layers = swa_patterns.per_layer(spec["swa_kv_heads"], cfg.num_hidden_layers) if spec else \
            [[] for _ in range(cfg.num_hidden_layers)]
        install(llm, swa_patterns.masks(layers, cfg.num_key_value_heads),
                spec["sliding_window"] if spec else 1, spec["sink_size"] if spec else 0)
    return llm, path


# -- held-out text -----------------------------------------------------------------------------
def buckets_for(num_tokens: int, exact_below: int) -> list:
    edges = sorted({0, exact_below, *[e for e in (1024, 2048, 4096, 8192) if e < num_tokens], num_tokens})
    return [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


def text_logprobs(llm, segment: list) -> np.ndarray:
    from fastdeploy.tools.prompt_logits import full_prompt_logprobs

    return full_prompt_logprobs(llm, segment)


def text_metrics(logprobs: list, segments: list, reference: list, exact_below: int) -> dict:
    """Per bucket: mean KL(ref || this) and top-1 agreement; perplexity over all positions; and the check
    that below `exact_below` the log-probs equal the reference's bit for bit."""
    from fastdeploy.tools.head_scores import kl_rows

    kl = np.stack([kl_rows(r, lp) for r, lp in zip(reference, logprobs)])
    agree = np.stack([lp.argmax(-1) == r.argmax(-1) for r, lp in zip(reference, logprobs)])
    nll = np.stack([-lp[np.arange(len(seg) - 1), np.asarray(seg[1:])] for seg, lp in zip(segments, logprobs)])
    n = kl.shape[1]
    diff_below = max(float(np.abs(lp[:exact_below] - r[:exact_below]).max()) if exact_below else 0.0
                     for r, lp in zip(reference, logprobs))
    buckets = [{"positions": [a, b], "kl": float(kl[:, a:b].mean()), "top1": float(agree[:, a:b].mean())}
               for a, b in buckets_for(n, exact_below)]
    past = slice(min(exact_below, n - 1), None)
    return {"buckets": buckets, "kl_mean_past_window": float(kl[:, past].mean()),
            "top1_past_window": float(agree[:, past].mean()),
            "perplexity": float(np.exp(nll.mean())), "perplexity_past_window": float(np.exp(nll[:, past].mean())),
            "max_abs_logprob_diff_below_window": diff_below,
            "exact_below_window": bool(exact_below and diff_below == 0.0 and kl[:, :exact_below].max() == 0.0
                                       and agree[:, :exact_below].all())}


def below_window_check(text: dict, permuted_heads: bool, quantized: bool = False) -> str:
    """exact: bit for bit as full attention below sink + window. rounding: the engine permuted KV heads
    at load (per-layer SWA heads moved to shared slots), which reorders o_proj's sum, so log-probs
    there differ in the last bits (top-1 must still agree everywhere). FAIL: anything else.
    Quantized pages differ from float32 pages everywhere: nothing to check (n/a)."""
    if quantized:
        return "n/a (quantized pages)"
    if text["exact_below_window"]:
        return "exact"
    below = text["buckets"][0]
    if permuted_heads and below["top1"] == 1.0 and text["max_abs_logprob_diff_below_window"] < 1e-3:
        return "rounding (permuted heads)"
    return "FAIL"


# -- retrieval ---------------------------------------------------------------------------------
def retrieval_metrics(llm, prompts: list) -> list:
    """Found / total per cell (variant, chat or plain, length, depth; a random depth by its band), with the
    first words the model answered."""
    from fastdeploy import SamplingParams
    from fastdeploy.tools.retrieval_tasks import RANDOM_DEPTH, depth_band, found

    outs = llm.generate([p["ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    cells: dict = {}
    for p, out in zip(prompts, outs):
        depth = depth_band(p["asked_depth"]) if p["depth"] == RANDOM_DEPTH else p["depth"]
        cell = cells.setdefault((p["variant"], p["chat"], p["length"], depth), {"found": 0, "total": 0, "texts": []})
        cell["found"] += int(found(p["answer"], out.outputs.text))
        cell["total"] += 1
        cell["texts"].append(out.outputs.text.strip()[:40])
    return [{"variant": v, "chat": c, "length": n, "depth": d, **cell} for (v, c, n, d), cell in cells.items()]


# -- greedy chat -------------------------------------------------------------------------------
CHAT_PROMPTS = (
    "What is the capital of Italy? Answer in one sentence.",
    "Write two lines of a poem about autumn leaves.",
    "Explain in simple words why the sky looks blue.",
    "Give three tips for learning a new language.",
    "What is 17 times 6? Show the steps.",
    "Name four planets of the solar system.",
    "Describe a cat to someone who has never seen one.",
    "What does a compiler do? Keep it short.",
    "Suggest a name for a small bakery by the sea.",
    "How do plants make their food?",
    "Write a short thank-you note to a neighbour who watered my garden.",
    "What is the difference between weather and climate?",
    "List three things to pack for a day hike.",
    "Why do we have leap years?",
    "Translate 'thank you very much' into French.",
    "What is a prime number? Give two examples.",
    "Tell me a fun fact about octopuses.",
    "How should I store fresh basil?",
    "Summarize the story of Little Red Riding Hood in two sentences.",
    "What are the three states of water?",
    "Give a one-sentence definition of democracy.",
    "What is the boiling point of water at sea level in Celsius?",
    "Write a polite reply declining a meeting invitation.",
    "Why is exercise good for the heart?",
)


def chat_outputs(llm, max_tokens: int) -> list:
    from fastdeploy import SamplingParams

    outs = llm.chat([[{"role": "user", "content": c}] for c in CHAT_PROMPTS],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs.token_ids) for o in outs]


def chat_metrics(outputs: list, reference: list) -> dict:
    """Prompts whose greedy tokens equal the reference's, and the mean share of tokens before the first
    difference."""
    def agreed(a, b):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(len(b), 1)

    equal = sum(a == b for a, b in zip(outputs, reference))
    return {"equal": equal, "prompts": len(reference),
            "mean_prefix_agreement": float(np.mean([agreed(a, b) for a, b in zip(outputs, reference)]))}


# -- memory ------------------------------------------------------------------------------------
def page_need_layouts(spec, num_layers: int, num_kv: int, block_size: int, layer_windows=None) -> tuple:
    """(recycling off, recycling on) page layouts of a spec on one rank, as the engine lays it out: the
    attention type of every (layer, KV head) pair (its own window where the spec gives one, the model's
    sliding layers included), the slot layout of those types, every sliding type recycling with its own
    window and sink."""
    from dataclasses import replace

    from fastdeploy.cache_manager.head_wise import PageLayout
    from fastdeploy.cache_manager.slots import assign_slots
    from fastdeploy.config import HeadWiseSWAConfig
    from fastdeploy.model_executor.layers.attention.swa_spec import type_table

    parsed = HeadWiseSWAConfig.from_dict(spec, num_kv, num_layers) if spec is not None else None
    slots = assign_slots(type_table(num_layers, num_kv, layer_windows, parsed), 1)
    groups = slots.sliding_groups()
    on = PageLayout(block_size, slots.num_slots, 1, recycle=bool(groups), sliding=groups)
    return replace(on, recycle=False), on


DECODE_TOKENS = 128  # the output of a request of n tokens, whose decode the decode ceiling covers


def page_need_ceiling(spec, num_layers: int, num_kv: int, lengths, block_size: int, at: str = "prefill",
                      layer_windows=None) -> dict:
    """Pages one request of each length holds with full attention / with this config's recycling.

    at="prefill": the peak of its life with one output token, i.e. the end of its last prefill chunk of
    CHUNK tokens (where a chunk's transient holds window + chunk tokens in every sliding slot);
    at="decode": the most it holds at any step of its decode, n - DECODE_TOKENS prompt tokens and
    DECODE_TOKENS output tokens (sink + window per sliding slot; a window's count peaks before the last
    step as it crosses block edges)."""
    off, on = page_need_layouts(spec, num_layers, num_kv, block_size, layer_windows)
    if at == "prefill":
        return {str(n): off.peak_pages_per_rank(n, 1, CHUNK)[0] / on.peak_pages_per_rank(n, 1, CHUNK)[0]
                for n in lengths}
    if at == "decode":
        def peak(layout, n):
            return max(layout.pages_per_rank(t, 1)[0] for t in range(max(0, n - DECODE_TOKENS), n))

        return {str(n): peak(off, n) / peak(on, n) for n in lengths}
    raise ValueError(f"page_need_ceiling: at must be 'prefill' or 'decode', got {at!r}")


# -- driver ------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model directory or name (default: the tiny preset)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--configs", help="JSON list of {name, head_wise_swa}")
    g.add_argument("--standard", metavar="FINDER_JSON", help="the standard table from a find_swa_heads output")
    g.add_argument("--table", nargs="+", metavar="RESULTS_JSON", help="only print the table of result files")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="write KL past the window against the page-need ceiling (at the longest length) here")
    p.add_argument("--kl-from", type=int, default=0,
                   help="--table: KL and top-1 over the positions from this one on (the same positions for every "
                        "configuration; default: each configuration's own past-the-window positions)")
    p.add_argument("--only", default=None, help="comma-separated config names to run (default: all)")
    p.add_argument("--json", default=None, help="results file (rewritten after each config; reruns resume)")
    p.add_argument("--text-segments", type=int, default=2)
    p.add_argument("--segment-tokens", type=int, default=2048)
    p.add_argument("--lengths", default="1024,2048,4096", help="retrieval context lengths")
    p.add_argument("--split", choices=("evaluation", "calibration"), default="evaluation",
                   help="retrieval tasks (fastdeploy/tools/retrieval_tasks.py): the held-out evaluation split, or the "
                        "calibration split configurations may be chosen on")
    p.add_argument("--depths", default="0.05,0.25,0.5,0.75,0.95",
                   help="depths of the asked needle, or 'random' (uniform in 0.05-0.95, reported by band)")
    p.add_argument("--variants", default=None,
                   help="retrieval variants (default: the split's all: magic,accesskey / passkey,multikey)")
    p.add_argument("--forms", default="chat", help="chat, plain (completion without the chat template), or both")
    p.add_argument("--trials", type=int, default=1, help="prompts per retrieval cell")
    p.add_argument("--retrieval", default=None,
                   help="comma-separated config names that also run retrieval (default: all)")
    p.add_argument("--parts", default="text,retrieval", help="what to measure: text, retrieval, chat")
    p.add_argument("--chat-tokens", type=int, default=48, help="greedy tokens per chat prompt (--parts chat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=4, help="retrieval prompts in flight at once")
    p.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                   help="KV memory per engine (default: the engine's); 8k-token prompts at full attention in "
                        "float32 need ~380 MB each in flight on SmolLM2")
    p.add_argument("--kv-cache-quant-type", default="none",
                   choices=list(kv_quant.KV_CACHE_QUANT_TYPES),
                   help="KV page format of configs that name none (the reference stays float32 pages)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.table:
        lengths = [int(x) for x in args.lengths.split(",") if x]
        rows = merged(args.table)
        if args.model:  # the ceilings are arithmetic on each row's spec: recomputed at --lengths
            recompute_ceilings(rows, args.model, lengths, args.block_size)
        print_table(rows, lengths, args.kl_from)
        if args.plot:
            plot_tradeoff(rows, lengths[-1], args.plot, args.kl_from)
        return 0
    from fastdeploy.config import ModelConfig

    mc = ModelConfig.create(args.model, None, None)
    num_layers, num_kv = mc.num_hidden_layers, mc.num_key_value_heads
    configs = standard_configs(args.standard, num_layers, num_kv) if args.standard else json.load(open(args.configs))
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c["name"] in wanted]
    lengths = [int(x) for x in args.lengths.split(",") if x]
    from fastdeploy.tools.retrieval_tasks import RANDOM_DEPTH, VARIANTS, RetrievalTask

    depths = [x if x == RANDOM_DEPTH else float(x) for x in args.depths.split(",") if x]
    variants = [v for v in args.variants.split(",") if v] if args.variants else list(VARIANTS[args.split])
    chat_forms = [{"chat": True, "plain": False}[f] for f in args.forms.split(",") if f]
    parts = set(args.parts.split(","))
    with_retrieval = None if args.retrieval is None else set(args.retrieval.split(",")) | {"full"}
    results = json.load(open(args.json)) if args.json and os.path.exists(args.json) else {}
    settings = {"parts": sorted(parts), "segments": args.text_segments, "segment_tokens": args.segment_tokens, "lengths": lengths,
                "split": args.split, "depths": depths, "variants": variants, "forms": args.forms, "trials": args.trials,
                "seed": args.seed}
    if "chat" in parts:
        settings["chat_tokens"] = args.chat_tokens
    if results.get("settings", settings) != settings:
        log(f"{args.json} holds results of other settings; starting it afresh")
        results = {}
    results["settings"], results["model"] = settings, args.model
    done = results.setdefault("configs", {})
    max_len = max(lengths + [args.segment_tokens]) + 16

    from fastdeploy.input.tokenizer_loader import load_tokenizer

    tokenizer = load_tokenizer(mc)
    segments = token_segments(tokenizer, held_out_text(), args.segment_tokens, args.text_segments)
    prompts = RetrievalTask(tokenizer, args.split).prompts(variants, lengths, depths, args.trials, args.seed,
                                                           chat_forms) if "retrieval" in parts else []
    log(f"{len(configs)} configs; {args.text_segments} x {args.segment_tokens} held-out tokens; "
        f"{len(prompts)} retrieval prompts ({sum(len(p['ids']) for p in prompts)} tokens)")
    references: dict = {}

    def reference(path: str) -> list:
        """Full-attention log-probs of the held-out segments on the backend `path` compares with."""
        key = "native-full" if path == "native" else "full"
        if key not in references:
            t0 = time.time()
            llm, _ = build_llm(args.model, None, key, max_len, prefix_caching=False,
                               kv_cache_memory=args.kv_cache_memory)
            references[key] = [text_logprobs(llm, seg) for seg in segments]
            llm.engine.close()
            log(f"reference ({key}) log-probs in {time.time() - t0:.0f} s")
        return references[key]

    for c in configs:
        name, spec = c["name"], c["head_wise_swa"]
        variant = {"kv_cache_quant_type": c.get("kv_cache_quant_type", args.kv_cache_quant_type),
                   "head_wise_kv_cache": bool(c.get("head_wise_kv_cache", False)),
                   "kv_quant_rotation": bool(c.get("kv_quant_rotation", True)),
                   "kv_quant_value_rotation": bool(c.get("kv_quant_value_rotation", False))}
        quant, head_wise = variant["kv_cache_quant_type"], variant["head_wise_kv_cache"]
        if name in done and all(done[name].get(k, DEFAULT_VARIANT.get(k)) == v for k, v in
                                {"head_wise_swa": spec, **variant}.items() if k != "head_wise_kv_cache"):
            log(f"{name}: done already")
            continue
        t0 = time.time()
        path = path_of(spec, num_layers)
        exact_below = 0 if quant != "none" else exact_span(spec, num_layers, num_kv) if spec else args.segment_tokens
        row = {"head_wise_swa": spec, "path": path, **variant}
        build = functools.partial(build_llm, args.model, spec, max_model_len=max_len, quant=quant, head_wise=head_wise,
                                  kv_cache_memory=args.kv_cache_memory,
                                  rotation=variant["kv_quant_rotation"],
                                  value_rotation=variant["kv_quant_value_rotation"])
        is_reference = spec is None and quant == "none" and not head_wise
        llm, ran = build(path=path, prefix_caching=False) if not is_reference and "text" in parts else (None, path)
        row["path"] = ran
        if "text" in parts:
            if is_reference:
                lps = reference("full")
            else:
                lps = [text_logprobs(llm, seg) for seg in segments]
            row["text"] = text_metrics(lps, segments, reference(ran), exact_below)
            permuted = llm is not None and llm.engine.model_config.kv_head_orders is not None
            row["text"]["below_window_check"] = below_window_check(row["text"], permuted, quant != "none")
            del lps
        if llm is not None:
            llm.engine.close()
        if "chat" in parts:
            llm, ran = build(path=ran, prefix_caching=True, max_num_seqs=8)
            row["chat_outputs"] = chat_outputs(llm, args.chat_tokens)
            llm.engine.close()
            first = next(iter(done.values()), row)  # the first config's (float32 full attention) outputs
            row["chat"] = chat_metrics(row["chat_outputs"], first.get("chat_outputs", row["chat_outputs"]))
            log(f"{name}: greedy chat {row['chat']['equal']}/{row['chat']['prompts']} prompts equal to "
                f"{next(iter(done), name)}'s, mean agreement {row['chat']['mean_prefix_agreement']:.3f}")
        if "retrieval" in parts and (with_retrieval is None or name in with_retrieval):
            llm, ran = build(path=ran, prefix_caching=True, max_num_seqs=args.max_num_seqs)
            row["path"] = ran
            row["retrieval"] = retrieval_metrics(llm, prompts)
            llm.engine.close()
        row["page_need_ceiling"] = page_need_ceiling(spec, num_layers, num_kv, lengths, args.block_size,
                                                     layer_windows=mc.layer_sliding_window)
        row["page_need_ceiling_decode"] = page_need_ceiling(spec, num_layers, num_kv, lengths, args.block_size,
                                                            at="decode", layer_windows=mc.layer_sliding_window)
        if quant != "none":  # the same KV memory holds this many times float32's pages
            ratio = kv_quant.kv_row_bytes("none", 4, mc.head_dim) / kv_quant.kv_row_bytes(quant, 4, mc.head_dim)
            row["kv_pages_x"] = {n: round(ratio * c, 3) for n, c in row["page_need_ceiling"].items()}
        row["seconds"] = round(time.time() - t0, 1)
        done[name] = row
        t = row.get("text") or {"kl_mean_past_window": float("nan"), "top1_past_window": float("nan"),
                                "perplexity": float("nan"), "exact_below_window": None,
                                "max_abs_logprob_diff_below_window": float("nan")}
        found = sum(r["found"] for r in row.get("retrieval", []))
        total = sum(r["total"] for r in row.get("retrieval", []))
        log(f"{name} [{ran}]: KL {t['kl_mean_past_window']:.4f} top1 {t['top1_past_window']:.3f} "
            f"ppl {t['perplexity']:.3f} exact-below-window {t['exact_below_window']} "
            f"(max |diff| {t['max_abs_logprob_diff_below_window']:.2e}) retrieval {found}/{total} "
            f"ceiling@{lengths[-1]} {row['page_need_ceiling'][str(lengths[-1])]:.2f} prefill / "
            f"{row['page_need_ceiling_decode'][str(lengths[-1])]:.2f} decoding ({row['seconds']} s)")
        if spec is not None and t.get("below_window_check") == "FAIL":
            log(f"WARNING {name}: positions below sink + window differ from full attention")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print_table(results["configs"], lengths)
    if args.plot:
        plot_tradeoff(results["configs"], lengths[-1], args.plot)
    return 0


def merged(files: list) -> dict:
    """Rows of several result files (e.g. text and retrieval run in parallel), joined by config name."""
    rows: dict = {}
    for path in files:
        doc = json.load(open(path))
        # A result file of this script keeps its rows under "configs"; a merged file (docs/) is the rows.
        for name, row in doc.get("configs", doc).items():
            into = rows.setdefault(name, {})
            for k, v in row.items():
                if k == "retrieval" and v:
                    into.setdefault("retrieval", []).extend(v)
                elif v is not None:
                    into[k] = v
    return rows


def recompute_ceilings(rows: dict, model: str, lengths: list, block_size: int) -> None:
    """Both page-need ceilings of every row at `lengths`, from its spec and the model's shape."""
    from fastdeploy.config import ModelConfig

    mc = ModelConfig.create(model, None, None)
    for r in rows.values():
        spec = r.get("head_wise_swa")
        for key, at in (("page_need_ceiling", "prefill"), ("page_need_ceiling_decode", "decode")):
            r[key] = page_need_ceiling(spec, mc.num_hidden_layers, mc.num_key_value_heads, lengths, block_size,
                                       at=at, layer_windows=mc.layer_sliding_window) \
                if spec or mc.layer_sliding_window else {str(n): 1.0 for n in lengths}


def text_from(text: dict, first: int) -> tuple:
    """(KL, top-1) over the position buckets that start at `first` or later, weighted by their lengths:
    the same positions for configurations whose windows differ."""
    picked = [b for b in text["buckets"] if b["positions"][0] >= first]
    n = sum(b["positions"][1] - b["positions"][0] for b in picked)
    if not n:
        return float("nan"), float("nan")
    weight = [(b["positions"][1] - b["positions"][0]) / n for b in picked]
    return (sum(w * b["kl"] for w, b in zip(weight, picked)), sum(w * b["top1"] for w, b in zip(weight, picked)))


def print_table(rows: dict, lengths: list, kl_from: int = 0) -> None:
    past = f"from position {kl_from}" if kl_from else "past window"
    print(f"| config | path | KL {past} | top-1 {past} | ppl | below sink + window | retrieval found | "
          + " | ".join(f"ceiling@{n} prefill / decode" for n in lengths) + " |")
    print("|---" * (7 + len(lengths)) + "|")
    for name, r in rows.items():
        t = r.get("text")
        kl, top1 = text_from(t, kl_from) if t and kl_from else \
            (t["kl_mean_past_window"], t["top1_past_window"]) if t else (None, None)
        cells = [f"{kl:.4f}", f"{top1:.3f}", f"{t['perplexity']:.3f}",
                 t.get("below_window_check", "exact" if t["exact_below_window"] else "FAIL")] if t else ["-"] * 4
        ret = r.get("retrieval")
        found = f"{sum(x['found'] for x in ret)}/{sum(x['total'] for x in ret)}" if ret else "-"
        ceil, dec = r.get("page_need_ceiling", {}), r.get("page_need_ceiling_decode", {})
        print(f"| {name} | {r['path']} | " + " | ".join(cells) + f" | {found} | "
              + " | ".join((f"{ceil[str(n)]:.2f}" if str(n) in ceil else "-") + " / "
                           + (f"{dec[str(n)]:.2f}" if str(n) in dec else "-") for n in lengths) + " |")
    print_retrieval(rows)


def print_retrieval(rows: dict) -> None:
    """Per retrieval variant and form: found / prompts of every configuration at each length x depth (a
    random depth by its band), then over all of them."""
    forms = sorted({(x["variant"], x.get("chat", True)) for r in rows.values() for x in r.get("retrieval", [])})
    for variant, chat in forms:
        mine = lambda r: [x for x in r.get("retrieval", []) if (x["variant"], x.get("chat", True)) == (variant, chat)]  # noqa: E731
        cells = sorted({(x["length"], str(x["depth"])) for r in rows.values() for x in mine(r)})
        print(f"\n| {variant}, {'chat' if chat else 'plain'}: found/prompts | "
              + " | ".join(f"{n} @ {d}" for n, d in cells) + " | all |")
        print("|---" * (2 + len(cells)) + "|")
        for name, r in rows.items():
            got = {}
            for x in mine(r):
                f, t = got.get((x["length"], str(x["depth"])), (0, 0))
                got[(x["length"], str(x["depth"]))] = (f + x["found"], t + x["total"])
            if got:
                every = [sum(v[k] for v in got.values()) for k in (0, 1)]
                print(f"| {name} | " + " | ".join(f"{got[c][0]}/{got[c][1]}" if c in got else "-" for c in cells)
                      + f" | {every[0]}/{every[1]} |")
    print_retrieval_margins(rows)


def print_retrieval_margins(rows: dict) -> None:
    """Every variant and form together: found / prompts of each configuration per length and per depth
    (band), the margins where a configuration's first failures show."""
    def axis_totals(r, axis):
        got = {}
        for x in r.get("retrieval", []):
            f, t = got.get(str(x[axis]), (0, 0))
            got[str(x[axis])] = (f + x["found"], t + x["total"])
        return got

    with_retrieval = {name: r for name, r in rows.items() if r.get("retrieval")}
    if not with_retrieval:
        return
    keys = {axis: sorted({k for r in with_retrieval.values() for k in axis_totals(r, axis)},
                         key=lambda k: (float(k.split("-")[0]), k)) for axis in ("length", "depth")}
    print("\n| all variants: found/prompts | " + " | ".join(f"{k} tokens" for k in keys["length"]) + " | "
          + " | ".join(f"depth {k}" for k in keys["depth"]) + " |")
    print("|---" * (1 + len(keys["length"]) + len(keys["depth"])) + "|")
    for name, r in with_retrieval.items():
        cells = [axis_totals(r, axis).get(k) for axis in ("length", "depth") for k in keys[axis]]
        print(f"| {name} | " + " | ".join(f"{c[0]}/{c[1]}" if c else "-" for c in cells) + " |")


def family(name: str) -> str:
    """How a configuration chose its sliding heads, from its name in the standard set."""
    for prefix, label in (("shipped", "shipped (calibrated file)"), ("global", "head finder, whole-model ranking"),
                          ("gates", "optimized gates (DuoAttention-style)"),
                          ("windows", "window menu (a window per head)"),
                          ("finder", "head finder, per layer"), ("random", "random per layer"),
                          ("head", "same head in every layer")):
        if name.startswith(prefix):
            return label
    return "full attention"


def plot_tradeoff(rows: dict, length: int, path: str, kl_from: int = 0) -> None:
    """Accuracy against memory: each configuration's KL past the window (left) and its retrieval (right,
    where it ran) at its page-need ceiling (x: how many more requests fit in the same pages at `length`
    tokens), one marker per way of choosing heads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ab_harness import save_figure

    styles = {"full attention": ("black", "s"), "same head in every layer": ("tab:gray", "o"),
              "random per layer": ("tab:brown", "x"), "head finder, per layer": ("tab:blue", "^"),
              "head finder, whole-model ranking": ("tab:orange", "v"), "shipped (calibrated file)": ("tab:red", "*"),
              "optimized gates (DuoAttention-style)": ("tab:purple", "D"),
              "window menu (a window per head)": ("tab:green", "P")}
    # once decoding where the rows carry it (the measure), else the prefill peak (older result files)
    key = "page_need_ceiling_decode" if all(r.get("page_need_ceiling_decode") for r in rows.values()) \
        else "page_need_ceiling"
    when = "once decoding" if key.endswith("decode") else "at the prefill peak"
    with_retrieval = any(r.get("retrieval") for r in rows.values())
    fig, axes = plt.subplots(1, 2 if with_retrieval else 1, figsize=(12 if with_retrieval else 7, 4), squeeze=False)
    kl_ax, ret_ax = axes[0][0], axes[0][-1]
    plotted = set()
    for name, r in rows.items():
        text, ceiling = r.get("text"), r.get(key, {}).get(str(length))
        if ceiling is None:
            continue
        fam = family(name)
        color, marker = styles[fam]
        style = dict(color=color, marker=marker, s=140 if marker == "*" else 40, zorder=3)
        label = None if fam in plotted else fam
        if text:
            kl = text_from(text, kl_from)[0] if kl_from else text["kl_mean_past_window"]
            kl_ax.scatter(ceiling, kl, label=label, **style)
            plotted.add(fam)
        if with_retrieval and r.get("retrieval"):
            found = sum(x["found"] for x in r["retrieval"]) / sum(x["total"] for x in r["retrieval"])
            ret_ax.scatter(ceiling, found, label=None if with_retrieval and text else label, **style)
            plotted.add(fam)
    kl_ax.set_xlabel(f"page-need ceiling at {length} tokens {when} (requests that fit ON / OFF)")
    kl_ax.set_ylabel(f"KL(full || config) from position {kl_from}" if kl_from else "KL(full || config) past the window")
    kl_ax.set_title("Which heads slide: accuracy (lower is better) against memory (right is better)", fontsize=10)
    kl_ax.grid(alpha=0.3)
    kl_ax.legend(fontsize=8, loc="upper left")
    if with_retrieval:
        ret_ax.set_xlabel(f"page-need ceiling at {length} tokens {when}")
        ret_ax.set_ylabel("retrieval prompts answered (share)")
        ret_ax.set_title("Retrieval (higher is better)", fontsize=10)
        ret_ax.grid(alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
