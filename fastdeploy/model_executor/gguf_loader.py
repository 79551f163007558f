"""One GGUF file (llama.cpp's format) -> the model config and the named weights.

Read with the `gguf` package (llama.cpp's own Python reader). The metadata gives a config.json-style
dict (GGUF_CONFIG_KEYS); tensors are renamed to the checkpoint names the decoder uses
(GGUF_TENSOR_NAMES) and dequantized one at a time straight into the compute dtype, so each weight
is held once. The tokenizer and chat template come from the same metadata (input/gguf_tokenizer.py).

Anything the engine would get wrong silently — an architecture, a tensor type, a tensor, or a
metadata key it does not implement — stops the start-up with a ValueError naming it.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Iterator

import numpy as np

from fastdeploy.model_executor.models.architectures import (GGUF_ARCH_CONFIG_KEYS, GGUF_ARCHITECTURES, GGUF_CONFIG_KEYS,
                                                            GGUF_CONFIG_TENSORS, GGUF_NEUTRAL_VALUES,
                                                            GGUF_QUERY_SCALE_27B_LAYERS, GGUF_SLIDING_WINDOW_PATTERN,
                                                            GGUF_UNSUPPORTED_KEYS, gguf_tensor_names)

GGUF_MAGIC = b"GGUF"


def is_gguf(path: str) -> bool:
    """A file path that names a GGUF model (by its suffix, or its magic bytes)."""
    if path.lower().endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str):
    """A GGUFReader over the file; a missing, truncated or foreign file is a ValueError naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"model: GGUF file {path!r} does not exist")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"model: {path!r} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    stat = os.stat(path)
    return _reader(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)  # config, weights and tokenizer read one file: parse its header once
def _reader(path: str, mtime_ns: int, size: int):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ValueError("model: reading a GGUF file needs the `gguf` package: pip install gguf") from None
    try:
        return GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damaged files
        raise ValueError(f"model: cannot read GGUF file {path!r} (truncated or damaged?): "
                         f"{type(exc).__name__}: {exc}") from None


def field_value(reader, key: str, default=None):
    """A metadata value as a Python scalar, string or list; `default` when the key is absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_architecture(reader, path: str):
    arch_name = field_value(reader, "general.architecture")
    if arch_name not in GGUF_ARCHITECTURES:
        raise ValueError(f"model {path!r}: GGUF architecture {arch_name!r} is not supported; supported: "
                         f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    return GGUF_ARCHITECTURES[arch_name]


def gguf_config(reader, path: str) -> dict:
    """A config.json-style dict from the metadata: what ModelConfig.create validates for a directory."""
    arch = gguf_architecture(reader, path)
    prefix = arch.gguf_arch + "."
    own_keys = GGUF_ARCH_CONFIG_KEYS.get(arch.gguf_arch, {})
    for key in GGUF_UNSUPPORTED_KEYS:
        if prefix + key in reader.fields and key not in own_keys \
                and field_value(reader, prefix + key) not in GGUF_NEUTRAL_VALUES.get(key, ()):
            raise ValueError(f"model {path!r}: GGUF metadata {prefix + key} is not supported by this engine")
    raw = {"architectures": [arch.name], "model_type": arch.model_type}
    for key, name in {**GGUF_CONFIG_KEYS, **own_keys}.items():
        value = field_value(reader, prefix + key)
        if value is not None:
            raw[name] = value
    for key in ("block_count", "embedding_length", "attention.head_count"):
        if prefix + key not in reader.fields:
            raise ValueError(f"model {path!r}: GGUF metadata {prefix + key} is missing")
    heads = raw["num_attention_heads"]
    if isinstance(heads, list) or isinstance(raw.get("num_key_value_heads"), list):
        raise ValueError(f"model {path!r}: per-layer head counts ({prefix}attention.head_count as a list) "
                         "are not supported")
    head_dim = raw.get("head_dim", raw["hidden_size"] // heads)
    if raw.pop("value_head_dim", head_dim) != head_dim:
        raise ValueError(f"model {path!r}: GGUF {prefix}attention.value_length differs from key_length")
    if raw.pop("rope_dimension_count", head_dim) != head_dim:
        raise ValueError(f"model {path!r}: partial rotary ({prefix}rope.dimension_count < head_dim) is not supported")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"model {path!r}: GGUF file has no token_embd.weight tensor")
    raw["tie_word_embeddings"] = "output.weight" not in names
    raw["attention_bias"] = "blk.0.attn_q.bias" in names
    for tensor in reader.tensors:
        if tensor.name in GGUF_CONFIG_TENSORS:
            raw[GGUF_CONFIG_TENSORS[tensor.name]] = [float(x) for x in dequantize(tensor).reshape(-1)]
    if "vocab_size" not in raw:
        raw["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data) \
            if "tokenizer.ggml.tokens" in reader.fields else _tensor_rows(reader, "token_embd.weight")
    if arch.gguf_arch in GGUF_QUERY_SCALE_27B_LAYERS:  # llama.cpp's rule (the file has no key for it)
        big = raw["num_hidden_layers"] == GGUF_QUERY_SCALE_27B_LAYERS[arch.gguf_arch]
        raw["query_pre_attn_scalar"] = raw["hidden_size"] // heads if big else head_dim
    pattern = GGUF_SLIDING_WINDOW_PATTERN.get(arch.gguf_arch)
    if pattern is None:
        pattern = field_value(reader, prefix + "attention.sliding_window_pattern")
    if pattern is not None:
        raw["sliding_window_pattern"] = pattern
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("padding_token_id", "pad_token_id")):
        value = field_value(reader, "tokenizer.ggml." + key)
        if value is not None:
            raw[name] = int(value)
    return raw


def _tensor_rows(reader, name: str) -> int:
    return int(next(t for t in reader.tensors if t.name == name).shape[-1])


def checkpoint_name(gguf_name: str, arch) -> str:
    """The decoder's name for a GGUF tensor; a tensor the engine does not know is an error."""
    table = gguf_tensor_names(arch)
    m = re.match(r"^blk\.(\d+)\.(.+)$", gguf_name)
    key, layer = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (gguf_name, None)
    if key not in table or table[key] is None:
        raise ValueError(f"model: GGUF tensor {gguf_name!r} is not supported for architecture {arch.gguf_arch!r}")
    return table[key].format(i=layer)


