"""`kv_cache_quant_type` at start-up: where the type comes from (the flag wins over the checkpoint's
quantization_config), the one-line errors, and what a quantized page costs in the cache sizing:
8-bit K/V plus a float32 scale per token and KV head, so at equal --kv-cache-memory head_dim 64
holds 4 * 64 / (64 + 4) = 3.76x the float32 pages (1.88x bfloat16's); 4-bit K/V (block_wise_int4,
two codes per byte) 4 * 64 / (32 + 4) = 7.11x; int8 keys beside int4 values (k8v4) 2 * 4 * 64 /
((64 + 4) + (32 + 4)) = 4.92x; and the scheduler, the page pool and /metrics all count those pages."""

import json
import logging

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.model_executor.models.tiny_preset import TINY_GPU_PRESET_NAME, TINY_PRESET_CONFIG

MEMORY = 64 * 1024 * 1024


def build(monkeypatch, **kwargs):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "0")
    return EngineArgs(**kwargs).create_engine_config()


def checkpoint(tmp_path, section):
    (tmp_path / "config.json").write_text(json.dumps({**TINY_PRESET_CONFIG, "quantization_config": section}))
    return str(tmp_path)


# type -> (key lane dtype, value lane dtype, key row elements, value row elements) at head_dim 64
LANES = {"none": ("float32", "float32", 64, 64), "int8": ("int8", "int8", 64, 64),
         "block_wise_fp8": ("float8_e4m3fn", "float8_e4m3fn", 64, 64), "block_wise_int4": ("uint8", "uint8", 32, 32),
         "k8v4": ("int8", "uint8", 64, 32)}


@pytest.mark.parametrize("quant", ["none", "int8", "block_wise_fp8", "INT8", "block_wise_int4", "k8v4", "K8V4"])
def test_the_flag_names_the_page_format(monkeypatch, quant):
    cache = build(monkeypatch, kv_cache_quant_type=quant).cache_config
    assert cache.kv_cache_quant_type == quant.lower()
    key_dtype, value_dtype, key_width, value_width = LANES[quant.lower()]
    assert (cache.page_dtype("key"), cache.page_dtype("value")) == (key_dtype, value_dtype)
    assert (cache.row_elements(64, "key"), cache.row_elements(64, "value")) == (key_width, value_width)


