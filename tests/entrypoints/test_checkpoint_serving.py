"""`api_server --model DIR` serves a sharded MoE checkpoint directory with its own tokenizer and chat
template: /v1/chat/completions renders the template exactly like the offline `LLM.chat`."""

import json

import pytest

from fastdeploy import LLM, SamplingParams

tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = ("{{- cls_token -}}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
            "{% else %}{{ 'Assistant: ' + m['content'] + sep_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")
MESSAGES = [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w4"},
            {"role": "user", "content": "w5 </s> w6"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The MoE miniature saved as a checkpoint, its weights re-written as 2 shards, plus a tokenizer."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path_factory.mktemp("moe_ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FD_HEAD_WISE_KV_CACHE", "0")
        LLM(model="tiny-moe", block_size=16, num_gpu_blocks_override=16).engine.runner.model.save_pretrained(str(path))
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    weight_map = {}
    for s, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{s + 1}-of-00002.safetensors"
        save_file({n: weights[n] for n in part}, str(path / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(200)] + ["User", ":", "Assistant"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "cls_token": "<|begin_of_sentence|>",
        "sep_token": "<|end_of_sentence|>", "chat_template": TEMPLATE}))
    return path


def test_chat_completions_on_a_checkpoint_directory_match_offline_chat(server_factory, model_dir, monkeypatch):
    server = server_factory("--model", str(model_dir), "--max-model-len", "256")
    body = {"model": server.model_name(), "messages": MESSAGES, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    resp = server.http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    served = resp.json()

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    llm = LLM(model=str(model_dir), block_size=16, num_gpu_blocks_override=64, max_model_len=256)
    offline = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    tokenizer = llm.engine.tokenizer
    assert offline.prompt_token_ids[0] == tokenizer.encode("<|begin_of_sentence|>")[0]  # the template's cls_token
    assert tokenizer.encode("</s>") == [2]  # written in a message, the end token stays one token
    assert served["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert served["choices"][0]["message"]["content"] == offline.outputs.text
