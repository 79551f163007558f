"""Flag-off loglikelihoods through the HTTP server equal transformers' on the same SmolLM2 GGUF, request
by request: text in, tokenized by the server (its ids equal transformers' tokenizer's), scored with
`echo: true, logprobs: 1, max_tokens: 0`, as lm-evaluation-harness scores a context + continuation.
The longest request is prefilled in two 256-token chunks."""

import numpy as np
import pytest

from fastdeploy.entrypoints.openai.server_process import ApiServerProcess
from transformers_reference import reference_logits

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

TEXTS = [
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b\n",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
]
TOKEN_ATOL = 2e-3  # per token, as the first-token logprob checks of test_smollm2_vs_transformers.py


def _long_text() -> str:
    from pydoc_data.topics import topics

    return topics["compound"][:1300]  # ~300 tokens of prose and code


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    srv = ApiServerProcess(["--model", smollm2_path, "--max-model-len", "1024", "--max-num-batched-tokens", "256",
                            "--disable-uvicorn-access-log"],
                           log_path=tmp_path_factory.mktemp("smollm2_server") / "server.log",
                           env={"FD_HEAD_WISE_KV_CACHE": "0"})
    try:
        srv.wait_healthy(300)
        yield srv
    finally:
        srv.stop(60)


def test_server_loglikelihoods_equal_transformers(server, smollm2_reference):
    import httpx

    tokenizer, model = smollm2_reference
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        for text in TEXTS + [_long_text()]:
            ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
            assert ids == tokenizer.encode(text, add_special_tokens=False)
            body = http.post("/v1/completions", json={"prompt": text, "echo": True, "logprobs": 1,
                                                      "max_tokens": 0}).json()
            got = body["choices"][0]["logprobs"]["token_logprobs"]
            assert len(got) == len(ids) and got[0] is None
            ref = reference_logits(model, ids).astype(np.float64)
            ref = ref - ref.max(-1, keepdims=True)
            ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
            want = ref[np.arange(len(ids) - 1), ids[1:]]
            np.testing.assert_allclose(np.array(got[1:]), want, atol=TOKEN_ATOL)
            # The loglikelihood lm-eval sums for a continuation (here: the text's second half).
            half = len(ids) // 2
            assert sum(got[half:]) == pytest.approx(float(want[half - 1:].sum()), abs=TOKEN_ATOL * 10)
