"""The server as upstream FastDeploy's benchmark client and dashboards see it.

The payloads below are the shapes upstream's benchmarks/backend_request_func.py sends (recorded
here, not imported): `openai-chat` with `stream_options.continuous_usage_stats`, `max_tokens` and
`metadata.min_tokens` for its random dataset; `openai` (completions) with only the request yaml's
fields. Upstream's client stamps TTFT on the first chunk with choices, counts one ITL per chunk,
reads `choices[0]["arrival_time"]` of every chunk and `data["usage"]` of the first.
"""

import json
import re

import pytest

# max_model_len 96: a completion without max_tokens runs to it quickly.
SERVER_ARGS = ("--max-model-len", "96")
# Upstream's request yaml (benchmarks/yaml/request_yaml/eb45-32k.yaml), greedy here so streamed
# and non-streamed answers can be compared.
REQUEST_YAML = {"top_p": 0.8, "temperature": 0, "metadata": {"min_tokens": 1}, "max_tokens": 24,
                "repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0}
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
EOS = 2  # the tiny preset's


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*SERVER_ARGS)


def upstream_chat_payload(model: str, messages: list, output_len: int, random_flag: bool = True) -> dict:
    payload = {"model": model, "messages": messages, "stream": True, "stream_options": dict(STREAM_OPTIONS),
               "max_tokens": output_len, "collect_metrics": False}
    payload.update(json.loads(json.dumps(REQUEST_YAML)))
    if random_flag:
        payload["max_tokens"] = output_len
        payload["metadata"]["min_tokens"] = output_len
    return payload


def upstream_completions_payload(model: str, prompt: str, **yaml_fields) -> dict:
    payload = {"model": model, "prompt": prompt, "stream": True, "stream_options": dict(STREAM_OPTIONS)}
    payload.update(yaml_fields)
    return payload


def stream(server, path: str, payload: dict) -> list[dict]:
    """Every JSON chunk of an SSE response, in order ([DONE] checked and dropped)."""
    with server.http.stream("POST", path, json=payload) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def token_chunks(chunks: list[dict]) -> list[dict]:
    return [c for c in chunks if c["choices"]]


def assert_upstream_stream_shape(chunks: list[dict], num_tokens: int) -> None:
    tokens = token_chunks(chunks)
    assert len(tokens) == num_tokens  # exactly one chunk per generated token
    arrivals = [c["choices"][0]["arrival_time"] for c in tokens]
    assert all(isinstance(t, float) and t > 0 for t in arrivals)
    assert arrivals == sorted(arrivals)
    assert [c["choices"][0]["finish_reason"] is not None for c in tokens] == [False] * (num_tokens - 1) + [True]
    assert all("usage" in c for c in tokens)  # upstream's chat client reads data["usage"] on the first chunk
    assert [c["usage"]["completion_tokens"] for c in tokens] == list(range(1, num_tokens + 1))
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == num_tokens
    assert "cached_tokens" in final["usage"]["prompt_tokens_details"]


def test_chat_stream_opens_with_a_role_chunk_then_one_chunk_per_token(server):
    # Upstream's serving_chat yields, when a choice's first result arrives, a role-only delta
    # (role "assistant", content "") with usage so far (completion 0), then one chunk per token;
    # its benchmark therefore takes the first token's server time (S_TTFT) from arrival_time[1].
    model = server.model_name()
    messages = [{"role": "user", "content": "Tell me about sliding windows."}]
    chunks = stream(server, "/v1/chat/completions", upstream_chat_payload(model, messages, 12))
    opening, rest = chunks[0], chunks[1:]
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert opening["choices"][0]["finish_reason"] is None
    assert opening["usage"]["completion_tokens"] == 0 and opening["usage"]["prompt_tokens"] > 0
    assert "cached_tokens" in opening["usage"]["prompt_tokens_details"]  # upstream's client reads it here
    assert_upstream_stream_shape(rest, 12)
    deltas = [c["choices"][0]["delta"] for c in token_chunks(rest)]
    assert all("role" not in d for d in deltas)
    arrivals = [c["choices"][0]["arrival_time"] for c in token_chunks(chunks)]
    assert arrivals[0] == arrivals[1]  # the role chunk goes out with the first token, not before prefill
    full = server.http.post("/v1/chat/completions", json={**upstream_chat_payload(model, messages, 12),
                                                          "stream": False}).json()
    assert "".join(d["content"] for d in deltas) == full["choices"][0]["message"]["content"]


def test_completions_stream_has_one_chunk_per_token_even_for_held_back_bytes(server):
    # The tiny preset's byte-level vocabulary makes lone UTF-8 bytes common: their chunks come
    # with empty text while the character is incomplete, but they still come.
    payload = upstream_completions_payload(server.model_name(), "byte tokens", max_tokens=20, temperature=1.0,
                                           seed=3, ignore_eos=True)
    chunks = stream(server, "/v1/completions", payload)
    assert_upstream_stream_shape(chunks, 20)
    texts = [c["choices"][0]["text"] for c in token_chunks(chunks)]
    full = server.http.post("/v1/completions", json={**payload, "stream": False}).json()
    assert "".join(texts) == full["choices"][0]["text"]


def test_metadata_min_tokens_is_merged_into_the_sampling_parameters(server):
    # EOS pushed to the top: without metadata.min_tokens the answer would end at its first token.
    payload = upstream_chat_payload(server.model_name(), [{"role": "user", "content": "hi"}], 10)
    payload["logit_bias"] = {str(EOS): 100}
    chunks = stream(server, "/v1/chat/completions", payload)
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    del payload["metadata"]
    assert stream(server, "/v1/chat/completions", payload)[-1]["usage"]["completion_tokens"] == 1


