"""SmolLM2-135M-Instruct chat through the CUDA op's kernels executed on the CPU (FD_ATTENTION_BACKEND=
CUDA_ON_CPU), text in: the engine's prompt ids equal transformers' chat template, and the greedy tokens
equal the CPU op's on the same bf16 pages, in 1-D and head-wise mode with a window short enough that
sliding pages recycle while the answers decode."""

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy import envs
from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import find_cuda_include

pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_cuda_include() is None,
                                reason="the CUDA toolkit's headers (cuda_bf16.h) are needed to build the kernels")]

CHATS = ["What is the capital of France?", "Write one sentence about the sea."]
SHORT_WINDOW = {"sliding_window": 16, "sink_size": 4, "swa_kv_heads": [0]}
MODES = {"1d": (dict(FD_HEAD_WISE_KV_CACHE=0), {}),
         "head_wise_recycle_on": (dict(FD_HEAD_WISE_KV_CACHE=1, FD_HEAD_WISE_SWA_RECYCLE=1),
                                  dict(head_wise_swa_config=SHORT_WINDOW))}


def _chat(path, backend, mode, **args):
    flags, mode_args = MODES[mode]
    with envs.override(FD_ATTENTION_BACKEND=backend, **flags):
        llm = LLM(model=path, max_model_len=512, block_size=16, **mode_args, **args)
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS], SamplingParams(temperature=0, max_tokens=24))
    return [list(o.prompt_token_ids) for o in outs], [list(o.outputs.token_ids) for o in outs], llm.engine


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_smollm2_chat_on_the_cuda_kernels_gives_the_cpu_ops_tokens(monkeypatch, smollm2_path, smollm2_reference,
                                                                  mode):
    monkeypatch.setenv("CUDA_ON_CPU_SM_COUNT", "4")  # fewer empty decode splits: faster
    tokenizer, _ = smollm2_reference
    want_ids = [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for c in CHATS]
    ids, want, _ = _chat(smollm2_path, "APPEND_ATTN", mode, cache_dtype="bfloat16")
    got_ids, got, engine = _chat(smollm2_path, "CUDA_ON_CPU", mode)
    assert ids == got_ids == [list(i) for i in want_ids]
    if mode != "1d":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0
    assert got == want
