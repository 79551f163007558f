"""A query's attention output from the CPU op is the same bits however the step around it is cut.

The op folds a prefill chunk in tiles of consecutive tokens sharing each K/V page (the fast path)
and a decode token as a tile of one; preemption recomputes generated tokens as prefill, chunked
prefill cuts prompts where the token budget ends, and batch mates change the tiles' neighbours. The
engine's promise that a request's tokens never depend on its batch mates (and so that recycling ON
and OFF can be compared token for token) needs every one of those cuts to give identical bits, and
the AVX-512 kernels to agree with the portable ones. Quantized pages (int8, e4m3fn, int4 pairs in
uint8, k8v4's int8 keys beside int4 values, with per-row scales) keep the promise too: a row is
quantized once when it is written, whatever the cut.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.ops import append_attention

BLOCK, HEAD_DIM, KV_HEADS, GROUP = 16, 64, 2, 3
WINDOW, SINK = 40, 8  # head 0 slides, head 1 is full
TOKENS = 150
# float pages and the quantized formats (uint8: int4; k8v4: int8 keys, uint8 int4 values)
PAGE_DTYPES = ["float32", "int8", "float8_e4m3fn", "uint8", "k8v4"]
LANE_DTYPES = {"k8v4": ("int8", "uint8")}  # (key lane, value lane) where they differ
# gpt-oss's learned sinks and Gemma 2's soft-capping (a cap that bends these scores: both tanh branches run)
SINKS, SOFTCAP = np.array([0.5, -1.0, 2.0, 0.0, 1.5, -0.5], np.float32), 1.0


def _rotary(max_pos: int, head_dim: int):
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)
    angle = np.arange(max_pos)[:, None] * inv_freq[None, :]
    return (paddle.to_tensor(np.cos(angle).astype(np.float32)),
            paddle.to_tensor(np.sin(angle).astype(np.float32)))


class Run:
    """Requests prefilled and decoded through a cache of their own, step by step."""

    def __init__(self, qkv_rows: list, head_dim: int = HEAD_DIM, page_dtype: str = "float32", mods: bool = False):
        self.qkv = qkv_rows  # per request: [tokens, width] float32, the rows every step reads from
        self.mods = dict(attention_sinks=paddle.to_tensor(SINKS), softcap=SOFTCAP) if mods else {}
        self.d = head_dim
        blocks = [math.ceil(len(q) / BLOCK) for q in qkv_rows]
        self.table = np.full((len(qkv_rows), max(blocks)), -1, np.int32)
        start = 0
        for r, n in enumerate(blocks):
            self.table[r, :n] = np.arange(start, start + n)
            start += n
        cells = [start, KV_HEADS, BLOCK]
        lanes = LANE_DTYPES.get(page_dtype, (page_dtype, page_dtype))
        self.key_cache, self.value_cache = (paddle.zeros(cells + [head_dim // 2 if t == "uint8" else head_dim], t)
                                            for t in lanes)
        quantized = page_dtype != "float32"
        self.scales = [paddle.zeros(cells if quantized else [1], "float32") for _ in range(2)]
        self.done = [0] * len(qkv_rows)
        self.cos, self.sin = _rotary(max(len(q) for q in qkv_rows) + 1, head_dim)
        self.out = [[] for _ in qkv_rows]

    def step(self, counts: list) -> None:
        """One op call: request r advances by counts[r] tokens (0: idle in this step)."""
        i32 = lambda a: paddle.to_tensor(np.asarray(a, np.int32))  # noqa: E731
        rows = [self.qkv[r][self.done[r]:self.done[r] + c] for r, c in enumerate(counts)]
        encoder = [c if c > 1 or (c == 1 and self.done[r] == 0) else 0 for r, c in enumerate(counts)]
        out = append_attention(
            qkv=paddle.to_tensor(np.concatenate(rows)), key_cache=self.key_cache, value_cache=self.value_cache,
            seq_lens_encoder=i32(encoder), seq_lens_decoder=i32(self.done), seq_lens_this_time=i32(counts),
            cu_seqlens_q=i32(np.concatenate([[0], np.cumsum(counts)])), block_tables=paddle.to_tensor(self.table),
            rotary_cos=self.cos, rotary_sin=self.sin, head_windows=i32([[WINDOW, 0], [SINK, 0]]),
            key_cache_scales=self.scales[0], value_cache_scales=self.scales[1], num_heads=KV_HEADS * GROUP, kv_num_heads=KV_HEADS, head_dim=self.d,
            visit_all_pages=False, **self.mods,
        ).numpy()
        at = 0
        for r, c in enumerate(counts):
            self.out[r].append(out[at:at + c])
            at += c
            self.done[r] += c

    def outputs(self, r: int) -> np.ndarray:
        return np.concatenate(self.out[r])


def _qkv(seed: int, tokens: int, head_dim: int = HEAD_DIM) -> np.ndarray:
    width = (KV_HEADS * GROUP + 2 * KV_HEADS) * head_dim
    return np.random.default_rng(seed).standard_normal((tokens, width)).astype(np.float32)


def _cut(run: Run, r: int, pieces: list, others: int) -> None:
    for c in pieces:
        run.step([c if i == r else 0 for i in range(others)])


def _one_request_cut(pieces: list, head_dim: int = HEAD_DIM, page_dtype: str = "float32",
                     mods: bool = False) -> np.ndarray:
    run = Run([_qkv(0, TOKENS, head_dim)], head_dim, page_dtype, mods)
    _cut(run, 0, pieces, 1)
    return run.outputs(0)


@pytest.mark.parametrize("page_dtype, mods", [(p, False) for p in PAGE_DTYPES] + [("float32", True)])
def test_one_prefill_step_chunks_and_token_by_token_give_the_same_bits(page_dtype, mods):
    whole = _one_request_cut([TOKENS], page_dtype=page_dtype, mods=mods)
    assert np.isfinite(whole).all()
    # Chunks that split tiles (16 tokens) and pages (16 rows) anywhere, then decode one at a time.
    chunked = _one_request_cut([5, 16, 1, 30, 33, 7] + [1] * (TOKENS - 92), page_dtype=page_dtype, mods=mods)
    assert np.array_equal(whole, chunked)
    assert np.array_equal(whole, _one_request_cut([1] * TOKENS, page_dtype=page_dtype, mods=mods))


@pytest.mark.parametrize("page_dtype", PAGE_DTYPES)
def test_batch_mates_do_not_change_a_requests_bits(page_dtype):
    alone = _one_request_cut([TOKENS], page_dtype=page_dtype)
    # The same request next to two others, in a mixed prefill + decode schedule.
    run = Run([_qkv(7, 70), _qkv(0, TOKENS), _qkv(8, 90)], page_dtype=page_dtype)
    run.step([70, 0, 0])
    run.step([0, 60, 90])
    for _ in range(TOKENS - 60):
        run.step([0, 1, 0])
    assert np.array_equal(alone, run.outputs(1))


@pytest.mark.parametrize("head_dim, page_dtype", [(128, "float32"), (256, "float32"), (256, "int8"),
                                                  (256, "uint8"), (256, "k8v4")])
def test_other_head_dims_tiles_match_token_by_token(head_dim, page_dtype):
    # Each head_dim has its own kernel variants (256, Gemma 3's: q blocks in two passes; 128 the
    # two-query weighted values).
    whole = _one_request_cut([TOKENS], head_dim=head_dim, page_dtype=page_dtype)
    cut = _one_request_cut([3, 29] + [1] * (TOKENS - 32), head_dim=head_dim, page_dtype=page_dtype)
    assert np.array_equal(whole, cut)


# (head_dim, page format) beyond PAGE_DTYPES at HEAD_DIM: the other fixed-size score kernels, and head sizes
# only some vector widths take (40 and 24: multiples of 8, not 16; neither is rotated).
OTHER_SHAPES = [(128, "float32"), (256, "float32"), (256, "uint8"), (40, "int8"), (24, "float32")]


def _cuts_to_compare(pieces: list) -> list:
    """One request's outputs cut into `pieces` for every page format, with sinks and soft-capping, and at
    the other head sizes: what two instruction sets must agree on."""
    return ([_one_request_cut(pieces, page_dtype=p) for p in PAGE_DTYPES] + [_one_request_cut(pieces, mods=True)]
            + [_one_request_cut(pieces, d, p) for d, p in OTHER_SHAPES])


_CAPPED_RUN = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_attention_bits_do_not_depend_on_tiling import _cuts_to_compare
np.savez({path!r}, *_cuts_to_compare(json.loads({pieces!r})))
"""


def test_every_instruction_set_gives_the_best_kernels_bits(tmp_path, capped_isa):
    # Every case in one subprocess whose kernels are capped at AVX2 or the portable ones (the quantized
    # pages' reads and writes, the rotation, sinks and soft-capping have vector paths too).
    pieces = [20, 1, 40] + [1] * (TOKENS - 61)
    path = str(tmp_path / f"{capped_isa}.npz")
    script = _CAPPED_RUN.format(tests=os.path.dirname(__file__), path=path, pieces=json.dumps(pieces))
    env = {**os.environ, "FD_CPU_LINEAR_ISA": capped_isa}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600)
    capped = np.load(path)
    best = _cuts_to_compare(pieces)
    names = PAGE_DTYPES + ["sinks and soft-capping"] + [f"head_dim {d} {p}" for d, p in OTHER_SHAPES]
    for i, name in enumerate(names):
        assert np.array_equal(capped[f"arr_{i}"], best[i]), name
