"""Each weight of a loaded checkpoint is held once: the engine's resident memory after loading a bf16 MoE
checkpoint (3 shards, PaddleFormers' layout), minus that of the same engine built without weights, is at
most 1.3x the weights' bytes in the compute dtype.

Both engines start in fresh processes (this file run as a script), so neither inherits the other's heap.

    python -m pytest tests/model_executor/test_weights_held_once.py -s    # prints the measured ratio
"""

import ctypes
import gc
import json
import os
import subprocess
import sys

import numpy as np

ENGINE = dict(block_size=16, num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=4)
MOE_CONFIG = {
    "architectures": ["Ernie4_5_MoeForCausalLM"], "model_type": "ernie4_5_moe", "torch_dtype": "bfloat16",
    "vocab_size": 16000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
    "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
    "moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 512, "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1, "tie_word_embeddings": False, "fastdeploy_byte_tokenizer": True,
}


def write_moe_checkpoint(path) -> None:
    """Random bf16 weights of MOE_CONFIG in 3 shards (1-D weights ones, matrices N(0, 1 / fan-in))."""
    from test_model_loader import bf16_bits, write_sharded

    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.model_executor.models.decoder import checkpoint_shapes

    (path / "config.json").write_text(json.dumps(MOE_CONFIG))
    shapes = checkpoint_shapes(EngineArgs(model=str(path), **ENGINE).create_engine_config().model_config)
    rng = np.random.default_rng(0)
    write_sharded(path, {name: bf16_bits(np.ones(s, np.float32) if len(s) == 1 else
                                         rng.standard_normal(s, dtype=np.float32) / np.float32(np.sqrt(s[1])))
                         for name, s in shapes.items()}, num_shards=3)


def resident_bytes() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed transient buffers back to the OS before measuring
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def engine_memory(model: str, with_weights: bool) -> None:
    """Child process: build the engine (its weights replaced by nothing where not `with_weights`) and
    print its resident bytes and weight bytes as JSON."""
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.model_executor.models import decoder

    if not with_weights:
        class NoWeights:
            @staticmethod
            def weight_bytes() -> int:
                return 0

            @staticmethod
            def attention_sinks():
                return None

        decoder.CausalLM.load = classmethod(lambda cls, cfg, *tp_rank_size: NoWeights())
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, **ENGINE))
    print(json.dumps({"rss": resident_bytes(), "weight_bytes": engine.runner.model.weight_bytes(),
                      "dtype": engine.model_config.dtype}))


def measured(model: str, with_weights: bool) -> dict:
    out = subprocess.run([sys.executable, __file__, model, str(int(with_weights))], check=True,
                         capture_output=True, text=True, env={**os.environ, "GLOG_v": "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_loaded_checkpoint_holds_each_weight_once(tmp_path):
    write_moe_checkpoint(tmp_path)
    loaded, empty = measured(str(tmp_path), True), measured(str(tmp_path), False)
    ratio = (loaded["rss"] - empty["rss"]) / loaded["weight_bytes"]
    print(f"\nweights in {loaded['dtype']}: {loaded['weight_bytes'] / 2 ** 20:.1f} MiB; engine RSS - empty engine's "
          f"= {(loaded['rss'] - empty['rss']) / 2 ** 20:.1f} MiB = {ratio:.3f}x the weights")
    assert loaded["weight_bytes"] > 300 * 2 ** 20  # large enough that allocator noise is small next to it
    assert ratio <= 1.3


if __name__ == "__main__":
    engine_memory(sys.argv[1], sys.argv[2] == "1")
