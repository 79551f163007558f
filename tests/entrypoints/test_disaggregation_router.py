"""vllm-router 0.1.17 (`--vllm-pd-disaggregation --kv-connector nixl`, its PyPI binary, unmodified) in front
of a prefill server and a decode server of this engine, over real HTTP: the same greedy text as one mixed
server, for completions and chat, streamed or not, in 1-D and head-wise mode; every page is free again
on both servers afterwards; bad kv_transfer_params are a 400; a prefill server killed between its answer
and the decode server's read leaves the decode server serving, with the answer recomputed or a 503
naming the failure (kv_load_failure_policy).
"""

from __future__ import annotations

import json
import os
import signal

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

pytest.importorskip("nixl_cu12", reason="KV transfer needs NIXL: pip install -e \".[cpu,pd]\"")

TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both","side_channel_port":0%s}'
ROLE_ARGS = {"prefill": ("--splitwise-role", "prefill", "--kv-transfer-config", TRANSFER % ""),
             "decode": ("--splitwise-role", "decode", "--kv-transfer-config", TRANSFER % ""),
             "decode_fail": ("--splitwise-role", "decode", "--kv-transfer-config",
                             TRANSFER % ',"kv_load_failure_policy":"fail","handshake_timeout_s":2'),
             "mixed": ()}


def held_out_prompts() -> list:
    """English prose no test tuned anything on: paragraphs of Python's own documentation."""
    from pydoc_data.topics import topics

    texts = [topics[k] for k in ("assert", "with", "lambda", "global")]
    return [" ".join(t.split()[:n]) for t, n in zip(texts, (20, 50, 100, 200))]


def complete(http, prompt, max_tokens=16, **extra) -> dict:
    resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat_stream_text(http, content: str) -> str:
    text = ""
    with http.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0,
            "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["delta"].get("content") or "" if choices else ""
    return text


# Room for the longest prompt (~800 tokens of the tiny preset's vocabulary) parked beside others running.
CACHE_ARGS = ("--num-gpu-blocks-override", "192", "--max-model-len", "2048")


def start_servers(server_factory, roles, env, model_args=CACHE_ARGS) -> dict:
    servers = {role: server_factory(*model_args, *ROLE_ARGS[role], env=env, wait=False) for role in roles}
    for srv in servers.values():
        srv.wait_ready()
    return servers


@pytest.fixture(scope="module", params=["1d", "head_wise"])
def deployment(request, server_factory, router_factory):
    env = {"FD_HEAD_WISE_KV_CACHE": "1" if request.param == "head_wise" else "0"}
    servers = start_servers(server_factory, ("prefill", "decode", "mixed"), env)
    router = router_factory([servers["prefill"].base_url], [servers["decode"].base_url])
    return request.param, servers, router


def test_router_pair_answers_as_one_mixed_server(deployment, helpers):
    mode, servers, router = deployment
    for prompt in held_out_prompts():
        want = complete(servers["mixed"].http, prompt)["choices"][0]["text"]
        got = complete(router.http, prompt)
        assert got["choices"][0]["text"] == want, mode
        assert got["usage"]["completion_tokens"] == 16
    assert chat_stream_text(router.http, "hello there") == chat_stream_text(servers["mixed"].http, "hello there")
    for role in ("prefill", "decode"):
        servers[role].wait_idle_with_all_pages_free()  # also waits for the engine's next stats snapshot
    prefill, decode = servers["prefill"].metrics(), servers["decode"].metrics()
    assert prefill["fastdeploy:kv_transfer_requests_sent_total"] == 5
    assert decode["fastdeploy:kv_transfer_requests_received_total"] == 5
    assert prefill["fastdeploy:kv_transfer_bytes_sent_total"] == decode["fastdeploy:kv_transfer_bytes_received_total"]
    assert decode["fastdeploy:kv_transfer_failed_total"] == 0
    assert prefill["fastdeploy:kv_transfer_parked_requests"] == decode["fastdeploy:kv_transfer_loading_requests"] == 0


