"""Tokenizers: byte-level for the tiny preset, tokenizer.json / sentencepiece for model directories."""

from __future__ import annotations

import os
from typing import Optional

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class _ChatTemplate:
    """A plain-text chat template: one `<|role|>` line per message, then the assistant's turn."""

    def apply_chat_template(self, messages: list) -> str:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        parts = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"messages[{i}] must be an object with role and content")
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string")
            parts.append(f"<|{role}|>\n{content}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)


class ByteTokenizer(_ChatTemplate):
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


class HFTokenizer(_ChatTemplate):
    """A `tokenizer.json` (Hugging Face tokenizers) or a sentencepiece `tokenizer.model`."""

    def __init__(self, model_dir: str, eos_token_id: int, vocab_size: int):
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        json_path = os.path.join(model_dir, "tokenizer.json")
        sp_path = os.path.join(model_dir, "tokenizer.model")
        if os.path.isfile(json_path):
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise RuntimeError("the model ships tokenizer.json: pip install tokenizers") from None
            tok = Tokenizer.from_file(json_path)
            self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: tok.decode(ids)
            self._piece = tok.id_to_token
            self._byte_level = _decoder_is_byte_level(json_path)
        else:
            try:
                import sentencepiece
            except ImportError:
                raise RuntimeError("the model ships tokenizer.model: pip install sentencepiece") from None
            sp = sentencepiece.SentencePieceProcessor(model_file=sp_path)
            self._encode = lambda text: sp.encode(text)
            self._decode = lambda ids: sp.decode(ids)
            self._piece = sp.id_to_piece
            self._byte_level = False

    def encode(self, text: str) -> list:
        return list(self._encode(text))

    def decode(self, ids: list) -> str:
        return self._decode([i for i in ids if i != self.eos_token_id])

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
        if token_id == self.eos_token_id:
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def decode_incremental(self, ids: list, state: list) -> str:
        # Subword decoders are not concatenative (leading spaces, merges): decode everything.
        return self.decode(ids)


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


def load_tokenizer(model_config) -> "ByteTokenizer | HFTokenizer":
    model_dir: Optional[str] = model_config.model
    if model_dir and any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer.model")):
        return HFTokenizer(model_dir, model_config.eos_token_id, model_config.vocab_size)
    tok = ByteTokenizer(model_config.pad_token_id, model_config.bos_token_id, model_config.eos_token_id)
    if model_config.vocab_size < tok.vocab_size:
        raise ValueError(f"model has vocab_size={model_config.vocab_size} but no tokenizer file; the byte-level "
                         f"tokenizer needs {tok.vocab_size}")
    tok.vocab_size = model_config.vocab_size
    return tok
