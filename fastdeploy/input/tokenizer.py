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
        else:
            try:
                import sentencepiece
            except ImportError:
                raise RuntimeError("the model ships tokenizer.model: pip install sentencepiece") from None
            sp = sentencepiece.SentencePieceProcessor(model_file=sp_path)
            self._encode = lambda text: sp.encode(text)
            self._decode = lambda ids: sp.decode(ids)

    def encode(self, text: str) -> list:
        return list(self._encode(text))

    def decode(self, ids: list) -> str:
        return self._decode([i for i in ids if i != self.eos_token_id])

    def decode_incremental(self, ids: list, state: list) -> str:
        # Subword decoders are not concatenative (leading spaces, merges): decode everything.
        return self.decode(ids)


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
