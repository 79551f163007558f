"""Checkpoints written by PaddleFormers' `save_pretrained` load unchanged and decode greedily to
exactly PaddleFormers' tokens, in every memory mode and with chunked prefill; their tokenizers give
PaddleFormers' prompt ids.

PaddleFormers is the oracle, in an environment of its own: it declares transformers<5.4, the suite
holds 5.24, so it runs in a virtual environment built once (PaddleFormers and its transformers, the
suite's packages below them) by paddleformers_reference.py, whose answers come back as JSON.
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import paddle
import pytest

from fastdeploy import LLM, SamplingParams
from paddleformers_reference import CHAT, NEW_TOKENS, PROMPT, SP_CHAT, SP_TEXTS

PADDLEFORMERS = "paddleformers==1.2.0"
REFERENCE = Path(__file__).with_name("paddleformers_reference.py")
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


def oracle_python() -> str:
    """The oracle environment's Python: a virtual environment under ~/.cache/fastdeploy/oracles whose
    site-packages come before this environment's (a .pth line), with PaddleFormers installed by pip
    (only what this environment lacks or holds in another version: its transformers)."""
    here = sysconfig.get_paths()["purelib"]
    root = Path.home() / ".cache" / "fastdeploy" / "oracles"
    env_dir = root / f"paddleformers-1.2.0-{hashlib.sha256(here.encode()).hexdigest()[:8]}"
    python = env_dir / "bin" / "python"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (env_dir / "ready").is_file():
            shutil.rmtree(env_dir, ignore_errors=True)
            venv.EnvBuilder(with_pip=True).create(env_dir)
            site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            Path(site, "zz_suite_environment.pth").write_text(here + "\n")
            print(f"building PaddleFormers' environment in {env_dir} (once)", file=sys.stderr)
            done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                   PADDLEFORMERS], capture_output=True, text=True, timeout=1800)
            assert done.returncode == 0, f"pip install {PADDLEFORMERS} failed:\n{done.stderr[-3000:]}"
            (env_dir / "ready").write_text(PADDLEFORMERS)
    return str(python)


def paddleformers(request: dict, tmp_path) -> dict:
    out = tmp_path / "answer.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([oracle_python(), str(REFERENCE)], input=json.dumps({**request, "out": str(out)}),
                          capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> {"path", "tokens"} (PaddleFormers' greedy tokens), and "chat_ids"; built once."""
    root = tmp_path_factory.mktemp("pf")
    return paddleformers({"command": "checkpoints", "root": str(root)}, root)


@pytest.mark.slow
def test_checkpoints_are_what_users_download(checkpoints):
    """The fixtures really have the layouts the engine must read (else the other tests prove less)."""
    moe_dir = checkpoints["moe_bf16_sharded"]["path"]
    index = json.load(open(os.path.join(moe_dir, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    assert any(k.startswith("model.mtp_block.") for k in index["weight_map"])  # skipped by the loader
    assert "model.layers.1.mlp.moe_statics.e_score_correction_bias" in index["weight_map"]
    assert json.load(open(os.path.join(moe_dir, "config.json")))["torch_dtype"] == "bfloat16"
    assert "tie_word_embeddings" in json.load(open(os.path.join(checkpoints["dense_tied_fp32"]["path"],
                                                                "config.json")))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ["dense_tied_fp32", "dense_untied_bf16_sharded", "moe_fp32", "moe_bf16_sharded"])
def test_greedy_tokens_equal_paddleformers(checkpoints, monkeypatch, name, mode):
    env, engine_args = MODES[mode]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    llm = LLM(model=checkpoints[name]["path"], block_size=16, num_gpu_blocks_override=32, max_model_len=256,
              **engine_args)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT
    assert out.outputs.token_ids == checkpoints[name]["tokens"]


@pytest.mark.slow
def test_bf16_checkpoint_computes_in_float32_on_cpu(checkpoints):
    """--dtype auto keeps the checkpoint's dtype only where the device has kernels for it."""
    llm = LLM(model=checkpoints["moe_bf16_sharded"]["path"], block_size=16, num_gpu_blocks_override=8,
              max_model_len=64)
    assert llm.engine.model_config.dtype == "float32"  # Paddle has no CPU bf16 matmul
    weights = llm.engine.runner.model.weights
    assert weights["model.layers.1.mlp.gate.weight"].dtype == paddle.float32  # the router stays float32


@pytest.mark.slow
def test_chat_prompt_ids_equal_paddleformers_apply_chat_template(checkpoints):
    expected, expected_short = checkpoints["chat_ids"]
    llm = LLM(model=checkpoints["moe_fp32"]["path"], block_size=16, num_gpu_blocks_override=16, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.chat([CHAT, CHAT[:2]], params, use_tqdm=False)
    assert outs[0].prompt_token_ids == expected
    tokenizer = llm.engine.tokenizer
    # the special tokens the template and the user wrote are single ids, not split into pieces
    assert expected.count(tokenizer.encode("<|end_of_sentence|>")[0]) == 2 and len(tokenizer.encode("</s>")) == 1
    assert outs[1].prompt_token_ids == expected_short


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    """A sentencepiece BPE tokenizer.model (trained here, byte fallback) with ERNIE's special-token files."""
    import io

    from paddleformers_reference import CHAT_TEMPLATE

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
    return path


def test_sentencepiece_tokenizer_equals_the_sentencepiece_library(sentencepiece_dir):
    """The model file's own reader is the first oracle: its normaliser spec (dummy prefix, extra
    whitespace removed) decides the pieces of plain text."""
    import sentencepiece

    from fastdeploy.input.tokenizer import HFTokenizer

    ref = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_dir / "tokenizer.model"))
    ours = HFTokenizer(str(sentencepiece_dir), (2,), 410)
    for text in SP_TEXTS:
        if "<" not in text:  # the added special tokens live in the directory's json files, not the model
            assert ours.encode(text) == ref.encode(text), text


@pytest.mark.slow
def test_sentencepiece_special_tokens_and_chat_template_equal_paddleformers(sentencepiece_dir, tmp_path):
    """PaddleFormers decides the special tokens' ids and the chat's text; the pieces of plain text are the
    sentencepiece library's (above). PaddleFormers 1.2.0 on the transformers it declares (<5.4) drops the
    model's dummy prefix ("Hello world" -> H, ello, ▁world where the library gives ▁Hello, ▁world), so its
    plain-text ids are no oracle."""
    from fastdeploy.input.tokenizer import HFTokenizer

    ref = paddleformers({"command": "sentencepiece", "dir": str(sentencepiece_dir)}, tmp_path)
    ours = HFTokenizer(str(sentencepiece_dir), (2,), 410)
    assert {token: ours.encode(token) for token in ref["special_ids"]} == \
        {token: [i] for token, i in ref["special_ids"].items()}
    assert ours.encode_chat([dict(m) for m in SP_CHAT]) == ours.encode(ref["chat_text"])
