"""Pages one request holds with the flag off and on, for the published configurations of the sliding-window
families (docs/models.md): the retention rule's arithmetic (fastdeploy/cache_manager/head_wise.py) on each
model's own layers, KV heads, head size and window. Nothing runs a model; the shapes are the published
config.json values, typed in below with their source.

A page is one (layer, KV head) pair's block of --block-size tokens. Flag off, every pair keeps every block of
the request; flag on, a sliding layer's pairs keep only the blocks a query at the request's next position can
still see (these models have no sink tokens). KV bytes count keys and values in bfloat16.

    python benchmarks/page_arithmetic.py                       # 4096- and 32768-token requests
    python benchmarks/page_arithmetic.py --tokens 4096 --markdown
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from ab_harness import print_table, write_json

from fastdeploy.cache_manager.head_wise import first_window_block, table_length


@dataclass(frozen=True)
class Published:
    name: str
    architecture: str
    layers: int
    kv_heads: int
    head_dim: int
    window: int
    full_every: Optional[int]  # layer i attends fully when (i + 1) % full_every == 0; None: every layer slides
    source: str

    def sliding(self, layer: int) -> bool:
        return self.full_every is None or (layer + 1) % self.full_every != 0


# (name, transformers class, layers, KV heads, head_dim, window, full-attention period): each model's config.json.
MODELS = (
    Published("gpt-oss-20b", "GptOssForCausalLM", 24, 8, 64, 128, 2,
              "openai/gpt-oss-20b: layer_types alternate sliding (even layers) and full, sliding_window 128"),
    Published("gpt-oss-120b", "GptOssForCausalLM", 36, 8, 64, 128, 2, "openai/gpt-oss-120b: as the 20b, 36 layers"),
    Published("Mistral-7B-v0.1", "MistralForCausalLM", 32, 8, 128, 4096, None,
              "mistralai/Mistral-7B-v0.1: sliding_window 4096 on every layer (v0.2 and later: null, no window)"),
    Published("Gemma 2 9B", "Gemma2ForCausalLM", 42, 8, 256, 4096, 2,
              "google/gemma-2-9b: even layers slide (window 4096), odd ones global"),
    Published("Gemma 3 27B", "Gemma3ForCausalLM", 62, 16, 128, 1024, 6,
              "google/gemma-3-27b: sliding_window 1024, sliding_window_pattern 6"),
    Published("Gemma 3 270M", "Gemma3ForCausalLM", 18, 1, 256, 512, 6,
              "google/gemma-3-270m (the engine's gemma-3-270m): sliding_window 512, pattern 6"),
    Published("Command R7B", "Cohere2ForCausalLM", 32, 8, 128, 4096, 4,
              "CohereLabs/c4ai-command-r7b-12-2024: sliding_window 4096, three sliding layers to one full"),
    Published("OLMo 3 7B", "Olmo3ForCausalLM", 32, 32, 128, 4096, 4,
              "allenai/Olmo-3-1025-7B: sliding_window 4096, three sliding layers to one full, 32 KV heads"),
)


def pages_held(model: Published, tokens: int, block_size: int, recycle: bool) -> int:
    """Pages one request of `tokens` processed tokens holds (before its next token's page)."""
    blocks = table_length(tokens, block_size)
    live_sliding = blocks - first_window_block(tokens, model.window, block_size) if recycle else blocks
    return sum(model.kv_heads * (live_sliding if model.sliding(layer) else blocks) for layer in range(model.layers))


def row(model: Published, tokens: int, block_size: int) -> dict:
    off, on = pages_held(model, tokens, block_size, False), pages_held(model, tokens, block_size, True)
    page_bytes = 2 * block_size * model.head_dim * 2  # K and V, bfloat16
    return {"model": model.name, "architecture": model.architecture, "tokens": tokens,
            "sliding_layers": sum(model.sliding(i) for i in range(model.layers)), "layers": model.layers,
            "window": model.window, "pages_off": off, "pages_on": on, "on_over_off": on / off,
            "kv_mib_off": off * page_bytes / 2**20, "kv_mib_on": on * page_bytes / 2**20, "source": model.source}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768], help="request lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--markdown", action="store_true", help="print a markdown table (docs/models.md)")
    p.add_argument("--json", type=str, default=None)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.tokens) < 1 or args.block_size < 1:
        p.error("--tokens and --block-size must be positive")
    rows = [row(m, n, args.block_size) for m in MODELS for n in args.tokens]
    print_table(rows, [("model", "model", ""), ("tokens", "tokens", "d"),
                       ("sliding layers", lambda r: f"{r['sliding_layers']} of {r['layers']}", ""),
                       ("window", "window", "d"), ("pages, flag off", "pages_off", "d"),
                       ("pages, flag on", "pages_on", "d"), ("on / off", "on_over_off", ".3f"),
                       ("KV MiB off", "kv_mib_off", ".0f"), ("KV MiB on", "kv_mib_on", ".0f")],
                title=f"pages one request holds ({args.block_size}-token pages of one layer's KV head)",
                markdown=args.markdown)
    write_json(args.json, {"block_size": args.block_size, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
