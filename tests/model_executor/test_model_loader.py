"""Checkpoint directories load as PaddleFormers writes them, and every way one can be wrong is a
clear start-up error. (The same layouts written by PaddleFormers itself: test_paddleformers_oracle.)"""

import json

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request
from fastdeploy.input.tokenizer import ByteTokenizer
from fastdeploy.input.tokenizer_loader import load_tokenizer

ENGINE = dict(block_size=16, num_gpu_blocks_override=32, max_model_len=256)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["a checkpoint", [7] * 40]
_TAGS = {np.float32: "F32", np.uint16: "BF16", np.float16: "F16"}


def write_safetensors(path, tensors: dict) -> None:
    """A minimal safetensors writer (the format: 8-byte header length, JSON header, raw data), so
    bfloat16 can be written without a numpy bf16 type."""
    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": _TAGS[array.dtype.type], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob + b"".join(chunks))


def bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_sharded(path, tensors: dict, num_shards: int) -> None:
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        shard = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[s::num_shards]
        write_safetensors(path / shard, {n: tensors[n] for n in part})
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    """The dense preset saved as a single float32 model.safetensors."""
    path = tmp_path_factory.mktemp("preset")
    LLM(**ENGINE).engine.runner.model.save_pretrained(str(path))
    return path


def weights_of(path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path / "model.safetensors"))


def clone(preset_dir, tmp_path, tensors=None, config_update=None, num_shards=None):
    config = json.loads((preset_dir / "config.json").read_text())
    config.update(config_update or {})
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = weights_of(preset_dir) if tensors is None else tensors
    if num_shards is None:
        write_safetensors(tmp_path / "model.safetensors", tensors)
    else:
        write_sharded(tmp_path, tensors, num_shards)
    return str(tmp_path)


def greedy(model_dir, **kw):
    return [o.outputs.token_ids for o in LLM(model=model_dir, **ENGINE, **kw).generate(PROMPTS, GREEDY,
                                                                                        use_tqdm=False)]


def test_sharded_bf16_checkpoint_loads_like_its_float32_twin(preset_dir, tmp_path):
    bits = {n: bf16_bits(a) for n, a in weights_of(preset_dir).items()}
    (tmp_path / "bf16").mkdir()
    (tmp_path / "fp32").mkdir()
    bf16_dir = clone(preset_dir, tmp_path / "bf16", bits, {"torch_dtype": "bfloat16"}, num_shards=3)
    fp32_dir = clone(preset_dir, tmp_path / "fp32", {n: from_bf16_bits(b) for n, b in bits.items()})
    llm = LLM(model=bf16_dir, **ENGINE)
    weights = llm.engine.runner.model.weights
    expected = from_bf16_bits(bits["model.layers.0.self_attn.q_proj.weight"])
    assert np.array_equal(weights["model.layers.0.self_attn.q_proj.weight"].numpy(), expected)  # bit-exact
    assert llm.engine.model_config.dtype == "float32"  # Paddle has no CPU bf16 matmul: --dtype auto widens
    assert greedy(bf16_dir) == greedy(fp32_dir)


def test_float16_tensors_load(preset_dir, tmp_path):
    halves = {n: a.astype(np.float16) for n, a in weights_of(preset_dir).items()}
    model_dir = clone(preset_dir, tmp_path, halves)
    weights = LLM(model=model_dir, **ENGINE).engine.runner.model.weights
    assert np.array_equal(weights["model.norm.weight"].numpy(), halves["model.norm.weight"].astype(np.float32))