def test_prefill_answer_carries_the_live_entries_of_each_head(deployment):
    mode, servers, _ = deployment
    prompt = held_out_prompts()[3]
    body = complete(servers["prefill"].http, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["tp_size"] == 1
    assert params["remote_num_tokens"] == body["usage"]["prompt_tokens"] - 1
    rows = params["remote_block_ids"]
    sent = [len(row) - row.count(-1) for row in rows]
    if mode == "1d":
        assert len(rows) == 1 and -1 not in rows[0]
    else:  # the tiny preset's sliding heads (window 128 + sink 16) send fewer blocks than the full ones
        assert len(rows) > 1 and min(sent) < max(sent)
    # nobody reads it: hand it to the decode server directly so its pages go back
    decoded = complete(servers["decode"].http, prompt, kv_transfer_params=params)
    assert decoded["choices"][0]["text"] == complete(servers["mixed"].http, prompt)["choices"][0]["text"]
    servers["prefill"].wait_idle_with_all_pages_free()


@pytest.mark.parametrize("params, fragment", [
    ({"do_remote_prefill": True}, "remote_engine_id"),
    ({"do_remote_prefill": 1}, "true or false"),
    ("not an object", "kv_transfer_params"),
    ({"do_remote_decode": True}, "role is decode"),
])
def test_bad_kv_transfer_params_are_a_400(deployment, helpers, params, fragment):
    _, servers, _ = deployment
    resp = servers["decode"].http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                 "kv_transfer_params": params})
    err = helpers.assert_openai_error(resp, 400)
    assert fragment in err["message"]
    resp = servers["decode"].http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2,
                                                                 "kv_transfer_params": {"do_remote_decode": True}})
    helpers.assert_openai_error(resp, 400, param="kv_transfer_params")
    servers["decode"].assert_still_serves()


# -- a prefill server dies between its answer and the decode server's read -------------------------------
@pytest.fixture(scope="module")
def failure_deployment(server_factory):
    return start_servers(server_factory, ("prefill", "decode", "decode_fail", "mixed"), {"FD_HEAD_WISE_KV_CACHE": "1"})


def test_a_killed_prefill_server_leaves_the_decode_servers_serving(failure_deployment, helpers):
    servers = failure_deployment
    prompt = held_out_prompts()[2]
    params = [complete(servers["prefill"].http, prompt, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"] for _ in range(2)]
    os.killpg(servers["prefill"].proc.pid, signal.SIGKILL)
    servers["prefill"].proc.wait()
    want = complete(servers["mixed"].http, prompt)["choices"][0]["text"]
    # recompute: the same answer, computed from the prompt on the decode server
    assert complete(servers["decode"].http, prompt, kv_transfer_params=params[0])["choices"][0]["text"] == want
    # fail: a 503 naming what failed
    resp = servers["decode_fail"].http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16,
                                                                      "temperature": 0, "kv_transfer_params": params[1]})
    err = helpers.assert_openai_error(resp, 503)
    assert err["code"] == "kv_load_failed" and "prefill server" in err["message"]
    for role in ("decode", "decode_fail"):
        servers[role].assert_still_serves()
        snapshot = servers[role].wait_idle_with_all_pages_free()
        assert snapshot["fastdeploy:kv_transfer_failed_total"] == 1


# -- a real model: SmolLM2 with its shipped per-head windows, int8 pages -----------------------------------
@pytest.fixture(scope="module")
def smollm2_deployment(server_factory, router_factory, helpers):
    helpers.named_model_path("smollm2-135m-instruct")  # skips, saying how to install it, without the model
    model_args = ("--model", "smollm2-135m-instruct", "--max-model-len", "2048", "--kv-cache-quant-type", "int8",
                  "--num-gpu-blocks-override", "96", "--block-size", "64")
    servers = start_servers(server_factory, ("prefill", "decode", "mixed"), {"FD_HEAD_WISE_KV_CACHE": "1"},
                            model_args)
    return servers, router_factory([servers["prefill"].base_url], [servers["decode"].base_url])


def test_smollm2_through_the_router_answers_as_one_mixed_server(smollm2_deployment):
    servers, router = smollm2_deployment
    for prompt in held_out_prompts():
        question = f"{prompt}\n\nIn one sentence, what is this text about?"
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}
        want = servers["mixed"].http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        got = router.http.post("/v1/chat/completions", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["message"]["content"] == want["content"]
    metrics = servers["decode"].wait_idle_with_all_pages_free()
    assert metrics["fastdeploy:kv_transfer_requests_received_total"] == 4
    servers["prefill"].wait_idle_with_all_pages_free()
