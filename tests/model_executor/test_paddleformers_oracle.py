"""Checkpoints written by PaddleFormers' `save_pretrained` load unchanged and decode greedily to
exactly PaddleFormers' tokens, in every memory mode and with chunked prefill.

PaddleFormers is the oracle (the `test` extra installs it). Its MoE layer dispatches tokens with
GPU-only kernels, so on CPU the reference replaces only that dispatch: routing (gate, softmax,
correction bias, top-k) and every expert MLP are PaddleFormers' own modules and functions.
"""

import json
import os

import numpy as np
import pytest

pf_transformers = pytest.importorskip("paddleformers.transformers")
import paddle  # noqa: E402

from fastdeploy import LLM, SamplingParams  # noqa: E402

PROMPT = [3 + (i * 37) % 250 for i in range(40)]
NEW_TOKENS = 8
# A window longer than every sequence here: head-wise tables are exercised, the attention stays
# full, so PaddleFormers' dense attention is the exact reference.
WIDE_SWA = {"sliding_window": 4096, "sink_size": 0, "swa_kv_heads": [0]}
MODES = {
    "1d": ({"FD_HEAD_WISE_KV_CACHE": "0"}, {}),
    "head_wise_recycle_off": ({"FD_HEAD_WISE_KV_CACHE": "1", "FD_HEAD_WISE_SWA_RECYCLE": "0"},
                              {"head_wise_swa_config": WIDE_SWA}),
    "head_wise_recycle_on": ({"FD_HEAD_WISE_KV_CACHE": "1"}, {"head_wise_swa_config": WIDE_SWA}),
    "native_attn": ({"FD_HEAD_WISE_KV_CACHE": "0", "FD_ATTENTION_BACKEND": "NATIVE_ATTN"}, {}),
    "chunked_prefill": ({"FD_HEAD_WISE_KV_CACHE": "1"}, {"head_wise_swa_config": WIDE_SWA,
                                                        "max_num_batched_tokens": 16}),
}
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def _decisive_weights(model, seed: int) -> None:
    """Weights whose logits spread over a few units, so greedy argmax has clear winners (the default
    init, std 0.02, makes near-ties that float rounding could flip)."""
    rng = np.random.default_rng(seed)
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if "e_score_correction_bias" in name:
            value = rng.normal(0, 0.1, shape)  # non-zero: it must change which experts are picked
        elif len(shape) == 1:
            value = 1 + rng.normal(0, 0.05, shape)
        elif "embed_tokens" in name:
            value = rng.normal(0, 1, shape)
        elif "lm_head" in name:
            value = rng.normal(0, 3 / np.sqrt(shape[1]), shape)
        else:  # Paddle linears are [in, out]
            value = rng.normal(0, 1 / np.sqrt(shape[0]), shape)
        p.set_value(paddle.to_tensor(value.astype("float32")).astype(p.dtype))


def _moe_forward_on_cpu(block, hidden_states, *args, **kwargs):
    """PaddleFormers' MoE block with its GPU dispatch replaced by a per-expert loop."""
    shape = hidden_states.shape
    x = hidden_states.reshape([-1, shape[-1]])
    logits, _, _ = block.gate(x, transform_weight=False)
    weight_and_id, _, _ = block.fused_gate_logits_process_fused(logits)
    weights, ids = weight_and_id.chunk(2, axis=-1)
    assert block.gate.norm_gate_logits  # PaddleFormers then renormalises the picked weights:
    weights = weights / paddle.clip(weights.sum(-1, keepdim=True), min=1e-12)
    ids = ids.numpy().astype(int)
    out = paddle.zeros_like(x)
    for expert in np.unique(ids):
        tokens, slots = np.nonzero(ids == expert)
        y = block.experts[int(expert)](paddle.gather(x, paddle.to_tensor(tokens)))
        w = paddle.to_tensor(weights.numpy()[tokens, slots][:, None]).astype(y.dtype)
        out = paddle.index_add(out, paddle.to_tensor(tokens), 0, y * w)
    out = out + block.shared_experts(x)
    return out.reshape(shape), None, paddle.zeros([1]), logits


# ERNIE-style template (its variables and layout; our own wording): cls_token opens, sep_token
# closes an assistant turn, "Assistant: " is the generation prompt.
CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}"
    "{{- cls_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + message['content'] + sep_token -}}"
    "{%- elif message['role'] == 'system' -%}{{- message['content'] + '\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)
