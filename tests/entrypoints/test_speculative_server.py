"""The api_server with --speculative-config: the same text as plain decoding (streamed and not),
and the speculation counters on /metrics under upstream FastDeploy's names."""

import json

import pytest

from fastdeploy import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = [3 + (i * 37 + (i * i) % 23) % 250 for i in range(200)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--max-model-len", "512", "--speculative-config", json.dumps(SPEC))


@pytest.fixture(scope="module")
def plain_text():
    llm = LLM(block_size=16, max_model_len=512, num_gpu_blocks_override=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    return out[0].outputs.text


def test_completions_stream_and_metrics_with_speculation(server, plain_text, helpers):
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = server.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == plain_text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS

    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain_text

    metrics = server.wait_idle_with_all_pages_free()
    text = server.http.get("/metrics").text
    for name in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_emitted_tokens_total", "spec_decode_num_drafts_total"):
        assert f"# TYPE fastdeploy:{name} counter" in text
    drafted = metrics["fastdeploy:spec_decode_num_draft_tokens_total"]
    accepted = metrics["fastdeploy:spec_decode_num_accepted_tokens_total"]
    assert drafted > 0
    assert metrics["fastdeploy:spec_decode_draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    steps = metrics["fastdeploy:spec_decode_num_drafts_total"]
    assert metrics["fastdeploy:spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / steps)
