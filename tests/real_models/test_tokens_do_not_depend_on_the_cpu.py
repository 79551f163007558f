"""A request's greedy tokens and log-probs are the same bits on every instruction set the CPU kernels have
(AVX-512, AVX2 + FMA, portable C++): the real models from text, through the engine, with the kernels
capped by FD_CPU_LINEAR_ISA in a second process, against this machine's best. Since every kernel keeps
its bits across instruction sets, the engine's other promises (a row's bits do not depend on its batch
mates, the memory modes give the same tokens) hold identically on every machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

CHATS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]
MAX_TOKENS = 12
# (named model, env flags): the exact path with head-wise recycling and int8 pages (SmolLM2: SiLU, head_dim
# 64, Q4_1 / Q8_0 blocks), the opt-in int8 activations, and Gemma 3 (GELU, head_dim 256, sliding layers,
# Q4_K / Q6_K / Q8_0 blocks).
CASES = {
    "smollm2-head-wise-int8-pages": ("smollm2-135m-instruct", dict(FD_HEAD_WISE_KV_CACHE="1")),
    "smollm2-int8-activations": ("smollm2-135m-instruct", dict(FD_CPU_INT8_ACTIVATIONS="1")),
    "gemma3": ("gemma-3-270m", dict()),
}
KV_QUANT = {"smollm2-head-wise-int8-pages": "int8"}


def greedy_bits(case: str) -> list:
    """[(token ids, [logprob of each token])] per chat of `case`, in this process's environment."""
    from fastdeploy import LLM, SamplingParams, envs

    model, flags = CASES[case]
    quant = KV_QUANT.get(case)
    with envs.override(**{k: int(v) for k, v in flags.items()}):
        llm = LLM(model=model, max_model_len=512, max_num_seqs=4, block_size=16,
                  **({"kv_cache_quant_type": quant} if quant else {}))
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS],
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1), use_tqdm=False)
    return [(list(o.outputs.token_ids), [lp[t] for lp, t in zip(o.outputs.logprobs, o.outputs.token_ids)])
            for o in outs]


_CAPPED_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from test_tokens_do_not_depend_on_the_cpu import greedy_bits
print("RESULT " + json.dumps(greedy_bits({case!r})))
"""


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_are_the_same_bits_on_every_instruction_set(case, capped_isa):
    from fastdeploy.model_executor.models.named_models import resolve

    try:
        resolve(CASES[case][0])
    except ValueError as exc:
        pytest.skip(str(exc))
    script = _CAPPED_RUN.format(tests=os.path.dirname(__file__), case=case)
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, "FD_CPU_LINEAR_ISA": capped_isa},
                         check=True, timeout=900, capture_output=True, text=True)
    capped = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    best = greedy_bits(case)
    # JSON keeps a float's shortest repr, which round-trips to the same double.
    assert [[list(t), list(lp)] for t, lp in best] == capped
