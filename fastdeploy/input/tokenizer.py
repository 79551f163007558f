"""Tokenizers: byte-level for the built-in presets, the checkpoint's own for model directories.

A model directory brings `tokenizer.json` (Hugging Face tokenizers) or a sentencepiece
`tokenizer.model`, with its special and added tokens (`tokenizer_config.json`,
`special_tokens_map.json`, `added_tokens.json`) and its Jinja chat template. Special tokens written
in text (`</s>`, `<|end_of_sentence|>`) encode as their single id. Decoding never raises: an id the
tokenizer does not know (the model's vocab is larger, or a sampled id past the tokenizer) is
dropped from the text, so one odd token cannot take a batch down.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from fastdeploy.input.chat_template import (  # noqa: F401  (CHAT_ROLES is re-exported)
    CHAT_ROLES,
    JinjaChatTemplate,
    PlainChatTemplate,
    find_chat_template,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# transformers' order: tokens missing from the vocab get new ids in this order.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _Chat:
    chat_template = PlainChatTemplate()
    add_bos_token = False  # a raw prompt starts with bos (a GGUF file's tokenizer.ggml.add_bos_token: Gemma)
    bos_token_id = None

    def encode_prompt(self, text: str) -> list:
        """Token ids of a raw (completion) prompt: bos first where the model's tokenizer adds it."""
        ids = self.encode(text)
        return [self.bos_token_id] + ids if self.add_bos_token and self.bos_token_id is not None else ids

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list, add_generation_prompt: bool = True) -> list:
        """Prompt token ids of a conversation: a checkpoint's template places the special tokens itself;
        the plain transcript is a raw prompt."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode_prompt(text) if getattr(self.chat_template, "raw_prompt", False) else self.encode(text)


class ByteTokenizer(_Chat):
    """UTF-8 bytes shifted past three specials: 0 <pad>, 1 <s>, 2 </s>; byte b is id b + 3."""

    NUM_SPECIAL = 3

    def __init__(self, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2):
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        self.vocab_size = 256 + self.NUM_SPECIAL

    def encode(self, text: str) -> list:
        return [b + self.NUM_SPECIAL for b in text.encode("utf-8")]

    def decode(self, ids: list) -> str:
        data = bytes(i - self.NUM_SPECIAL for i in ids if self.NUM_SPECIAL <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def decode_incremental(self, ids: list, state: list) -> str:
        """decode(ids), reusing `state` = [tokens already decoded, their text] from the previous call.

        Only the tail since the last complete UTF-8 character is decoded again, so streaming a
        long output costs O(new tokens) per step instead of O(all tokens).
        """
        done, text = state
        tail = self.decode(ids[done:])
        if not tail.endswith("\ufffd"):
            state[0], state[1] = len(ids), text + tail
            return state[1]
        return text + tail

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (none for the specials)."""
        return bytes([token_id - self.NUM_SPECIAL]) if self.NUM_SPECIAL <= token_id < 256 + self.NUM_SPECIAL else b""

    def id_to_token(self, token_id: int) -> Optional[str]:
        return {self.pad_token_id: "<pad>", self.bos_token_id: "<s>", self.eos_token_id: "</s>"}.get(token_id)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from None
    return value if isinstance(value, dict) else {}


def _content(token) -> Optional[str]:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


class TokenizersTokenizer(_Chat):
    """A built `tokenizers` pipeline behind this engine's tokenizer interface: encode without added
    specials (templates place them), decode dropping special and end ids, token bytes for logprobs."""

    def __init__(self, tok, eos_token_id, vocab_size: int, special_tokens: dict, special: list,
                 chat_template: Optional[str], byte_level: bool):
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.special_tokens = dict(special_tokens)
        self.special_ids = {tok.token_to_id(t) for t in special} - {None}
        self._known = tok.get_vocab_size(with_added_tokens=True)
        self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        self._piece = tok.id_to_token
        self._byte_level = byte_level
        if chat_template is not None:
            self.chat_template = JinjaChatTemplate(chat_template, self.special_tokens)

    def encode(self, text: str) -> list:
        return list(self._encode(text))

    def decode(self, ids: list) -> str:
        eos = self._eos_ids()
        kept = [i for i in ids if 0 <= i < self._known and i not in self.special_ids and i not in eos]
        try:
            return self._decode(kept)
        except Exception:  # a tokenizer that still rejects an id must not stop the engine
            return "\ufffd" * len(kept)

    def _eos_ids(self) -> set:
        return {self.eos_token_id} if isinstance(self.eos_token_id, int) else set(self.eos_token_id)

    def id_to_token(self, token_id: int) -> Optional[str]:
        try:
            return self._piece(token_id)
        except Exception:  # out of range for this vocabulary
            return None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-fallback piece `<0xNN>` is that byte, a byte-level
        BPE piece maps back through GPT-2's byte alphabet, a sentencepiece piece's U+2581 is a space."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return self.decode([token_id]).encode("utf-8")
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
        if token_id in self.special_ids or token_id in self._eos_ids():
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def decode_incremental(self, ids: list, state: list) -> str:
        # Subword decoders are not concatenative (leading spaces, merges): decode everything.
        return self.decode(ids)


