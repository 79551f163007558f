"""Logprob token texts and bytes (OpenAI's convention) for the vocabularies the engine loads."""

import pytest

from fastdeploy.entrypoints.openai.engine_client import token_text_and_bytes
from fastdeploy.input.tokenizer import ByteTokenizer, HFTokenizer, _byte_level_alphabet


def test_a_lone_byte_of_the_byte_tokenizer_is_named_by_its_byte():
    tok = ByteTokenizer()
    assert token_text_and_bytes(tok, 0xE4 + 3) == ("bytes:\\xe4", [0xE4])
    assert token_text_and_bytes(tok, 0xE5 + 3)[0] != token_text_and_bytes(tok, 0xE4 + 3)[0]
    assert token_text_and_bytes(tok, ord("a") + 3) == ("a", [97])
    # A special decodes to nothing; as a top_logprobs key it gets its vocabulary name.
    assert token_text_and_bytes(tok, 2) == ("", [])
    assert token_text_and_bytes(tok, 2, name_specials=True) == ("</s>", [])


def test_byte_level_bpe_tokens_map_back_to_their_bytes(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    alphabet = sorted(_byte_level_alphabet(), key=_byte_level_alphabet().get)  # one char per byte, byte order
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for piece in ("\u0120t", "\u0120th", "\u0120the"):  # " t", " th", " the"
        vocab[piece] = len(vocab)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("\u0120", "t"), ("\u0120t", "h"), ("\u0120th", "e")]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path), eos_token_id=-1, vocab_size=len(vocab))
    the = vocab["\u0120the"]
    assert hf.token_bytes(the) == b" the" and token_text_and_bytes(hf, the) == (" the", list(b" the"))
    e4 = vocab[alphabet[0xE4]]
    assert hf.token_bytes(e4) == b"\xe4"
    assert token_text_and_bytes(hf, e4) == ("bytes:\\xe4", [0xE4])