CHAT = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "hi there</s>"},
        {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4 <|end_of_sentence|> w5"}]


def _write_tokenizer(path) -> None:
    """A word-level tokenizer.json and a tokenizer_config.json with special tokens and the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(20)] + ["User", ":", "Assistant", "hi", "there"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>", "sep_token": "<|end_of_sentence|>",
              "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _build(path, config, seed, dtype="float32", max_shard_size="10GB"):
    cls = pf_transformers.Ernie4_5_MoeForCausalLM if isinstance(config, pf_transformers.Ernie4_5_MoeConfig) \
        else pf_transformers.Ernie4_5ForCausalLM
    model = cls(config)
    _decisive_weights(model, seed)
    if dtype != "float32":
        model.to(dtype=dtype)
    model.save_pretrained(str(path), max_shard_size=max_shard_size)
    _write_tokenizer(path)
    return str(path)


def _reference_tokens(model_dir: str, moe: bool) -> list:
    """Greedy decoding with PaddleFormers' forward over the whole sequence, in float32."""
    cls = pf_transformers.Ernie4_5_MoeForCausalLM if moe else pf_transformers.Ernie4_5ForCausalLM
    model = cls.from_pretrained(model_dir, dtype="float32")
    model.eval()
    model.config.fuse_rms_norm = False  # the fused RMSNorm kernel is GPU-only
    ids = list(PROMPT)
    with paddle.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(paddle.to_tensor([ids]))
            ids.append(int(paddle.argmax(out.logits[0, -1].astype("float32"))))
    return ids[len(PROMPT):]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, PaddleFormers' greedy tokens); built once for the module."""
    mp = pytest.MonkeyPatch()
    from paddleformers.nn.moe import moe_allgather_layer
    from paddleformers.transformers.ernie4_5_moe import modeling as moe_modeling

    # GPU-only op; for text-only routing without expert groups it returns the ids unchanged.
    mp.setattr(moe_allgather_layer, "expand_modality_expert_id", lambda ids, **kw: ids)
    mp.setattr(moe_modeling.Ernie4_5_MoeSparseMoeBlock, "forward", _moe_forward_on_cpu)
    root = tmp_path_factory.mktemp("pf")
    moe_config = dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1)
    built = {
        "dense_tied_fp32": (_build(root / "dense_tied", pf_transformers.Ernie4_5Config(
            **SMALL, tie_word_embeddings=True), seed=1), False),
        "dense_untied_bf16_sharded": (_build(root / "dense_bf16", pf_transformers.Ernie4_5Config(
            **SMALL, tie_word_embeddings=False), seed=2, dtype="bfloat16", max_shard_size="40KB"), False),
        "moe_fp32": (_build(root / "moe", pf_transformers.Ernie4_5_MoeConfig(
            **SMALL, **moe_config, tie_word_embeddings=False), seed=3), True),
        "moe_bf16_sharded": (_build(root / "moe_bf16", pf_transformers.Ernie4_5_MoeConfig(
            **SMALL, **moe_config), seed=4, dtype="bfloat16", max_shard_size="100KB"), True),
    }
    try:
        yield {name: (path, _reference_tokens(path, moe)) for name, (path, moe) in built.items()}
    finally:
        mp.undo()


