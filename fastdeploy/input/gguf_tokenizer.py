"""The tokenizer and chat template a GGUF file carries, built from its metadata as a `tokenizers` pipeline.

llama.cpp's converters store the tokenizer under `tokenizer.*`: `ggml.model` names the algorithm,
`ggml.tokens` the vocabulary in id order, `ggml.token_type` each token's kind, `ggml.merges` the BPE
merges, `ggml.scores` the SentencePiece scores, `ggml.pre` the pre-tokenizer of a BPE vocabulary,
`ggml.*_token_id` / `ggml.add_*_token` the special ids and `chat_template` the Jinja template.

- `gpt2`: byte-level BPE over tokens and merges; the text is first split by llama.cpp's regexes for
  the file's `pre` (llama-vocab.cpp), each regex refining the pieces of the one before, then mapped
  to GPT-2's byte alphabet.
- `llama`: a SentencePiece vocabulary with scores (spaces as U+2581, byte fallback `<0xNN>`), read as
  llama.cpp reads it: repeatedly join the adjacent pair whose joined piece scores highest, with
  user-defined pieces (Gemma's runs of spaces, tabs and newlines) matched whole first, longest first.
  That is the model's own tokenization: for Gemma 3 "The capital of France is Paris." is 7 tokens.
  (transformers 5.3.0's GGUF loader read it as a Unigram over the scores and cut it into 14; checked
  against llama.cpp's llama-tokenize and transformers 5.24.0 in tests/input/test_gguf_tokenizer.py.)

Control (and unknown) tokens are added special tokens and user-defined ones added tokens: written in
text they encode as their one id instead of being split. The ids that stop generation are the end-of-sequence
id, the end-of-turn id and the end-of-message id where the file has them; a file without an
end-of-turn id gets the end-of-turn token llama.cpp would find by its text, preferring the one the
chat template writes (`<|im_end|>` for ChatML, `<end_of_turn>` for Gemma).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from fastdeploy.input.tokenizer import TokenizersTokenizer

# llama.cpp's token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The pre-tokenizer regexes of llama.cpp (src/llama-vocab.cpp), in Oniguruma syntax.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


class _Pre:
    def __init__(self, regexes: tuple, ignore_merges: bool = False, add_bos: bool = False):
        # ignore_merges: a word that is itself a token is taken whole (llama.cpp's llama3 family).
        self.regexes, self.ignore_merges, self.add_bos = regexes, ignore_merges, add_bos


_DEFAULT = _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))
_GPT2_PRE = _Pre((_GPT2,))
_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _Pre((_QWEN2,))
_DIGITS_THEN_GPT2 = _Pre((r"\p{N}", _GPT2))  # every digit alone, then GPT-2's split

# `tokenizer.ggml.pre` -> its pre-tokenizer, for the names llama.cpp gives these regexes.
PRE_TOKENIZERS = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), _GPT2_PRE),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_PRE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_PRE),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    _DIGITS_THEN_GPT2),
}
TOKENIZER_MODELS = ("gpt2", "llama")

# The end-of-turn tokens llama.cpp recognises by their text when a file names no eot id.
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>",
                      "<|end_of_text|>", "<EOT>", "<end_of_utterance>")
END_OF_MESSAGE_TOKENS = ("<|eom_id|>",)


def gguf_tokenizer(source) -> tuple:
    """The tokenizer of a GGUF file (a path or an open `gguf.GGUFReader`), as llama.cpp tokenizes.

    Returns `(tokenizer, special, chat_template)`: the engine's tokenizer (encode, decode,
    decode_incremental, token_bytes, id_to_token, apply_chat_template, encode_chat); a dict with
    `bos_token_id`, `eos_token_id`, `eot_token_id`, `eom_token_id`, `pad_token_id`, `unk_token_id`
    (an id or None), `add_bos_token`, `add_eos_token` (bools: whether a raw prompt starts with bos /
    ends with eos) and `stop_token_ids` (the ids that end generation, eos first); the Jinja chat
    template (None when the file has none). Unsupported or malformed metadata is a ValueError naming it.
    """
    meta = _Metadata(source)
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF tokenizer: the file has no tokenizer (metadata key tokenizer.ggml.model)")
    if model not in TOKENIZER_MODELS:
        raise ValueError(f"GGUF tokenizer: tokenizer.ggml.model {model!r} is not supported "
                         f"(supported: {', '.join(TOKENIZER_MODELS)})")
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type")
    types = np.full(len(tokens), NORMAL) if types is None else np.asarray(types)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF tokenizer: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    ids = {name: meta.token_id(f"tokenizer.ggml.{name}", len(tokens))
           for name in ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id",
                        "unknown_token_id")}
    template = meta.get("tokenizer.chat_template")

    if model == "gpt2":
        pre_name = meta.get("tokenizer.ggml.pre") or "default"  # llama.cpp's fallback for a file without one
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ValueError(f"GGUF tokenizer: pre-tokenizer tokenizer.ggml.pre={pre_name!r} is not supported "
                             f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
        tok = _byte_level_bpe(tokens, meta.require("tokenizer.ggml.merges"), pre)
        add_bos_default = pre.add_bos
    else:
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        scores = meta.require("tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ValueError(f"GGUF tokenizer: tokenizer.ggml.scores has {len(scores)} entries "
                             f"for {len(tokens)} tokens")
        tok = _sentencepiece_bpe(tokens, scores, types, ids["unknown_token_id"])
        _sentencepiece_spaces(tok, add_space_prefix)
        add_bos_default = True

    from tokenizers import AddedToken

    special = [tokens[i] for i in np.flatnonzero(np.isin(types, (CONTROL, UNKNOWN)))]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    # User-defined pieces are text (decode keeps them), matched whole before the model runs.
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i in np.flatnonzero(types == USER_DEFINED)])

    stop = _complete_stop_ids(ids, tokens, template)
    info = {
        "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"],
        "eot_token_id": ids["eot_token_id"], "eom_token_id": ids["eom_token_id"],
        "pad_token_id": ids["padding_token_id"], "unk_token_id": ids["unknown_token_id"],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "stop_token_ids": stop,
    }
    # The template's variables, as transformers names them.
    names = {"bos_token": info["bos_token_id"], "eos_token": info["eos_token_id"],
             "unk_token": info["unk_token_id"], "pad_token": info["pad_token_id"]}
    template_tokens = {k: tokens[i] for k, i in names.items() if i is not None}
    tokenizer = TokenizersTokenizer(tok, stop, len(tokens), template_tokens, special, template,
                                    byte_level=model == "gpt2")
    tokenizer.bos_token_id, tokenizer.add_bos_token = info["bos_token_id"], info["add_bos_token"]
    return tokenizer, info, template


def stop_token_ids(source) -> tuple:
    """The ids that end generation — eos first, then end of turn and end of message — from the metadata
    alone (no tokenizer is built): what the engine's scheduler stops on."""
    meta = _Metadata(source)
    tokens = meta.require("tokenizer.ggml.tokens")
    ids = {name: meta.token_id(f"tokenizer.ggml.{name}", len(tokens))
           for name in ("eos_token_id", "eot_token_id", "eom_token_id")}
    return _complete_stop_ids(ids, tokens, meta.get("tokenizer.chat_template"))


