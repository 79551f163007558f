"""Optimize which KV heads can slide: `python -m fastdeploy.tools.optimize_swa_gates --model M --window W
--sink S --out FILE`.

DuoAttention's recipe on this engine's retention rule. Every (layer, KV head) gets a gate g in [0, 1]
mixing its full attention with its streaming attention (sink + window: gated_attention.py); the model's
weights stay frozen and the gates are trained so that the model's final hidden states on the answer of
synthetic long-context retrieval samples (gate_training_data.py) stay those of the full model, while an
L1 weight (`--l1`) pushes every gate towards streaming:

    loss = |H_gated - H_full|^2 / |H_full|^2 (answer rows)  +  l1 * mean(g)

A larger `--l1` drives more gates to 0 (the sparsity sweep). The gates then rank the heads: the lowest
fraction f slides. The output JSON has the gates, one servable `head_wise_swa` section per
`--fractions` entry (uneven per layer: the engine serves it on slots and lanes), the one for
`--fraction` as the file's own `head_wise_swa`, and the loss history.

It runs transformers on torch over the same file the engine serves (GGUF or a Hugging Face directory):
the engine's CPU ops have no backward pass and Paddle's autograd has no model here, while transformers
differentiates the very weights the engine reads (the engine's outputs equal transformers', tests/real_models).
Layers are recomputed in the backward pass (gradient checkpointing) so memory stays at one layer's
attention. Progress goes to stdout every step; `--checkpoint` (default: OUT.ckpt) is written every
`--save-every` steps and a run started again with the same arguments resumes from it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from fastdeploy.tools import json_tool, swa_patterns

DEFAULT_FRACTIONS = (1 / 3, 1 / 2, 2 / 3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="a named model, a .gguf file or a Hugging Face model directory")
    p.add_argument("--window", type=int, required=True, help="sliding window W in tokens")
    p.add_argument("--sink", type=int, default=64, help="attention sink S in tokens")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps (one sample each)")
    p.add_argument("--seq-tokens", type=int, default=1536, help="tokens per training sample (> window + sink)")
    p.add_argument("--l1", type=float, default=0.05, help="weight of the push towards streaming (mean gate)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of the gates")
    p.add_argument("--fractions", default=",".join(f"{f:.4f}" for f in DEFAULT_FRACTIONS),
                   help="fractions of the gateable KV heads to slide, one section each")
    p.add_argument("--fraction", type=float, default=0.5, help="the fraction whose section is the file's head_wise_swa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: every CPU)")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the model's matmuls (bfloat16: torch CPU autocast, ~2x faster with AVX-512 bf16 / "
                        "AMX; the gates and the loss stay float32)")
    p.add_argument("--no-recompute", action="store_true",
                   help="keep every layer's activations for the backward pass instead of recomputing them "
                        "(one forward less per step; memory grows with --seq-tokens squared)")
    p.add_argument("--checkpoint", default=None, help="resumable state (default: OUT.ckpt)")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    return p.parse_args(argv)


def _model_path(model: str) -> str:
    from fastdeploy.model_executor.models.named_models import NAMED_MODELS, resolve

    if model in NAMED_MODELS:
        return resolve(model)
    if os.path.exists(model):
        return model
    raise ValueError(f"--model {model!r} is neither a named model ({', '.join(sorted(NAMED_MODELS))}) nor a path")


def _fractions(text: str) -> list:
    try:
        values = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        raise ValueError(f"--fractions {text!r} must be numbers separated by commas") from None
    if not values or any(not 0 < f <= 1 for f in values):
        raise ValueError(f"--fractions {text!r}: each must be in (0, 1]")
    return values


def _check(args) -> list:
    if args.window < 1 or args.sink < 0:
        raise ValueError("--window must be >= 1 and --sink >= 0")
    if args.seq_tokens <= args.window + args.sink:
        raise ValueError(f"--seq-tokens {args.seq_tokens} must exceed window + sink ({args.window + args.sink}): "
                         "shorter samples never reach a key a sliding head loses")
    if args.steps < 1 or args.l1 < 0 or args.lr <= 0:
        raise ValueError("--steps must be >= 1, --l1 >= 0 and --lr > 0")
    if not 0 < args.fraction <= 1:
        raise ValueError("--fraction must be in (0, 1]")
    return _fractions(args.fractions)


def sections(gates: np.ndarray, candidates: list, fractions, window: int, sink: int,
             mean_gates: np.ndarray = None) -> dict:
    """{fraction: head_wise_swa section}: the lowest-gate share of the candidate (layer, KV head) pairs.

    Many gates end clamped at 0 with the push to streaming; among equal gates the lower mean gate over the
    run (the head the optimizer let go of sooner) slides first, `mean_gates` (default: no tie-break)."""
    tie = np.zeros(gates.shape) if mean_gates is None else np.asarray(mean_gates, dtype=float)
    order = np.lexsort((tie.ravel(), gates.ravel()))  # by gate, then by mean gate
    rank = np.empty(gates.size)
    rank[order] = np.arange(gates.size)
    scores = np.full(gates.shape, np.inf)
    for layer, head in candidates:
        scores[layer, head] = rank.reshape(gates.shape)[layer, head]
    out = {}
    for f in fractions:
        count = max(1, int(round(f * len(candidates))))
        out[f"{f:.4f}"] = swa_patterns.section(swa_patterns.lowest_global(scores, count), window, sink)
    return out


def _hidden(model, ids):
    return model.model(input_ids=ids).last_hidden_state[0]


def optimize(args, log=print) -> dict:
    fractions = _check(args)
    import torch

    from fastdeploy.tools import gated_attention, transformers_model
    from fastdeploy.tools.gate_training_data import RetrievalSamples

    t0 = time.time()
    path = _model_path(args.model)
    tok, model = transformers_model.load(path, threads=args.threads)
    for p in model.parameters():
        p.requires_grad_(False)
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    gates = torch.nn.Parameter(torch.ones(layers, kv_heads))
    mixer = gated_attention.Gates(gates, args.window, args.sink)
    candidates = gated_attention.install(model, mixer)
    if not candidates:
        raise ValueError("every layer of this model already slides: there are no heads to gate")
    opt = torch.optim.Adam([gates], lr=args.lr)
    checkpoint = args.checkpoint or args.out + ".ckpt"
    settings = {k: getattr(args, k) for k in ("window", "sink", "seq_tokens", "l1", "lr", "seed", "compute_dtype")}
    settings["model"] = os.path.basename(path)
    history, step = [], 0
    gate_sum = torch.zeros_like(gates.data)  # the clamped gates summed over the steps: the tie-break
    if os.path.exists(checkpoint):
        state = torch.load(checkpoint, weights_only=False)
        if state["settings"] != settings:
            raise ValueError(f"{checkpoint} was written with other settings ({state['settings']}); "
                             "remove it or pass another --checkpoint")
        gates.data.copy_(state["gates"])
        opt.load_state_dict(state["optimizer"])
        history, step = state["history"], state["step"]
        gate_sum = state["gate_sum"]
        log(f"[optimize_swa_gates] resumed from {checkpoint} at step {step}")
    if not args.no_recompute:
        if hasattr(model.model, "activation_checkpointing_enable"):
            model.model.activation_checkpointing_enable({"use_reentrant": False})
        else:  # the older name
            model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.model.train()  # checkpointing only recomputes in training mode; the model has no dropout in use
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.compute_dtype == "bfloat16")
    samples = RetrievalSamples(tok, args.seq_tokens)
    log(f"[optimize_swa_gates] {os.path.basename(path)}: {layers} layers x {kv_heads} KV heads, "
        f"{len(candidates)} gateable; window {args.window}, sink {args.sink}; {args.steps} steps of "
        f"{args.seq_tokens}-token samples, l1 {args.l1} (loaded in {time.time() - t0:.0f} s)")

    def save():
        torch.save({"settings": settings, "gates": gates.data.clone(), "optimizer": opt.state_dict(),
                    "history": history, "step": step, "gate_sum": gate_sum},
                   checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)

    started = time.time()
    first_step = step
    while step < args.steps:
        rng = np.random.default_rng([args.seed, step])  # step-keyed: a resumed run sees the same samples
        sample = samples.sample(rng)
        ids = torch.tensor([sample.ids])
        rows = torch.tensor(sample.answer_rows)
        with torch.no_grad(), autocast:
            mixer.mixing = False
            target = _hidden(model, ids)[rows].float()
        mixer.mixing = True
        with autocast:
            got = _hidden(model, ids)[rows].float()
        distill = ((got - target) ** 2).sum() / (target ** 2).sum()
        live = gates[tuple(zip(*candidates))]
        loss = distill + args.l1 * live.clamp(0, 1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            gates.clamp_(0.0, 1.0)
            gate_sum += gates
        step += 1
        mean_gate = float(gates.detach()[tuple(zip(*candidates))].mean())
        history.append({"step": step, "loss": float(loss.detach()), "distill": float(distill.detach()),
                        "mean_gate": mean_gate})
        per_step = (time.time() - started) / (step - first_step)
        now = history[-1]
        log(f"[optimize_swa_gates] step {step}/{args.steps} loss {now['loss']:.5f} distill {now['distill']:.5f} "
            f"mean gate {mean_gate:.3f} ({per_step:.1f} s/step, {per_step * (args.steps - step) / 60:.1f} min left)")
        if step % args.save_every == 0 or step == args.steps:
            save()
    final = gates.detach().numpy().astype(float)
    mean_gates = (gate_sum / max(step, 1)).numpy().astype(float)
    by_fraction = sections(final, candidates, sorted(set(fractions) | {args.fraction}), args.window, args.sink,
                           mean_gates)
    log(f"[optimize_swa_gates] done in {time.time() - t0:.0f} s")
    return {
        "model": os.path.basename(path),
        "head_wise_swa": by_fraction[f"{args.fraction:.4f}"],
        "fraction": args.fraction,
        "sections": by_fraction,
        "gates": np.round(final, 6).tolist(),
        "mean_gates": np.round(mean_gates, 6).tolist(),
        "gateable": [list(c) for c in candidates],
        "history": history,
        "settings": settings,
        "training": {"text": "pydoc_data.topics, calibration share (gate_training_data.py)",
                     "seconds": round(time.time() - t0, 1)},
    }


def main(argv=None) -> int:
    return json_tool.run("optimize_swa_gates", parse_args(argv), optimize)

if __name__ == "__main__":
    sys.exit(main())