def test_the_checkpoints_quantization_config_is_read_and_the_flag_wins(monkeypatch, tmp_path):
    model = checkpoint(tmp_path, {"kv_cache_quant_type": "block_wise_fp8"})
    assert build(monkeypatch, model=model).cache_config.kv_cache_quant_type == "block_wise_fp8"
    assert build(monkeypatch, model=model, kv_cache_quant_type="int8").cache_config.kv_cache_quant_type == "int8"
    assert build(monkeypatch, model=model, kv_cache_quant_type="none").cache_config.kv_cache_quant_type == "none"
    assert build(monkeypatch).cache_config.kv_cache_quant_type == "none"  # no section: float pages
    model = checkpoint(tmp_path, {"kv_cache_quant_type": "block_wise_int4"})
    assert build(monkeypatch, model=model).cache_config.page_dtype("key") == "uint8"
    model = checkpoint(tmp_path, {"kv_cache_quant_type": "k8v4"})
    assert build(monkeypatch, model=model).cache_config.page_dtype("value") == "uint8"


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_quant_type="int3"), r"kv_cache_quant_type='int3' is not supported: choose one of none, int8, "
                                       r"block_wise_fp8, block_wise_int4, k8v4$"),
    (dict(kv_cache_quant_type="int4_zp"), "an upstream type with calibrated static scales or zero points, not "
                                          "implemented here; block_wise_int4 is this engine's 4-bit pages"),
    (dict(kv_cache_quant_type="int4_kivi"), "KIVI's per-channel key scales change as a page fills.*k8v4 is the "
                                            "4-bit form that keeps retrieval"),
    (dict(kv_cache_quant_type="block_wise_int4", cache_dtype="bfloat16"),
     "kv_cache_quant_type=block_wise_int4 stores 4-bit pages with float32 scales, but --cache-dtype bfloat16"),
    (dict(kv_cache_quant_type="int8", cache_dtype="bfloat16"),
     "kv_cache_quant_type=int8 stores 8-bit pages with float32 scales, but --cache-dtype bfloat16"),
    (dict(kv_cache_quant_type="k8v4", cache_dtype="bfloat16"),
     "kv_cache_quant_type=k8v4 stores 8-bit key / 4-bit value pages with float32 scales, but --cache-dtype bfloat16"),
    (dict(kv_cache_quant_type="block_wise_fp8", cache_dtype="float16"), "cache_dtype=float16 needs --device gpu"),
])
def test_impossible_combinations_stop_the_start_up_with_one_line(monkeypatch, kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        build(monkeypatch, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("quant", ["int8", "k8v4"])
def test_the_dense_oracle_backend_refuses_quantized_pages(monkeypatch, quant):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "NATIVE_ATTN")
    with pytest.raises(ValueError, match="NATIVE_ATTN backend keeps float K/V per request"):
        build(monkeypatch, kv_cache_quant_type=quant)


def test_the_gpu_needs_bfloat16_compute_for_quantized_pages():
    from fastdeploy.model_executor.layers.quantization.kv_cache import check_kv_cache_quant_type

    check_kv_cache_quant_type("int8", "bfloat16", "bfloat16", "APPEND_ATTN", "gpu", "bfloat16")
    with pytest.raises(ValueError, match="with bfloat16 compute only, but --dtype resolved to float16"):
        check_kv_cache_quant_type("int8", "float16", "float16", "APPEND_ATTN", "gpu", "float16")


def test_int4_pages_need_an_even_head_dim():
    from fastdeploy.model_executor.layers.quantization.kv_cache import check_kv_cache_quant_type

    check_kv_cache_quant_type("block_wise_int4", "float32", "float32", "APPEND_ATTN", head_dim=64)
    check_kv_cache_quant_type("int8", "float32", "float32", "APPEND_ATTN", head_dim=63)
    with pytest.raises(ValueError, match=r"block_wise_int4 stores two 4-bit codes per byte, but the model's head_dim "
                                         r"is 63 \(odd\): use int8 or none$"):
        check_kv_cache_quant_type("block_wise_int4", "float32", "float32", "APPEND_ATTN", head_dim=63)
    # k8v4's values are int4 pairs: the same refusal
    check_kv_cache_quant_type("k8v4", "float32", "float32", "APPEND_ATTN", head_dim=64)
    with pytest.raises(ValueError, match=r"kv_cache_quant_type=k8v4 stores two 4-bit codes per byte, but the model's "
                                         r"head_dim is 63 \(odd\): use int8 or none$"):
        check_kv_cache_quant_type("k8v4", "float32", "float32", "APPEND_ATTN", head_dim=63)


def test_an_unsupported_type_in_the_checkpoint_says_how_to_override_it(monkeypatch, tmp_path):
    model = checkpoint(tmp_path, {"kv_cache_quant_type": "fp8"})
    with pytest.raises(ValueError, match=r"the checkpoint's quantization_config.kv_cache_quant_type='fp8' .* "
                                         r"pass --kv-cache-quant-type to override it"):
        build(monkeypatch, model=model)
    assert build(monkeypatch, model=model, kv_cache_quant_type="int8").cache_config.quantized


def test_equal_kv_memory_holds_3_76x_the_float32_pages_at_head_dim_64(monkeypatch):
    blocks = {q: build(monkeypatch, model=TINY_GPU_PRESET_NAME, num_gpu_blocks_override=None, kv_cache_memory=MEMORY,
                       kv_cache_quant_type=q).cache_config.num_gpu_blocks for q in ("none", "int8", "block_wise_fp8")}
    bf16 = build(monkeypatch, model=TINY_GPU_PRESET_NAME, kv_cache_memory=MEMORY, cache_dtype="bfloat16")
    assert blocks["int8"] == blocks["block_wise_fp8"]
    assert blocks["int8"] / blocks["none"] == pytest.approx(4 * 64 / 68, rel=1e-3)
    assert blocks["int8"] / bf16.cache_config.num_gpu_blocks == pytest.approx(2 * 64 / 68, rel=1e-3)
    assert blocks["int8"] >= 3.5 * blocks["none"]


def test_equal_kv_memory_holds_7_1x_the_float32_pages_with_int4_pages(monkeypatch):
    blocks = {q: build(monkeypatch, model=TINY_GPU_PRESET_NAME, kv_cache_memory=MEMORY,
                       kv_cache_quant_type=q).cache_config.num_gpu_blocks for q in ("none", "int8", "block_wise_int4")}
    assert blocks["block_wise_int4"] / blocks["none"] == pytest.approx(4 * 64 / 36, rel=1e-3)
    assert blocks["block_wise_int4"] / blocks["int8"] == pytest.approx(68 / 36, rel=1e-3)
    assert blocks["block_wise_int4"] >= 7 * blocks["none"]


def test_equal_kv_memory_holds_4_92x_the_float32_pages_with_k8v4_pages(monkeypatch):
    """A k8v4 row of K + V is (64 + 4) + (32 + 4) = 104 bytes against float32's 2 x 256: the cache sizing
    counts both lanes' real bytes, between int8's (136) and int4's (72)."""
    blocks = {q: build(monkeypatch, model=TINY_GPU_PRESET_NAME, kv_cache_memory=MEMORY,
                       kv_cache_quant_type=q).cache_config.num_gpu_blocks
              for q in ("none", "int8", "block_wise_int4", "k8v4")}
    assert blocks["k8v4"] / blocks["none"] == pytest.approx(2 * 4 * 64 / 104, rel=1e-3)
    assert blocks["k8v4"] / blocks["int8"] == pytest.approx(136 / 104, rel=1e-3)
    assert blocks["block_wise_int4"] / blocks["k8v4"] == pytest.approx(104 / 72, rel=1e-3)
    cfg = build(monkeypatch, model=TINY_GPU_PRESET_NAME, kv_cache_memory=MEMORY, kv_cache_quant_type="k8v4")
    # The tiny GPU preset: 2 layers x 4 KV heads x 64 tokens a block x 104 bytes a row of K + V.
    assert cfg.cache_config.block_bytes(cfg.model_config, 1) == 2 * 4 * 64 * 104
    assert blocks["k8v4"] == MEMORY // (2 * 4 * 64 * 104)


def test_row_bytes_answer_per_lane_and_kv_row_bytes_for_both():
    from fastdeploy.model_executor.layers.quantization import kv_cache as kv_quant

    assert [kv_quant.row_bytes("k8v4", 4, 64, lane) for lane in ("key", "value")] == [68, 36]
    assert kv_quant.kv_row_bytes("k8v4", 4, 64) == 104 and kv_quant.kv_row_bytes("k8v4", 4, 256) == 392
    assert kv_quant.kv_row_bytes("none", 4, 64) == 512 and kv_quant.kv_row_bytes("int8", 4, 64) == 136
    assert kv_quant.row_bytes("int8", 4, 64) == 68  # a type whose lanes cost the same needs no lane
    with pytest.raises(ValueError, match="k8v4: its key and value rows differ in size; pass lane='key' or 'value'"):
        kv_quant.row_bytes("k8v4", 4, 64)


def test_the_start_up_log_names_the_type_the_page_bytes_and_the_pages(monkeypatch, caplog):
    from fastdeploy import LLM

    caplog.set_level(logging.INFO, logger="fastdeploy")
    llm = LLM(model=TINY_GPU_PRESET_NAME, kv_cache_quant_type="int8", kv_cache_memory=MEMORY, block_size=16,
              max_model_len=256)
    blocks = llm.engine.fd_config.cache_config.num_gpu_blocks
    # 2 layers x (K and V) x 16 tokens x (64 int8 + a 4-byte scale) per page; 4 KV heads = 4 slots.
    line = f"KV cache: int8 pages (int8 K/V + a float32 scale per token and KV head), {2 * 2 * 16 * 68} bytes per " \
           f"page, {4 * blocks} pages per rank ({blocks} blocks x 4 slots) from --kv-cache-memory {MEMORY} bytes"
    assert line in caplog.text
    stats = llm.engine.get_stats()  # the scheduler, the pool and /metrics count the same pages
    assert stats["kv_pages_total"] == 4 * blocks == llm.engine.scheduler.cache_manager.num_total_pages
    backend = llm.engine.runner.attn_backend
    assert backend.key_caches[0].dtype.name == "INT8" and backend.key_caches[0].shape == [blocks, 4, 16, 64]
    assert backend.key_scales[0].shape == [blocks, 4, 16] and backend.value_scales[1].dtype.name == "FLOAT32"


def test_int4_lanes_hold_half_a_head_dim_of_code_pairs(monkeypatch, caplog):
    from fastdeploy import LLM, SamplingParams

    caplog.set_level(logging.INFO, logger="fastdeploy")
    llm = LLM(model=TINY_GPU_PRESET_NAME, kv_cache_quant_type="block_wise_int4", kv_cache_memory=MEMORY,
              block_size=16, max_model_len=256)
    blocks = llm.engine.fd_config.cache_config.num_gpu_blocks
    # 2 layers x (K and V) x 16 tokens x (32 bytes of codes + a 4-byte scale) per page.
    assert f"KV cache: block_wise_int4 pages (int4 K/V codes, two per uint8 + a float32 scale per token and KV " \
           f"head), {2 * 2 * 16 * 36} bytes per page" in caplog.text
    backend = llm.engine.runner.attn_backend
    assert backend.key_caches[0].dtype.name == "UINT8" and backend.key_caches[0].shape == [blocks, 4, 16, 32]
    assert backend.key_scales[0].shape == [blocks, 4, 16]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs.token_ids) == 4  # the op read and wrote those lanes
    assert backend.key_scales[0].numpy().max() > 0