def dequantize(tensor) -> np.ndarray:
    """float32 `[rows, cols]` (numpy order: the reverse of GGUF's) of any type the gguf package reads."""
    from gguf import GGMLQuantizationType, quants

    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        return np.asarray(tensor.data, dtype=np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.asarray(tensor.data).astype(np.float32)
    try:
        out = quants.dequantize(tensor.data, qtype)
    except (NotImplementedError, quants.QuantError, KeyError) as exc:
        raise ValueError(f"model: GGUF tensor {tensor.name} has type {qtype.name}, which cannot be dequantized "
                         f"here ({exc})") from None
    return out.astype(np.float32, copy=False).reshape([int(n) for n in reversed(tensor.shape)]) \
        if out.ndim != len(tensor.shape) else out


def iter_gguf_tensors(reader, arch) -> Iterator[tuple]:
    """(checkpoint name, float32 numpy array, GGUF tensor) per tensor, in file order, each dequantized on
    its own.

    Gemma's GGUF stores RMSNorm weights as 1 + w (llama.cpp folds the offset the decoder applies);
    they are given back as w, so a directory and a GGUF file of the same model hold the same numbers."""
    for tensor in reader.tensors:
        if tensor.name in GGUF_CONFIG_TENSORS:
            continue
        name = checkpoint_name(tensor.name, arch)
        array = dequantize(tensor)
        if arch.norm_offset and name.endswith("norm.weight"):
            array = array - arch.norm_offset
        yield name, array, tensor


def iter_gguf_checkpoint(model_config, keep_float32: tuple = ()) -> Iterator[tuple]:
    """(checkpoint name, Paddle tensor in the compute dtype) per tensor of the model's GGUF file.

    A float32 matrix of a quantized type also carries the file's blocks as `tensor.gguf_blocks`
    (layers/gguf_blocks.py), which the CPU's dense layers keep instead of the float32 copy when
    FD_CPU_GGUF_BLOCKS=1 and the blocks dequantize to exactly this tensor."""
    import paddle

    from fastdeploy import envs
    from fastdeploy.model_executor.layers import gguf_blocks

    reader = open_gguf(model_config.gguf_file)
    for name, array, source in iter_gguf_tensors(reader, gguf_architecture(reader, model_config.gguf_file)):
        tensor = paddle.to_tensor(array)
        del array  # one float32 copy at a time
        target = "float32" if any(k in name for k in keep_float32) else model_config.dtype
        if target != "float32":
            yield name, tensor.astype(target)
            continue
        if envs.FD_CPU_GGUF_BLOCKS:
            tensor.gguf_blocks = gguf_blocks.from_gguf(source)
        yield name, tensor