def test_unknown_architecture_names_the_supported_ones(preset_dir, tmp_path):
    model_dir = clone(preset_dir, tmp_path, config_update={"architectures": ["FalconForCausalLM"]})
    with pytest.raises(ValueError, match="FalconForCausalLM.*not supported; supported: .*Ernie4_5_MoeForCausalLM.*Gemma3ForCausalLM.*GptOssForCausalLM.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        EngineArgs(model=model_dir, **ENGINE).create_engine_config()


def test_model_type_that_contradicts_the_architecture_is_an_error(preset_dir, tmp_path):
    model_dir = clone(preset_dir, tmp_path, config_update={"model_type": "ernie4_5_moe"})
    with pytest.raises(ValueError, match="model_type='ernie4_5_moe' does not match"):
        EngineArgs(model=model_dir, **ENGINE).create_engine_config()


def test_missing_shard_is_a_start_up_error(preset_dir, tmp_path):
    model_dir = clone(preset_dir, tmp_path, num_shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="shard 'model-00002-of-00002.safetensors' .* is missing"):
        LLM(model=model_dir, **ENGINE)


def test_unknown_tensor_is_a_start_up_error(preset_dir, tmp_path):
    tensors = weights_of(preset_dir)
    tensors["model.layers.0.mlp.extra_proj.weight"] = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.extra_proj.weight' is not a parameter"):
        LLM(model=clone(preset_dir, tmp_path, tensors), **ENGINE)


def test_missing_tensor_is_a_start_up_error(preset_dir, tmp_path):
    tensors = weights_of(preset_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing 1 parameter.*model.layers.1.mlp.up_proj.weight"):
        LLM(model=clone(preset_dir, tmp_path, tensors), **ENGINE)


def test_mtp_block_tensors_are_skipped(preset_dir, tmp_path):
    tensors = weights_of(preset_dir)
    tensors["model.mtp_block.0.self_attn.q_proj.weight"] = np.ones((8, 8), np.float32)
    tensors["model.mtp_linear_proj.0.weight"] = np.ones((8, 16), np.float32)
    model_dir = clone(preset_dir, tmp_path, tensors, num_shards=2)
    assert greedy(model_dir) == greedy(str(preset_dir))


def test_model_directory_without_a_tokenizer_is_an_error(preset_dir, tmp_path):
    model_dir = clone(preset_dir, tmp_path, config_update={"fastdeploy_byte_tokenizer": False})
    with pytest.raises(ValueError, match="has no tokenizer"):
        LLM(model=model_dir, **ENGINE)


def test_bfloat16_compute_without_cpu_kernels_is_a_start_up_error(preset_dir):
    with pytest.raises(ValueError, match="dtype=bfloat16: this device has no matmul kernel"):
        EngineArgs(model=str(preset_dir), dtype="bfloat16", **ENGINE).create_engine_config()


def test_absent_config_fields_take_paddleformers_defaults(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Ernie4_5ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}))
    mc = EngineArgs(model=str(tmp_path), **ENGINE).create_engine_config().model_config
    assert (mc.tie_word_embeddings, mc.rms_norm_eps, mc.head_dim, mc.num_key_value_heads) == (True, 1e-6, 128, 4)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "moe_intermediate_size": 32}))
    mc = EngineArgs(model=str(tmp_path), **ENGINE).create_engine_config().model_config
    assert (mc.tie_word_embeddings, mc.head_dim) == (True, 16)
    assert (mc.moe.num_experts, mc.moe.top_k, mc.moe.num_shared_experts) == (16, 2, 2)
    assert (mc.moe.layer_start_index, mc.moe.layer_end_index, mc.moe.use_correction_bias) == (1, 3, True)


def test_every_end_token_from_config_and_generation_config_stops(preset_dir, tmp_path):
    model_dir = clone(preset_dir, tmp_path, config_update={"eos_token_id": [2, 5]})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    mc = EngineArgs(model=model_dir, **ENGINE).create_engine_config().model_config
    assert mc.eos_token_ids == (2, 5, 7) and mc.eos_token_id == 2
    for end in (2, 5, 7):
        request = Request("r", [3, 4], SamplingParams(max_tokens=10), eos_token_id=mc.eos_token_ids)
        request.append_output(end)
        assert request.stop_reason() == "stop"
    # the engine really stops on one of them: make the first greedy token an end token
    first = greedy(str(preset_dir))[0][0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    out = LLM(model=model_dir, **ENGINE).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6),
                                                  use_tqdm=False)[0]
    assert out.outputs.token_ids == [first] and out.outputs.finish_reason == "stop"


def test_default_max_model_len_is_capped_to_the_kv_cache(preset_dir, tmp_path, caplog):
    model_dir = clone(preset_dir, tmp_path, config_update={"max_position_embeddings": 131072})
    with caplog.at_level("WARNING"):
        cfg = EngineArgs(model=model_dir, block_size=16, num_gpu_blocks_override=32).create_engine_config()
    assert cfg.model_config.max_model_len == 32 * 16 + 1  # the last token's KV is never written
    assert "max_model_len defaults to 513" in caplog.text
    llm = LLM(model=model_dir, block_size=16, num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="maximum context length is 513"):
        llm.generate([[5] * 600], GREEDY, use_tqdm=False)


def test_decoding_never_raises_on_an_unknown_id(preset_dir, tmp_path):
    assert ByteTokenizer().decode([72 + 3, 300, 10 ** 6, -1, 105 + 3]) == "Hi"
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "a": 1, "</s>": 2, "b": 3},
                                                            unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    model_dir = clone(preset_dir, tmp_path)
    mc = EngineArgs(model=model_dir, **ENGINE).create_engine_config().model_config
    hf = load_tokenizer(mc)
    assert hf.decode([1, 258, 10 ** 6, 3, 2]) == "a b"  # unknown ids and the end token are no text
    # ids past the tokenizer's vocab (the model's is 259) stream as no text, the batch keeps going
    outs = LLM(model=model_dir, **ENGINE).generate([[1, 3, 1]] * 2, GREEDY, use_tqdm=False)
    assert all(len(o.outputs.token_ids) == 6 and isinstance(o.outputs.text, str) for o in outs)


def test_preset_byte_tokenizer_keeps_its_own_vocab():
    llm = LLM(model="tiny-moe", **ENGINE)
    assert llm.engine.tokenizer.vocab_size == 259
    assert llm.engine.model_config.moe is not None and llm.engine.model_config.served_model_name == "tiny-moe"
