"""Which tokenizer a model gets: its GGUF file's, its directory's files, or the presets' byte tokenizer.

Its own module so that the tokenizer modules need not know each other's callers: `tokenizer.py`
(byte and `tokenizers` pipelines) and `gguf_tokenizer.py` (built on those) import in one direction.
"""

from __future__ import annotations

import os
from typing import Optional

from fastdeploy.input.gguf_tokenizer import gguf_tokenizer
from fastdeploy.input.tokenizer import TOKENIZER_FILES, ByteTokenizer, HFTokenizer, TokenizersTokenizer


def load_tokenizer(model_config) -> "ByteTokenizer | TokenizersTokenizer":
    """The checkpoint's tokenizer; only the built-in presets use the byte tokenizer, sized to its own
    vocab (their ids past 258 decode to nothing). A GGUF model's comes from its file's metadata, through
    the loader's cached reader (gguf_loader.open_gguf), so the file is parsed once."""
    model_dir: Optional[str] = model_config.model
    if model_config.gguf_file is not None:
        return gguf_tokenizer(model_config.gguf_file)[0]
    if model_dir is not None and any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return HFTokenizer(model_dir, model_config.eos_token_ids, model_config.vocab_size)
    if model_dir is None or model_config.raw.get("fastdeploy_byte_tokenizer"):  # a preset, or one saved
        return ByteTokenizer(model_config.pad_token_id, model_config.bos_token_id, model_config.eos_token_id)
    raise ValueError(f"model: {model_dir!r} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")