def test_checkpoints_are_what_users_download(checkpoints):
    """The fixtures really have the layouts the engine must read (else the other tests prove less)."""
    import os

    moe_dir = checkpoints["moe_bf16_sharded"][0]
    index = json.load(open(os.path.join(moe_dir, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    assert any(k.startswith("model.mtp_block.") for k in index["weight_map"])  # skipped by the loader
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in index["weight_map"]
    assert json.load(open(os.path.join(moe_dir, "config.json")))["torch_dtype"] == "bfloat16"
    assert "tie_word_embeddings" in json.load(open(os.path.join(checkpoints["dense_tied_fp32"][0], "config.json")))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["dense_tied_fp32", "dense_untied_bf16_sharded", "moe_fp32", "moe_bf16_sharded"])
def test_greedy_tokens_equal_paddleformers(checkpoints, monkeypatch, name, mode):
    path, expected = checkpoints[name]
    env, engine_args = MODES[mode]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    llm = LLM(model=path, block_size=16, num_gpu_blocks_override=32, max_model_len=256, **engine_args)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT
    assert out.outputs.token_ids == expected


def test_bf16_checkpoint_computes_in_float32_on_cpu(checkpoints):
    """--dtype auto keeps the checkpoint's dtype only where the device has kernels for it."""
    llm = LLM(model=checkpoints["moe_bf16_sharded"][0], block_size=16, num_gpu_blocks_override=8, max_model_len=64)
    assert llm.engine.model_config.dtype == "float32"  # Paddle has no CPU bf16 matmul
    weights = llm.engine.runner.model.weights
    assert weights["model.layers.1.mlp.gate.weight"].dtype == paddle.float32  # the router stays float32


def test_chat_prompt_ids_equal_paddleformers_apply_chat_template(checkpoints):
    from paddleformers.transformers import AutoTokenizer

    path = checkpoints["moe_fp32"][0]
    expected = AutoTokenizer.from_pretrained(path).apply_chat_template(
        CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    llm = LLM(model=path, block_size=16, num_gpu_blocks_override=16, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.chat([CHAT, CHAT[:2]], params, use_tqdm=False)
    assert outs[0].prompt_token_ids == expected
    tokenizer = llm.engine.tokenizer
    # the special tokens the template and the user wrote are single ids, not split into pieces
    assert expected.count(tokenizer.encode("<|end_of_sentence|>")[0]) == 2 and len(tokenizer.encode("</s>")) == 1
    assert outs[1].prompt_token_ids == AutoTokenizer.from_pretrained(path).apply_chat_template(
        CHAT[:2], tokenize=True, add_generation_prompt=True)["input_ids"]


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A sentencepiece BPE tokenizer.model (trained here, byte fallback) with ERNIE's special-token files."""
    import io

    spm = pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("sp")
    corpus = ("The quick brown fox jumps over the lazy dog. Hello world, a tiny sentencepiece model for tests. "
              "User Assistant system message content role chat template begin end sentence. ") * 50
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus.split(". ")), model_writer=model, vocab_size=400,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, pad_id=-1, byte_fallback=True,
                                   character_coverage=1.0, minloglevel=2)
    (path / "tokenizer.model").write_bytes(model.getvalue())
    (path / "added_tokens.json").write_text(json.dumps({"<|begin_of_sentence|>": 400, "<|end_of_sentence|>": 401}))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>",
               "sep_token": "<|end_of_sentence|>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special))
    (path / "tokenizer_config.json").write_text(json.dumps({**special, "tokenizer_class": "Ernie4_5Tokenizer",
                                                            "chat_template": CHAT_TEMPLATE}))
    return str(path)


SP_TEXTS = ["Hello world", " leading space", "two  spaces\nand a newline", "a<|end_of_sentence|>b", "x </s> y",
            "unicode é 漢字 🙂", "The quick brown fox", "  trailing   and   inner  ", "a\n\n  b\tc", "", "   "]


def test_sentencepiece_tokenizer_equals_the_sentencepiece_library(sentencepiece_dir):
    """The model file's own reader is the first oracle: its normaliser spec (dummy prefix, extra
    whitespace removed) decides the pieces of plain text."""
    import sentencepiece

    from fastdeploy.input.tokenizer import HFTokenizer

    ref = sentencepiece.SentencePieceProcessor(model_file=os.path.join(sentencepiece_dir, "tokenizer.model"))
    ours = HFTokenizer(sentencepiece_dir, (2,), 410)
    for text in SP_TEXTS:
        if "<" not in text:  # the added special tokens live in the directory's json files, not the model
            assert ours.encode(text) == ref.encode(text), text


def test_sentencepiece_tokenizer_equals_paddleformers(sentencepiece_dir):
    from paddleformers.transformers import AutoTokenizer

    from fastdeploy.input.tokenizer import HFTokenizer

    ref = AutoTokenizer.from_pretrained(sentencepiece_dir)
    ours = HFTokenizer(sentencepiece_dir, (2,), 410)
    for text in SP_TEXTS:
        ids = ref.encode(text, add_special_tokens=False)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    chat = [dict(m) for m in CHAT] + [{"role": "user", "content": "unicode é\n 漢字  end"}]
    assert ours.encode_chat(chat) == ref.apply_chat_template(chat, tokenize=True,
                                                             add_generation_prompt=True)["input_ids"]
