"""Completions echo with prompt logprobs over real HTTP: every prompt position's log-prob equals the
dense NATIVE_ATTN oracle's full forward, in 1-D and head-wise mode with recycling, with chunked
prefill forced (64-token steps) and prefix caching on (a request that scores its prompt skips
prefix-cache hits, so a repeated prompt is scored in full). The prompt is longer than the tiny
preset's 128-token window, so recycling drops pages while the prompt is still being scored."""

import numpy as np
import pytest

from fastdeploy.engine.request import SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 259, 300)]  # byte-tokenizer ids
TOP = 3
ATOL = 1e-4  # the paged op vs the dense oracle: float32 sums in another order


@pytest.fixture(scope="module")
def oracle():
    """float32 [len(PROMPT), vocab] log-probs of the dense NATIVE_ATTN reference (1-D, one chunk)."""
    from fastdeploy import LLM
    from fastdeploy.tools.prompt_logits import full_prompt_logprobs

    with pytest.MonkeyPatch.context() as mp:  # read when the engine is built; not left for other tests
        mp.setenv("FD_ATTENTION_BACKEND", "NATIVE_ATTN")
        mp.setenv("FD_HEAD_WISE_KV_CACHE", "0")
        llm = LLM(block_size=16, max_model_len=1024, enable_prefix_caching=False)
    return full_prompt_logprobs(llm, PROMPT)


@pytest.fixture(scope="module", params=["1d", "head_wise_recycle_on"])
def server(request, server_factory):
    flag = "0" if request.param == "1d" else "1"
    return server_factory("--max-num-batched-tokens", "64", "--enable-prefix-caching",
                          env={"FD_HEAD_WISE_KV_CACHE": flag, "FD_HEAD_WISE_SWA_RECYCLE": "1"})


def _score(server, **extra):
    body = {"prompt": PROMPT, "echo": True, "logprobs": TOP, "max_tokens": 1, "temperature": 0, **extra}
    resp = server.http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _assert_matches_oracle(choice, oracle):
    lp = choice["logprobs"]
    n = len(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.array(lp["token_logprobs"][1:n], np.float64)
    want = oracle[np.arange(n - 1), PROMPT[1:]]
    np.testing.assert_allclose(got, want, atol=ATOL)
    for p in (1, 150, n - 1):  # the top entries of positions before, inside and after the window
        top = sorted(lp["top_logprobs"][p].values(), reverse=True)
        np.testing.assert_allclose(top, np.sort(oracle[p - 1])[::-1][:TOP], atol=ATOL)


def test_echo_logprobs_of_every_prompt_position_equal_the_dense_oracle(server, oracle):
    body = _score(server)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    # The prompt, then the one generated token: n + 1 entries, offsets over the echoed text.
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(PROMPT) + 1
    assert choice["text"].startswith(server.http.post("/detokenize", json={"tokens": PROMPT}).json()["prompt"])
    _assert_matches_oracle(choice, oracle)
    # The generated token is the oracle's argmax after the whole prompt; its logprob the oracle's too.
    assert lp["token_logprobs"][-1] == pytest.approx(float(oracle[-1].max()), abs=ATOL)


def test_a_repeated_prompt_is_scored_in_full_despite_the_prefix_cache(server, oracle):
    _score(server)
    body = _score(server)  # its blocks are cached now; scoring recomputes them
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _assert_matches_oracle(body["choices"][0], oracle)
    plain = server.http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0}).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache itself works


def test_max_tokens_zero_returns_the_scored_prompt_only(server, oracle):
    body = _score(server, max_tokens=0)
    choice = body["choices"][0]
    assert len(choice["logprobs"]["token_logprobs"]) == len(PROMPT)
    assert body["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == server.http.post("/detokenize", json={"tokens": PROMPT}).json()["prompt"]
    _assert_matches_oracle(choice, oracle)


def test_echo_without_logprobs_and_streamed_echo(server):
    body = server.http.post("/v1/completions", json={"prompt": "Echo me", "echo": True, "max_tokens": 3,
                                                      "temperature": 0}).json()
    text = body["choices"][0]["text"]
    assert text.startswith("Echo me") and body["choices"][0]["logprobs"] is None
    with server.http.stream("POST", "/v1/completions", json={"prompt": "Echo me", "echo": True, "max_tokens": 3,
                                                            "temperature": 0, "logprobs": 1, "stream": True}) as r:
        import json

        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == text
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["tokens"][:7] == list("Echo me") and first["token_logprobs"][0] is None


def test_offline_prompt_logprobs_have_vllms_shape(oracle, monkeypatch):
    """`SamplingParams(prompt_logprobs=k)` -> RequestOutput.prompt_logprobs: None, then {token id: logprob}
    holding the prompt's token and the top k (offline, head-wise with recycling, 64-token chunks)."""
    from fastdeploy import LLM

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    llm = LLM(block_size=16, max_model_len=1024, max_num_batched_tokens=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    pl = out.prompt_logprobs
    assert len(pl) == len(PROMPT) and pl[0] is None
    for p in range(1, len(PROMPT)):
        assert PROMPT[p] in pl[p] and 2 <= len(pl[p]) <= 3
        assert pl[p][PROMPT[p]] == pytest.approx(float(oracle[p - 1, PROMPT[p]]), abs=ATOL)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": 0}, None),                                    # nothing to return
    ({"prompt": "hi", "max_tokens": 0, "echo": True, "stream": True}, None),     # scoring is not streamed
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
])
def test_bad_echo_requests_are_400s(server, helpers, body, param):
    helpers.assert_openai_error(server.http.post("/v1/completions", json=body), 400, param)