class HFTokenizer(TokenizersTokenizer):
    """A `tokenizer.json` (Hugging Face tokenizers) or a sentencepiece `tokenizer.model` (converted to the
    same `tokenizers` pipeline transformers builds from it)."""

    def __init__(self, model_dir: str, eos_token_id, vocab_size: int):
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        special_map = {**config, **_read_json(os.path.join(model_dir, "special_tokens_map.json"))}
        special_tokens = {k: _content(special_map.get(k)) for k in SPECIAL_TOKEN_KEYS if _content(special_map.get(k))}
        special = list(dict.fromkeys([*special_tokens.values(), *filter(
            None, map(_content, special_map.get("additional_special_tokens") or ()))]))
        added = {c: int(i) for c, i in _read_json(os.path.join(model_dir, "added_tokens.json")).items()}
        for token_id, spec in (config.get("added_tokens_decoder") or {}).items():
            if _content(spec):
                added[_content(spec)] = int(token_id)
                if isinstance(spec, dict) and spec.get("special") and _content(spec) not in special:
                    special.append(_content(spec))

        json_path = os.path.join(model_dir, "tokenizer.json")
        try:
            from tokenizers import AddedToken, Tokenizer
        except ImportError:
            raise RuntimeError("the model's tokenizer needs the tokenizers package: pip install tokenizers") from None
        if os.path.isfile(json_path):
            tok = Tokenizer.from_file(json_path)
        else:
            tok = sentencepiece_as_tokenizer(os.path.join(model_dir, "tokenizer.model"))
        # Tokens the config names as special/added become whole tokens in text, as in transformers:
        # those with declared ids first, in id order (a new token takes the next free id), then the rest.
        for token in sorted(added, key=added.get):
            if token in special:
                tok.add_special_tokens([AddedToken(token, special=True, normalized=False)])
            else:
                tok.add_tokens([AddedToken(token, normalized=False)])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special if t not in added])
        super().__init__(tok, eos_token_id, vocab_size, special_tokens, special, find_chat_template(model_dir, config),
                         os.path.isfile(json_path) and _decoder_is_byte_level(json_path))


def _decoder_is_byte_level(json_path: str) -> bool:
    import json

    with open(json_path, encoding="utf-8") as f:
        decoder = json.load(f).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


_ALPHABET: dict = {}


def _byte_level_alphabet() -> dict:
    """GPT-2's byte-level BPE alphabet, inverted: printable character -> the byte it stands for."""
    if not _ALPHABET:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                     *range(ord("\xae"), ord("\xff") + 1)]
        shifted = 0
        for b in range(256):
            if b in printable:
                _ALPHABET[chr(b)] = b
            else:
                _ALPHABET[chr(256 + shifted)] = b
                shifted += 1
    return _ALPHABET


def _bpe_merges(vocab: dict) -> list:
    """BPE merges of a sentencepiece vocab, as transformers derives them: every split of a piece into
    two pieces of the vocab, ranked by the merged piece's id, then the left and right lengths."""
    merges = []
    for piece, piece_id in vocab.items():
        local = [(piece[:i], piece[i:], piece_id) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [(left, right) for left, right, _ in merges]


def sentencepiece_as_tokenizer(path: str):
    """A sentencepiece `tokenizer.model` as a `tokenizers` pipeline that encodes as sentencepiece itself
    does: BPE (or Unigram) with byte fallback over the sentencepiece vocab, after the model's own
    normaliser spec (its precompiled character map; runs of spaces collapsed and the ends stripped when
    `remove_extra_whitespaces`; one "▁" in front when `add_dummy_prefix`; spaces -> "▁"), control
    pieces special. Checked against the sentencepiece library and PaddleFormers in the tests."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        raise RuntimeError("the model ships tokenizer.model: pip install sentencepiece protobuf") from None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE, Unigram

    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    pieces = [(p.piece, p.score) for p in proto.pieces]
    unk = pieces[proto.trainer_spec.unk_id][0]
    if proto.trainer_spec.model_type == 1:  # unigram
        spec = proto.trainer_spec
        tok = Tokenizer(Unigram(pieces, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback))
    else:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        tok = Tokenizer(BPE(vocab=vocab, merges=_bpe_merges(vocab), unk_token=unk, fuse_unk=True, byte_fallback=True))
    spec = proto.normalizer_spec
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip(left=True, right=True)]
    steps += [normalizers.Replace(" ", "\u2581")]
    if spec.add_dummy_prefix:
        steps += [normalizers.Prepend("\u2581")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(content=" ", left=1, right=0)] if spec.add_dummy_prefix
                                       else []))
    control, user = 3, 4  # SentencePiece.Type
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in proto.pieces if p.type == control])
    tok.add_tokens([AddedToken(p.piece, normalized=False) for p in proto.pieces if p.type == user])
    return tok
