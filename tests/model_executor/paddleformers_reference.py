"""PaddleFormers' side of test_paddleformers_oracle.py, run by the Python of the oracle's own environment
(PaddleFormers 1.2.0 declares transformers<5.4; the suite's environment holds 5.24). Reads a JSON request
on stdin and writes its answer as JSON into the request's "out" file (PaddleFormers logs on stdout):

- {"command": "checkpoints", "root": DIR}: writes four ERNIE-4.5 checkpoints with PaddleFormers'
  `save_pretrained` (dense tied float32, dense untied bf16 sharded, MoE float32, MoE bf16 sharded) and
  answers each one's greedy tokens from PaddleFormers' forward, and the chat template's prompt ids;
- {"command": "sentencepiece", "dir": DIR}: the ids PaddleFormers gives a sentencepiece directory's
  special tokens, and the text its chat template renders for SP_CHAT.

PaddleFormers' MoE layer dispatches tokens with GPU-only kernels, so on the CPU only that dispatch is
replaced: routing (gate, softmax, correction bias, top-k) and every expert MLP are its own modules.
The constants are the test's too (it imports them from here).
"""

import json
import sys

PROMPT = [3 + (i * 37) % 250 for i in range(40)]
NEW_TOKENS = 8
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
MOE = dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1)
# name -> (MoE?, config fields, seed, dtype, max shard size)
CHECKPOINTS = {
    "dense_tied_fp32": (False, dict(tie_word_embeddings=True), 1, "float32", "10GB"),
    "dense_untied_bf16_sharded": (False, dict(tie_word_embeddings=False), 2, "bfloat16", "40KB"),
    "moe_fp32": (True, dict(MOE, tie_word_embeddings=False), 3, "float32", "10GB"),
    "moe_bf16_sharded": (True, dict(MOE), 4, "bfloat16", "100KB"),
}
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
SP_TEXTS = ["Hello world", " leading space", "two  spaces\nand a newline", "a<|end_of_sentence|>b", "x </s> y",
            "unicode é 漢字 🙂", "The quick brown fox", "  trailing   and   inner  ", "a\n\n  b\tc", "", "   "]
SP_CHAT = CHAT + [{"role": "user", "content": "unicode é\n 漢字  end"}]


def write_tokenizer(path) -> None:
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


def _decisive_weights(model, seed: int) -> None:
    """Weights whose logits spread over a few units, so greedy argmax has clear winners (the default
    init, std 0.02, makes near-ties that float rounding could flip)."""
    import numpy as np
    import paddle

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
    import numpy as np
    import paddle

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


def _greedy_tokens(cls, path: str) -> list:
    """Greedy decoding with PaddleFormers' forward over the whole sequence, in float32."""
    import paddle

    model = cls.from_pretrained(path, dtype="float32")
    model.eval()
    model.config.fuse_rms_norm = False  # the fused RMSNorm kernel is GPU-only
    ids = list(PROMPT)
    with paddle.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(paddle.to_tensor([ids]))
            ids.append(int(paddle.argmax(out.logits[0, -1].astype("float32"))))
    return ids[len(PROMPT):]


def checkpoints(root: str) -> dict:
    from pathlib import Path

    from paddleformers.nn.moe import moe_allgather_layer
    from paddleformers.transformers import AutoTokenizer, Ernie4_5Config, Ernie4_5ForCausalLM, \
        Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM
    from paddleformers.transformers.ernie4_5_moe import modeling as moe_modeling

    # GPU-only op; for text-only routing without expert groups it returns the ids unchanged.
    moe_allgather_layer.expand_modality_expert_id = lambda ids, **kw: ids
    moe_modeling.Ernie4_5_MoeSparseMoeBlock.forward = _moe_forward_on_cpu
    answer = {}
    for name, (moe, fields, seed, dtype, shard) in CHECKPOINTS.items():
        config_cls, model_cls = (Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM) if moe else \
            (Ernie4_5Config, Ernie4_5ForCausalLM)
        path = Path(root) / name
        model = model_cls(config_cls(**SMALL, **fields))
        _decisive_weights(model, seed)
        if dtype != "float32":
            model.to(dtype=dtype)
        model.save_pretrained(str(path), max_shard_size=shard)
        write_tokenizer(path)
        answer[name] = {"path": str(path), "tokens": _greedy_tokens(model_cls, str(path))}
    tokenizer = AutoTokenizer.from_pretrained(answer["moe_fp32"]["path"])
    answer["chat_ids"] = [tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
                          for chat in (CHAT, CHAT[:2])]
    return answer


def sentencepiece(path: str) -> dict:
    from paddleformers.transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(path)
    special = ["<s>", "</s>", "<unk>", "<|begin_of_sentence|>", "<|end_of_sentence|>"]
    return {"special_ids": {token: int(ref.convert_tokens_to_ids(token)) for token in special},
            "chat_text": ref.apply_chat_template(SP_CHAT, tokenize=False, add_generation_prompt=True)}


if __name__ == "__main__":
    request = json.load(sys.stdin)
    answer = checkpoints(request["root"]) if request["command"] == "checkpoints" else sentencepiece(request["dir"])
    with open(request["out"], "w") as f:
        json.dump(answer, f)
