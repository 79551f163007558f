"""Checkpoint directory -> named Paddle tensors, as PaddleFormers' `save_pretrained` writes them.

One shard file (`model.safetensors`) or several (`model-0000i-of-0000N.safetensors` listed by
`model.safetensors.index.json`); float32, float16 and bfloat16 tensors. The safetensors files are
parsed here (8-byte header length, JSON header, raw little-endian data) and memory-mapped, so a
tensor's bytes go straight into one Paddle tensor in the compute dtype: bfloat16 is reinterpreted
from its raw uint16 bits, never routed through a numpy dtype that does not exist. Each tensor is
yielded as soon as it is read and the caller keeps it; nothing here holds a second copy.

Parameter names stay the checkpoint's names (`model.layers.N.self_attn.q_proj.weight`, shape
`[out, in]`), so later stages (tensor-parallel sharding) can slice weights by name.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from typing import Iterator

import numpy as np
import paddle

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Tensors real ERNIE-4.5 checkpoints carry that serving does not use: the multi-token-prediction
# block (and its norms/projection) trained for speculative decoding.
UNUSED_TENSOR_PATTERNS = (re.compile(r"^model\.mtp_"), re.compile(r"^mtp_"))

# safetensors dtype tag -> (numpy dtype of the raw bytes, name of the stored dtype)
_STORED = {"F32": (np.float32, "float32"), "F16": (np.float16, "float16"), "BF16": (np.uint16, "bfloat16")}
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_files(model_dir: str) -> list:
    """The safetensors files of a model directory, in index order; a missing shard is an error."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"model: cannot read {index}: {exc!r}") from None
        files = list(dict.fromkeys(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise ValueError(f"model: shard {name!r} listed in {INDEX_FILE} is missing from {model_dir!r}")
        return [os.path.join(model_dir, name) for name in files]
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"model: {model_dir!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _read_header(f) -> tuple:
    length = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def checkpoint_dtype(model_dir: str) -> str:
    """The stored dtype of the checkpoint's weight matrices (the most common one, by tensor count)."""
    counts: dict = {}
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            header, _ = _read_header(f)
        for meta in header.values():
            if len(meta["shape"]) == 2:
                counts[meta["dtype"]] = counts.get(meta["dtype"], 0) + 1
    if not counts:
        return "float32"
    tag = max(counts, key=counts.get)
    if tag not in DTYPE_NAMES:
        raise ValueError(f"model: unsupported tensor dtype {tag} (supported: {', '.join(DTYPE_NAMES)})")
    return DTYPE_NAMES[tag]


def is_unused(name: str) -> bool:
    return any(p.match(name) for p in UNUSED_TENSOR_PATTERNS)


def _to_paddle(raw: np.ndarray, stored: str, dtype: str) -> paddle.Tensor:
    """One Paddle tensor in `dtype` from the raw (memory-mapped) stored array."""
    if stored == dtype:
        if stored == "bfloat16":
            return paddle.to_tensor(raw).view(paddle.bfloat16)
        return paddle.to_tensor(raw)
    if stored == "bfloat16":
        # bf16 is the upper half of a float32: widen the bits, no rounding involved.
        wide = (raw.astype(np.uint32) << 16).view(np.float32)
        return paddle.to_tensor(wide).astype(dtype) if dtype != "float32" else paddle.to_tensor(wide)
    return paddle.to_tensor(raw).astype(dtype)


def iter_checkpoint(model_dir: str, dtype: str, keep_float32: tuple = ()) -> Iterator[tuple]:
    """Yield `(name, tensor)` for every tensor of the checkpoint that serving uses, in `dtype`.

    Names matching a pattern in `keep_float32` (routers, their correction bias) stay float32,
    as PaddleFormers keeps them. Unused tensors (the MTP block) are skipped by name.
    """
    for path in checkpoint_files(model_dir):
        with open(path, "rb") as f:
            header, offset = _read_header(f)
            if not header:
                continue
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                for name, meta in header.items():
                    if is_unused(name):
                        continue
                    if meta["dtype"] not in _STORED:
                        raise ValueError(f"model: tensor {name} in {os.path.basename(path)} has unsupported dtype "
                                         f"{meta['dtype']} (supported: {', '.join(_STORED)})")
                    np_dtype, stored = _STORED[meta["dtype"]]
                    begin, end = meta["data_offsets"]
                    raw = np.frombuffer(mm, dtype=np_dtype, count=(end - begin) // np.dtype(np_dtype).itemsize,
                                        offset=offset + begin).reshape(meta["shape"])
                    target = "float32" if any(k in name for k in keep_float32) else dtype
                    tensor = _to_paddle(raw, stored, target)
                    del raw  # no view on the mmap may outlive this step: it must close even if the caller stops
                    yield name, tensor


def load_checkpoint(model_dir: str, expected_shapes: dict, dtype: str, keep_float32: tuple = (),
                    transform=None) -> dict:
    """All tensors of a checkpoint directory named in `expected_shapes`, checked (check_checkpoint)."""
    return check_checkpoint(iter_checkpoint(model_dir, dtype, keep_float32), expected_shapes, transform)


def check_checkpoint(tensors, expected_shapes: dict, transform=None) -> dict:
    """`(name, tensor)` pairs checked against `expected_shapes`: a missing, misshapen or unknown tensor is an
    error. `transform(name, tensor)`, when given, replaces each checked tensor as it is read (a
    tensor-parallel rank keeps only its slice, so the whole model is never held at once)."""
    weights: dict = {}
    for name, tensor in tensors:
        if name not in expected_shapes:
            raise ValueError(f"model: checkpoint tensor {name!r} is not a parameter of this model "
                             f"(architecture/config mismatch?)")
        if tuple(tensor.shape) != tuple(expected_shapes[name]):
            raise ValueError(f"model: checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected_shapes[name])} from the model config")
        weights[name] = tensor if transform is None else transform(name, tensor)
    missing = sorted(set(expected_shapes) - set(weights))
    if missing:
        raise ValueError(f"model: checkpoint is missing {len(missing)} parameter(s), e.g. {missing[:3]}")
    return weights


_ROPE_ROWS = ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias")
_ROPE_VECTORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # one head_dim vector, shared by heads


def to_engine_layout(name: str, tensor, model_config):
    """The one load-time conversion from a source's layout to the engine's (architectures.py):
    rotate-half q/k rows (and q/k norm weights) to interleaved pairs, and Gemma's RMSNorm offset
    folded into the weight, so the forward pass scales by the weight alone."""
    from fastdeploy.model_executor.models.architectures import ROTATE_HALF

    arch = model_config.arch
    layout = arch.gguf_rope_layout if model_config.gguf_file else arch.rope_layout
    if layout == ROTATE_HALF and name.endswith(_ROPE_ROWS + _ROPE_VECTORS):
        d = model_config.head_dim
        shape = list(tensor.shape)
        blocks = getattr(tensor, "gguf_blocks", None)
        order = np.arange(shape[0]).reshape(-1, 2, d // 2).transpose(0, 2, 1).ravel()  # row 2i <- i, 2i+1 <- i + d/2
        tensor = paddle.gather(tensor, paddle.to_tensor(order), axis=0)
        if blocks is not None:  # the same rows of the file's quantized blocks (layers/gguf_blocks.py)
            tensor.gguf_blocks = blocks.take_rows(order)
    if arch.norm_offset and name.endswith("norm.weight"):
        tensor = tensor + arch.norm_offset
    if arch.moe_style == "gpt_oss":  # its stacked experts, turned into [out, in] GEMM weights
        from fastdeploy.model_executor.models.gpt_oss_moe import engine_layout

        tensor = engine_layout(name, tensor)
    return tensor


def device_supports(dtype: str) -> bool:
    """Whether the device the model runs on (the CPU) has a matmul kernel for `dtype`; Paddle's CPU
    kernels have none for bfloat16/float16."""
    if dtype == "float32":
        return True
    try:
        x = paddle.to_tensor(np.ones((2, 2), np.float32), place=paddle.CPUPlace()).astype(dtype)
        paddle.matmul(x, x, transpose_y=True)
        return True
    except (RuntimeError, NotImplementedError, ValueError):
        return False