def _complete_stop_ids(ids: dict, tokens: list, template: Optional[str]) -> tuple:
    """Fill in eot/eom by their text where the file names no id (in `ids`), then the stop ids in order."""
    by_text = {t: i for i, t in enumerate(tokens)}
    if ids["eot_token_id"] is None:
        ids["eot_token_id"] = _find_by_text(END_OF_TURN_TOKENS, by_text, template)
    if ids["eom_token_id"] is None:
        ids["eom_token_id"] = _find_by_text(END_OF_MESSAGE_TOKENS, by_text, template)
    return tuple(dict.fromkeys(i for i in (ids["eos_token_id"], ids["eot_token_id"], ids["eom_token_id"])
                               if i is not None))


def _find_by_text(candidates: tuple, by_text: dict, template: Optional[str]) -> Optional[int]:
    present = [t for t in candidates if t in by_text]
    in_template = [t for t in present if template and t in template]
    chosen = (in_template or present or [None])[0]
    return None if chosen is None else by_text[chosen]


def _byte_level_bpe(tokens: list, merges: list, pre: _Pre):
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for merge in merges:
        left, space, right = merge.partition(" ")
        if not space or left not in vocab or right not in vocab or left + right not in vocab:
            raise ValueError(f"GGUF tokenizer: tokenizer.ggml.merges has a merge that is not two tokens "
                             f"making a third: {merge!r}")
        pairs.append((left, right))
    tok = Tokenizer(BPE(vocab, pairs, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list, scores, types, unk_id: Optional[int]):
    """llama.cpp's SentencePiece tokenization as BPE: a merge for every split of a normal piece into
    two pieces of the vocabulary, ranked by the joined piece's score (ties: lower id, shorter left)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    score = np.asarray(scores, dtype=np.float64).tolist()
    ranked = []
    for i in np.flatnonzero(types == NORMAL).tolist():
        piece = tokens[i]
        for cut in range(1, len(piece)):
            if piece[:cut] in vocab and piece[cut:] in vocab:
                ranked.append((-score[i], i, cut))
    ranked.sort()
    merges = [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]
    unk = tokens[unk_id] if unk_id is not None else None
    return Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))


def _sentencepiece_spaces(tok, add_space_prefix: bool):
    """Spaces as U+2581 (one more in front when the file says so, taken off again in decoding)."""
    from tokenizers import decoders, normalizers

    steps = ([normalizers.Prepend("\u2581")] if add_space_prefix else []) + [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []))


class _Metadata:
    """Typed reads of a GGUF file's key/value metadata through the `gguf` package's reader."""

    def __init__(self, source):
        if hasattr(source, "fields"):
            self.reader = source
        else:  # the loader's reader: one parse of the file for config, weights and tokenizer
            from fastdeploy.model_executor.gguf_loader import open_gguf

            self.reader = open_gguf(str(source))

    def get(self, key: str, default=None):
        from gguf import GGUFValueType

        field = self.reader.fields.get(key)
        if field is None or not field.types:
            return default
        try:
            if field.types[0] == GGUFValueType.ARRAY:
                if field.types[-1] == GGUFValueType.STRING:
                    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
                return np.concatenate([field.parts[i] for i in field.data]) if len(field.data) else np.zeros(0)
            value = field.parts[field.data[0]]
            if field.types[0] == GGUFValueType.STRING:
                return bytes(value).decode("utf-8")
            return value[0].item()
        except (UnicodeDecodeError, IndexError) as exc:
            raise ValueError(f"GGUF tokenizer: metadata key {key} is malformed: {exc}") from None

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF tokenizer: metadata key {key} is missing")
        return value

    def token_id(self, key: str, vocab_size: int) -> Optional[int]:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < vocab_size:
            raise ValueError(f"GGUF tokenizer: {key}={value!r} is not a token id of the {vocab_size}-token vocabulary")
        return value
