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
import re
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

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt)

    def encode_chat(self, messages: list, add_generation_prompt: bool = True) -> list:
        """Prompt token ids of a conversation: the template places the special tokens itself."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


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


class HFTokenizer(_Chat):
    """A `tokenizer.json` (Hugging Face tokenizers) or a sentencepiece `tokenizer.model`."""

    def __init__(self, model_dir: str, eos_token_id, vocab_size: int):
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        special_map = {**config, **_read_json(os.path.join(model_dir, "special_tokens_map.json"))}
        self.special_tokens = {k: _content(special_map.get(k)) for k in SPECIAL_TOKEN_KEYS
                               if _content(special_map.get(k))}
        special = list(dict.fromkeys([*self.special_tokens.values(), *filter(
            None, map(_content, special_map.get("additional_special_tokens") or ()))]))
        added = {c: int(i) for c, i in _read_json(os.path.join(model_dir, "added_tokens.json")).items()}
        for token_id, spec in (config.get("added_tokens_decoder") or {}).items():
            if _content(spec):
                added[_content(spec)] = int(token_id)
                if isinstance(spec, dict) and spec.get("special") and _content(spec) not in special:
                    special.append(_content(spec))

        json_path = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(json_path):
            self._init_tokenizers(json_path, special, added)
        else:
            self._init_sentencepiece(os.path.join(model_dir, "tokenizer.model"), special, added)
        source = find_chat_template(model_dir, config)
        if source is not None:
            self.chat_template = JinjaChatTemplate(source, self.special_tokens)

    def _init_tokenizers(self, path: str, special: list, added: dict) -> None:
        try:
            from tokenizers import AddedToken, Tokenizer
        except ImportError:
            raise RuntimeError("the model ships tokenizer.json: pip install tokenizers") from None
        tok = Tokenizer.from_file(path)
        # Tokens the config names as special/added become whole tokens in text, as in transformers.
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        tok.add_tokens([AddedToken(t, normalized=False) for t in sorted(added, key=added.get) if t not in special])
        self.special_ids = {tok.token_to_id(t) for t in special} - {None}
        self._known = tok.get_vocab_size(with_added_tokens=True)
        self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
        self._decode = lambda ids: tok.decode(ids, skip_special_tokens=True)

    def _init_sentencepiece(self, path: str, special: list, added: dict) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise RuntimeError("the model ships tokenizer.model: pip install sentencepiece") from None
        sp = sentencepiece.SentencePieceProcessor(model_file=path)
        ids = dict(added)
        for token in special:
            if token not in ids and sp.piece_to_id(token) != sp.unk_id():
                ids[token] = sp.piece_to_id(token)
        self.special_ids = {ids[t] for t in special if t in ids}
        self._known = max([sp.get_piece_size(), *(i + 1 for i in ids.values())])
        text_of = {i: t for t, i in ids.items()}
        # Added/special tokens split the text first (longest first); the pieces between go to sentencepiece.
        pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True)) + ")") \
            if ids else None

        def encode(text: str) -> list:
            out: list = []
            for part in (pattern.split(text) if pattern else [text]):
                if part in ids:
                    out.append(ids[part])
                elif part:
                    out.extend(sp.encode(part))
            return out

        def decode(token_ids: list) -> str:
            text, run = [], []
            for i in token_ids:
                if i in text_of:
                    text.append(sp.decode(run))
                    run = []
                    text.append(text_of[i])
                elif i < sp.get_piece_size():
                    run.append(i)
            text.append(sp.decode(run))
            return "".join(text)

        self._encode, self._decode = encode, decode

    def encode(self, text: str) -> list:
        return list(self._encode(text))

    def decode(self, ids: list) -> str:
        eos = {self.eos_token_id} if isinstance(self.eos_token_id, int) else set(self.eos_token_id)
        kept = [i for i in ids if 0 <= i < self._known and i not in self.special_ids and i not in eos]
        try:
            return self._decode(kept)
        except Exception:  # a tokenizer that still rejects an id must not stop the engine
            return "\ufffd" * len(kept)

    def decode_incremental(self, ids: list, state: list) -> str:
        # Subword decoders are not concatenative (leading spaces, merges): decode everything.
        return self.decode(ids)


def load_tokenizer(model_config) -> "ByteTokenizer | HFTokenizer":
    """The checkpoint's tokenizer; only the built-in presets use the byte tokenizer, sized to its own
    vocab (their ids past 258 decode to nothing)."""
    model_dir: Optional[str] = model_config.model
    if model_dir is not None and any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return HFTokenizer(model_dir, model_config.eos_token_ids, model_config.vocab_size)
    if model_dir is None or model_config.raw.get("fastdeploy_byte_tokenizer"):  # a preset, or one saved
        return ByteTokenizer(model_config.pad_token_id, model_config.bos_token_id, model_config.eos_token_id)
    raise ValueError(f"model: {model_dir!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