def test_k8v4_lanes_hold_int8_keys_and_int4_value_pairs(monkeypatch, caplog):
    """The key lane is int8 [blocks, G, block_size, head_dim], the value lane uint8 [..., head_dim / 2], each
    with float32 scales; the page bytes the log names count both lanes, and the op reads and writes them."""
    from fastdeploy import LLM, SamplingParams

    caplog.set_level(logging.INFO, logger="fastdeploy")
    llm = LLM(model=TINY_GPU_PRESET_NAME, kv_cache_quant_type="k8v4", kv_cache_memory=MEMORY, block_size=16,
              max_model_len=256)
    blocks = llm.engine.fd_config.cache_config.num_gpu_blocks
    # 2 layers x 16 tokens x ((64 int8 + a 4-byte scale) + (32 bytes of int4 pairs + a 4-byte scale)) per page.
    assert f"KV cache: k8v4 pages (int8 K, int4 V codes, two per uint8 + a float32 scale per token and KV head), " \
           f"{2 * 16 * 104} bytes per page, {4 * blocks} pages per rank" in caplog.text
    backend = llm.engine.runner.attn_backend
    assert backend.key_caches[0].dtype.name == "INT8" and backend.key_caches[0].shape == [blocks, 4, 16, 64]
    assert backend.value_caches[0].dtype.name == "UINT8" and backend.value_caches[0].shape == [blocks, 4, 16, 32]
    assert backend.key_scales[0].shape == backend.value_scales[0].shape == [blocks, 4, 16]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs.token_ids) == 4
    assert backend.key_scales[0].numpy().max() > 0 and backend.value_scales[0].numpy().max() > 0
    assert (backend.value_caches[0].numpy() != 0).any() and (backend.key_caches[0].numpy() != 0).any()
