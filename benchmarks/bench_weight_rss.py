"""Are the weights held once? Engine RSS after loading a checkpoint, minus an empty engine's, next to
the weights' size in the compute dtype (target: at most 1.3x).

Both engines are built in fresh processes with the same config (same KV cache); the empty one
skips the weights. Without --model, a synthetic ERNIE-4.5 MoE checkpoint (bfloat16, 3 shards,
PaddleFormers' layout) is written to a temporary directory first.

    python benchmarks/bench_weight_rss.py
    python benchmarks/bench_weight_rss.py --model /path/to/ERNIE-4.5-0.3B-PT --json rss.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from ab_harness import write_json

ENGINE = dict(block_size=16, num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=4)

SYNTHETIC_CONFIG = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "torch_dtype": "bfloat16",
    "vocab_size": 16000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
    "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
    "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 512, "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1, "tie_word_embeddings": False,
}


def rss_bytes() -> int:
    gc.collect()
    try:  # hand freed transient buffers back to the OS before measuring
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def write_checkpoint(path: str, config: dict, shards: int = 1) -> str:
    """Random weights for `config` in PaddleFormers' layout (safetensors shards and their index), in
    its torch_dtype: float32 or bfloat16 (written by hand: numpy has no bfloat16). 1-D weights are ones,
    matrices N(0, 1 / fan-in), so activations stay in range whatever the depth."""
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.model_executor.models.decoder import checkpoint_shapes

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "fastdeploy_byte_tokenizer": True}, f, indent=2)
    shapes = checkpoint_shapes(EngineArgs(model=path, **ENGINE).create_engine_config().model_config)
    bf16, rng, weight_map = config["torch_dtype"] == "bfloat16", np.random.default_rng(0), {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, chunks, offset = {}, [], 0
        for name in sorted(shapes)[s::shards]:
            shape = shapes[name]
            data = np.ones(shape, np.float32) if len(shape) == 1 else \
                rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
            blob = (data.view(np.uint32) >> 16).astype(np.uint16).tobytes() if bf16 else data.tobytes()
            header[name] = {"dtype": "BF16" if bf16 else "F32", "shape": list(shape),
                            "data_offsets": [offset, offset + len(blob)]}
            chunks.append(blob)
            offset += len(blob)
            weight_map[name] = shard
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        with open(os.path.join(path, shard), "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head + b"".join(chunks))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def child(model: str, empty: bool) -> None:
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.model_executor.models import decoder

    if empty:
        class NoWeights:
            @staticmethod
            def weight_bytes() -> int:
                return 0

        decoder.CausalLM.load = classmethod(lambda cls, cfg, *tp_rank_size: NoWeights())
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **ENGINE))
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    print(json.dumps({"rss": rss_bytes(), "peak_rss": peak, "weight_bytes": engine.runner.model.weight_bytes(),
                      "dtype": engine.model_config.dtype}))


def measure(model: str, empty: bool) -> dict:
    cmd = [sys.executable, __file__, "--model", model, "--child", "empty" if empty else "load"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "GLOG_v": "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: a synthetic bf16 MoE one)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", choices=["load", "empty"], default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args.model, args.child == "empty")
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or write_checkpoint(tmp, SYNTHETIC_CONFIG, shards=3)
        loaded, empty = measure(model, False), measure(model, True)
    delta = loaded["rss"] - empty["rss"]
    ratio = delta / loaded["weight_bytes"]
    result = {"weight_bytes": loaded["weight_bytes"], "dtype": loaded["dtype"], "rss_loaded": loaded["rss"],
              "rss_empty": empty["rss"], "rss_delta": delta, "ratio": ratio, "peak_rss_loaded": loaded["peak_rss"]}
    mib = 1 << 20
    print(f"weights in {loaded['dtype']}: {loaded['weight_bytes'] / mib:.1f} MiB")
    print(f"engine RSS {loaded['rss'] / mib:.1f} MiB - empty engine {empty['rss'] / mib:.1f} MiB "
          f"= {delta / mib:.1f} MiB  ->  {ratio:.3f}x the weights (target <= 1.3x)  "
          f"[peak RSS while loading {loaded['peak_rss'] / mib:.1f} MiB]")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