def test_completions_without_max_tokens_generate_up_to_max_model_len(server):
    body = {"prompt": "hi", "ignore_eos": True, "temperature": 0}
    usage = server.http.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == 2 and usage["completion_tokens"] == 96 - 2


def test_a_repeated_prompt_reports_its_prefix_cache_hit_as_cached_tokens(server):
    prompt = "a prompt long enough to fill two whole sixteen-token blocks"  # 59 bytes
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    server.http.post("/v1/completions", json=body)
    usage = server.http.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 48  # three whole blocks; never the last token
    chunks = stream(server, "/v1/completions", {**body, "stream": True, "stream_options": STREAM_OPTIONS})
    assert chunks[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_several_prompts_get_one_choice_each(server):
    body = {"prompt": [[40, 41], [50, 51, 52]], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2}
    resp = server.http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert resp["usage"]["prompt_tokens"] == 2 + 3 and resp["usage"]["completion_tokens"] == 12
    single = server.http.post("/v1/completions", json={**body, "prompt": [50, 51, 52], "n": 1}).json()
    assert resp["choices"][2]["text"] == single["choices"][0]["text"]  # greedy: the same answer
    texts = server.http.post("/v1/completions", json={**body, "prompt": ["one", "two"], "n": 1}).json()
    assert [c["index"] for c in texts["choices"]] == [0, 1] and texts["usage"]["prompt_tokens"] == 6


BYTE_TOKEN = re.compile(r"bytes:(\\x[0-9a-f]{2})+")


def test_logprob_alternatives_have_unique_keys_and_real_bytes(server):
    body = {"prompt": "\u00e9t\u00e9", "max_tokens": 6, "temperature": 0, "logprobs": 5, "ignore_eos": True}
    lp = server.http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert all(len(top) == 5 for top in lp["top_logprobs"])  # distinct byte tokens no longer share "\ufffd"
    keys = [k for top in lp["top_logprobs"] for k in top]
    assert any(BYTE_TOKEN.fullmatch(k) for k in keys)
    assert not any("\ufffd" in k for k in keys)

    chat = server.http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "\u00e9t\u00e9"}], "max_tokens": 6, "temperature": 0,
        "logprobs": True, "top_logprobs": 5, "ignore_eos": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    for entry in content:
        match = BYTE_TOKEN.fullmatch(entry["token"])
        expected = bytes.fromhex(entry["token"][6:].replace("\\x", "")) if match else entry["token"].encode()
        assert bytes(entry["bytes"]) == expected
        assert len({alt["token"] for alt in entry["top_logprobs"]}) == len(entry["top_logprobs"]) == 5
    rebuilt = b"".join(bytes(entry["bytes"]) for entry in content).decode("utf-8", errors="replace")
    assert rebuilt == chat["message"]["content"]


UPSTREAM_GAUGES = ("hit_req_rate", "gpu_cache_usage_perc", "available_gpu_block_num", "free_gpu_block_num", "max_gpu_block_num",
                   "available_gpu_resource", "batch_size", "max_batch_size", "available_batch_size",
                   "hit_token_rate", "gpu_hit_token_rate")


def test_every_upstream_gauge_is_present_and_consistent_with_ours_after_load(server, helpers):
    for _ in range(2):  # a repeat, so the prefix cache has hits
        server.http.post("/v1/completions", json={"prompt": "x" * 40, "max_tokens": 4, "ignore_eos": True})
    m = server.wait_idle_with_all_pages_free()
    for name in UPSTREAM_GAUGES:
        assert "fastdeploy:" + name in m, name
    g = {name: m["fastdeploy:" + name] for name in UPSTREAM_GAUGES}
    assert g["max_gpu_block_num"] == m["fastdeploy:kv_pages_total"]  # head-wise: a block is one page
    assert g["available_gpu_block_num"] == m["fastdeploy:kv_pages_free"]
    # Idle, every cached page is evictable: available to a request, but not free (upstream's LRU rule).
    assert m["fastdeploy:prefix_cache_cached_pages"] > 0
    assert g["free_gpu_block_num"] == g["available_gpu_block_num"] - m["fastdeploy:prefix_cache_cached_pages"]
    assert g["gpu_cache_usage_perc"] == pytest.approx(1 - g["free_gpu_block_num"] / g["max_gpu_block_num"])
    assert g["available_gpu_resource"] == pytest.approx(g["available_gpu_block_num"] / g["max_gpu_block_num"])
    assert g["batch_size"] == m["fastdeploy:num_requests_running"]
    assert g["max_batch_size"] == 8 and g["available_batch_size"] == 8 - g["batch_size"]
    hit, query = m["fastdeploy:prefix_cache_hit_tokens_total"], m["fastdeploy:prefix_cache_query_tokens_total"]
    assert hit > 0 and g["hit_token_rate"] == pytest.approx(hit / query) == g["gpu_hit_token_rate"]
    assert 0 < g["hit_req_rate"] <= 1
    assert m["fastdeploy:prefix_cache_token_num_total"] == hit
    assert m["fastdeploy:request_prompt_tokens_count"] == m["fastdeploy:e2e_request_latency_seconds_count"]
    assert m["fastdeploy:requests_number_total"] >= 2
    assert m["fastdeploy:request_params_max_tokens_count"] >= 2
