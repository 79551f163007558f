"""FD_ATTENTION_BACKEND=CUDA_ON_CPU: the real engine, scheduler and cache manager with the CUDA op's own
kernels executed on the CPU (bf16 pages, as on a GPU). Greedy tokens equal those of the CPU op with the
same page format (APPEND_ATTN, --cache-dtype bfloat16) in 1-D and head-wise mode, pages recycled while
decoding, and the dense float32 NATIVE_ATTN oracle's until a near tie (bf16 rounding moves only those).
The model: the tiny preset's head_dim-64 twin (4 KV heads, head 0 sliding with window 128, sink 16)."""

import pytest

from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import find_cuda_include
from greedy_run import MODES, greedy_tokens

pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_cuda_include() is None,
                                reason="the CUDA toolkit's headers (cuda_bf16.h) are needed to build the kernels")]

MODEL = "ernie-4.5-tiny-swa-hd64"
PROMPT_LENGTHS = [7, 130, 300]  # the longest recycles sliding pages while it decodes
MAX_TOKENS = 16


def prompts():
    varied = [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in PROMPT_LENGTHS]
    # A repetitive one, whose n-gram drafts get accepted; and, admitted once a seat frees, one that shares the
    # 300-token prompt's first 12 blocks: the kernels read pages a prefix-cache hit gave it.
    return varied + [[5, 6, 7, 8] * 40, varied[2][:200] + [9, 10, 11]]


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


def generate(monkeypatch, backend, mode, **engine_args):
    args = {"model": MODEL, "block_size": 16, "max_model_len": 1024, "max_num_seqs": 4, "num_gpu_blocks_override": 256,
            **engine_args}
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, *MODES[mode], **args)


@pytest.fixture(scope="module")
def oracles():
    """(tokens of the CPU op on bf16 pages, (tokens, top-2 logprobs) of the dense float32 oracle)."""
    mp = pytest.MonkeyPatch()
    try:
        same_pages, _ = generate(mp, "APPEND_ATTN", "1d", cache_dtype="bfloat16")
        mp.undo()
        dense, _ = generate(mp, "NATIVE_ATTN", "1d", logprobs=2)
    finally:
        mp.undo()
    return same_pages, dense


NEAR_TIE = 1e-2  # nats between the dense oracle's top two tokens


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_the_cuda_kernels_on_the_cpu_serve_the_cpu_ops_greedy_tokens(monkeypatch, oracles, mode):
    same_pages, dense = oracles
    tokens, engine = generate(monkeypatch, "CUDA_ON_CPU", mode)
    assert tokens == same_pages
    assert engine.get_stats()["prefix_cache_hit_tokens_total"] >= 192
    if mode == "head_wise_recycle_on":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0
    for got, (want, logprobs) in zip(tokens, dense):
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is not None:  # only a near tie of the float32 oracle may go the other way
            top = sorted(logprobs[first].values(), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, (first, logprobs[first])


@pytest.fixture(scope="module")
def int8_oracle():
    mp = pytest.MonkeyPatch()
    try:
        tokens, _ = generate(mp, "APPEND_ATTN", "1d", kv_cache_quant_type="int8", cache_dtype="float32")
    finally:
        mp.undo()
    return tokens


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_int8_pages_through_the_cuda_kernels_give_the_cpu_ops_tokens(monkeypatch, int8_oracle, mode):
    """The same int8 codes and scales (written by the CUDA cache-write kernel here, by the CPU op there)."""
    tokens, _ = generate(monkeypatch, "CUDA_ON_CPU", mode, kv_cache_quant_type="int8")
    assert tokens == int8_oracle


@pytest.mark.parametrize("quant", ["block_wise_int4", "k8v4"])
def test_int4_pages_through_the_cuda_kernels_give_the_same_tokens_in_every_memory_mode(monkeypatch, quant):
    """int4 codes two per byte (block_wise_int4: keys and values; k8v4: the values, beside int8 keys), written
    by the CUDA cache-write kernel: head-wise tables with sliding pages recycled give the 1-D table's tokens.
    (Against the CPU op the comparison is made per op, on the same bf16 rows:
    tests/custom_ops/test_cpu_op_and_cuda_kernels_write_the_same_pages.py. The engine's CPU op quantizes
    float32 K/V where these kernels take bf16, and 4-bit codes turn that rounding into code flips: 2 of these
    5 prompts part from the CPU op's block_wise_int4 tokens, where its top-2 margin is 0.02 and 0.07 nats.)"""
    one_d, _ = generate(monkeypatch, "CUDA_ON_CPU", "1d", kv_cache_quant_type=quant)
    head_wise, engine = generate(monkeypatch, "CUDA_ON_CPU", "head_wise_recycle_on", kv_cache_quant_type=quant)
    assert head_wise == one_d
    assert engine.get_stats()["swa_pages_recycled_total"] > 0
    backend = engine.runner.attn_backend  # the lanes the kernels wrote: k8v4's keys int8, its values int4 pairs
    assert backend.value_caches[0].dtype.name == "UINT8" and backend.value_caches[0].shape[-1] == 32
    assert backend.key_caches[0].dtype.name == ("INT8" if quant == "k8v4" else "UINT8")


def test_speculative_verification_through_the_cuda_kernels_keeps_the_tokens(monkeypatch, oracles):
    """Drafts verified as multi-token rows (the prefill kernel) with sliding pages recycled on the
    accepted count: the tokens of plain decoding."""
    tokens, engine = generate(monkeypatch, "CUDA_ON_CPU", "head_wise_recycle_on", speculative_config=SPEC)
    assert tokens == oracles[0]
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens_total"] > 0 and stats["swa_pages_recycled_total"] > 0


def test_cuda_on_cpu_refuses_a_head_dim_the_kernels_lack(monkeypatch):
    with pytest.raises(ValueError, match="head_dim"):
        generate(monkeypatch, "CUDA_ON_CPU", "1d", model="ernie-4.5-tiny-swa")
