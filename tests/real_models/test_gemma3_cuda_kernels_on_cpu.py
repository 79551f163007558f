"""Gemma 3 270M (head_dim 256, 4 q heads on 1 KV head, window 512) through the CUDA op's head_dim-256
kernels executed on the CPU (FD_ATTENTION_BACKEND=CUDA_ON_CPU): the real engine with per-head tables
and sliding pages recycled while a prompt past the window decodes gives the greedy tokens of the CPU
op on the same bf16 pages."""

import os
import sys

import pytest
from pydoc_data.topics import topics

from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import find_cuda_include

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e"))
from greedy_run import MODES, greedy_tokens  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_cuda_include() is None,
                                reason="the CUDA toolkit's headers (cuda_bf16.h) are needed to build the kernels")]

# Text, as users send it: a short prompt and prose past the 512-token window (pages recycle while it decodes).
# (The ~700-token slice test_gemma3_vs_transformers.py checks: no space run where transformers and llama.cpp differ.)
_PROSE = " ".join(topics.values())  # pydoc_data.topics: English prose in every Python
PROMPTS = ["The capital of France is", _PROSE[:3300]]
MAX_TOKENS = 6


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_gemma3_on_the_head_dim_256_cuda_kernels_gives_the_cpu_ops_tokens(monkeypatch, gemma3_path,
                                                                          gemma3_reference, mode):
    args = dict(model=gemma3_path, block_size=64, max_model_len=1024, max_num_seqs=2, num_gpu_blocks_override=128)
    want, _ = greedy_tokens(monkeypatch, PROMPTS, MAX_TOKENS, "APPEND_ATTN", *MODES[mode], cache_dtype="bfloat16",
                            **args)
    got, engine = greedy_tokens(monkeypatch, PROMPTS, MAX_TOKENS, "CUDA_ON_CPU", *MODES[mode], **args)
    tokenizer, _ = gemma3_reference
    ids = [tokenizer.encode(text) for text in PROMPTS]  # transformers' ids of the text (its <bos> first)
    assert [engine.tokenizer.encode_prompt(text) for text in PROMPTS] == ids and len(ids[1]) > 512
    if mode != "1d":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0  # the window's edge was crossed
    assert got == want
