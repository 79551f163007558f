"""Bad input and faults: every client mistake is a 4xx with an OpenAI error body, disconnects and
shutdown free the engine's pages, and the server keeps serving through all of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

MAX_MODEL_LEN = 2048
MAX_CONCURRENCY = 2
# Long enough (seconds of decoding) that a request cut short by a disconnect is told apart from one
# that ran to its end.
LONG_GENERATION = MAX_MODEL_LEN - 32
# Room for MAX_CONCURRENCY requests of MAX_MODEL_LEN tokens each (16-token blocks).
SERVER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "320")


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*SERVER_ARGS, "--max-concurrency", str(MAX_CONCURRENCY))


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_MSG = [{"role": "user", "content": "hi"}]

# (id, path, raw body, expected status, expected error param or None)
BAD_REQUESTS = [
    ("malformed_json", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("invalid_utf8", COMPLETIONS, b'{"prompt": "\xff\xfe bad bytes"}', 400, None),
    ("empty_body", COMPLETIONS, b"", 400, None),
    ("integer_past_the_conversion_limit", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400,
     None),
    ("min_tokens_with_nothing_left_to_sample", COMPLETIONS,
     _json({"prompt": "hi", "min_tokens": 2, "stop_token_ids": list(range(259))}), 400, None),
    ("lone_surrogate_in_prompt", COMPLETIONS, b'{"prompt": "hi \\ud800 there"}', 400, None),
    ("lone_surrogate_in_model", COMPLETIONS, b'{"prompt": "hi", "model": "\\udc00x"}', 400, None),
    ("lone_surrogate_in_stop", COMPLETIONS, b'{"prompt": "hi", "stop": ["\\ud800"]}', 400, None),
    ("body_not_an_object", COMPLETIONS, b"[1, 2, 3]", 400, None),
    ("missing_prompt", COMPLETIONS, _json({"max_tokens": 4}), 400, "prompt"),
    ("prompt_wrong_type", COMPLETIONS, _json({"prompt": 12}), 400, "prompt"),
    ("max_tokens_wrong_type", COMPLETIONS, _json({"prompt": "hi", "max_tokens": "lots"}), 400, "max_tokens"),
    ("temperature_wrong_type", COMPLETIONS, _json({"prompt": "hi", "temperature": "hot"}), 400, "temperature"),
    ("stream_wrong_type", COMPLETIONS, _json({"prompt": "hi", "stream": {"a": 1}}), 400, "stream"),
    ("unknown_model", COMPLETIONS, _json({"model": "no-such-model", "prompt": "hi"}), 404, "model"),
    ("negative_max_tokens", COMPLETIONS, _json({"prompt": "hi", "max_tokens": -5}), 400, "max_tokens"),
    ("zero_max_tokens_without_echo", COMPLETIONS, _json({"prompt": "hi", "max_tokens": 0}), 400, None),
    ("huge_max_tokens", COMPLETIONS, _json({"prompt": "hi", "max_tokens": 10**12}), 400, None),
    ("negative_temperature", COMPLETIONS, _json({"prompt": "hi", "temperature": -1}), 400, "temperature"),
    ("top_p_out_of_range", COMPLETIONS, _json({"prompt": "hi", "top_p": 1.5}), 400, "top_p"),
    ("echo_wrong_type", COMPLETIONS, _json({"prompt": "hi", "echo": {"a": 1}}), 400, "echo"),
    ("suffix", COMPLETIONS, _json({"prompt": "hi", "suffix": "end"}), 400, "suffix"),
    ("zero_choices", COMPLETIONS, _json({"prompt": "hi", "n": 0}), 400, "n"),
    ("too_many_choices", COMPLETIONS, _json({"prompt": "hi", "n": 1000}), 400, "n"),
    ("best_of_other_than_n", COMPLETIONS, _json({"prompt": "hi", "n": 2, "best_of": 3}), 400, None),
    ("empty_prompt", COMPLETIONS, _json({"prompt": ""}), 400, "prompt"),
    ("boolean_token_id", COMPLETIONS, _json({"prompt": [40, True]}), 400, "prompt"),
    ("float_token_id", COMPLETIONS, _json({"prompt": [40, 5.0]}), 400, "prompt"),
    ("boolean_stop_token_id", COMPLETIONS, _json({"prompt": "hi", "stop_token_ids": [False]}), 400, None),
    ("empty_token_prompt", COMPLETIONS, _json({"prompt": []}), 400, "prompt"),
    ("text_prompt_over_max_model_len", COMPLETIONS, _json({"prompt": "a" * (2 * MAX_MODEL_LEN)}), 400, None),
    ("token_prompt_over_max_model_len", COMPLETIONS, _json({"prompt": [40] * (MAX_MODEL_LEN + 1)}), 400, None),
    # Only the engine knows its vocabulary: its ValueError must come back as a 400.
    ("token_id_outside_vocabulary", COMPLETIONS, _json({"prompt": [40, 10**6]}), 400, None),
    ("logit_bias_key_not_a_token_id", COMPLETIONS, _json({"prompt": "hi", "logit_bias": {"abc": 5}}), 400,
     "logit_bias"),
    ("logit_bias_value_out_of_range", COMPLETIONS, _json({"prompt": "hi", "logit_bias": {"40": 500}}), 400,
     "logit_bias"),
    ("logit_bias_token_outside_vocabulary", COMPLETIONS, _json({"prompt": "hi", "logit_bias": {"1000000": 5}}),
     400, None),
    ("presence_penalty_out_of_range", COMPLETIONS, _json({"prompt": "hi", "presence_penalty": 5}), 400,
     "presence_penalty"),
    ("repetition_penalty_zero", COMPLETIONS, _json({"prompt": "hi", "repetition_penalty": 0}), 400,
     "repetition_penalty"),
    ("empty_stop_string", COMPLETIONS, _json({"prompt": "hi", "stop": ["ok", ""]}), 400, "stop"),
    ("too_many_stop_strings", COMPLETIONS, _json({"prompt": "hi", "stop": [str(i) for i in range(17)]}), 400, "stop"),
    ("stop_string_too_long", COMPLETIONS, _json({"prompt": "hi", "stop": ["x" * 257]}), 400, "stop"),
    ("stop_wrong_type", COMPLETIONS, _json({"prompt": "hi", "stop": 5}), 400, "stop"),
    ("stop_token_outside_vocabulary", COMPLETIONS, _json({"prompt": "hi", "stop_token_ids": [10**6]}), 400, None),
    ("chat_malformed_json", CHAT, b'{"messages": [', 400, None),
    ("chat_empty_messages", CHAT, _json({"messages": []}), 400, "messages"),
    ("chat_messages_wrong_type", CHAT, _json({"messages": "hello"}), 400, "messages"),
    ("chat_unknown_role", CHAT, _json({"messages": [{"role": "wizard", "content": "hi"}]}), 400, "messages.0.role"),
    ("chat_unknown_model", CHAT, _json({"model": "gpt-4", "messages": USER_MSG}), 404, "model"),
    ("chat_negative_max_tokens", CHAT, _json({"messages": USER_MSG, "max_tokens": -1}), 400, "max_tokens"),
    ("chat_top_logprobs_without_logprobs", CHAT, _json({"messages": USER_MSG, "top_logprobs": 2}), 400, None),
    ("chat_tools", CHAT, _json({"messages": USER_MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}),
     400, "tools"),
    ("chat_unknown_response_format", CHAT, _json({"messages": USER_MSG, "response_format": {"type": "yaml"}}),
     400, None),
    ("chat_json_schema_that_cannot_compile", CHAT, _json({"messages": USER_MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}), 400, None),
    ("regex_that_cannot_compile", COMPLETIONS, _json({"prompt": "hi", "guided_regex": "(unclosed"}), 400, None),
]


@pytest.mark.parametrize("path,body,status,param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, helpers, path, body, status, param):
    resp = server.http.post(path, content=body, headers={"Content-Type": "application/json"})
    helpers.assert_openai_error(resp, status, param)
    server.assert_still_serves()


def test_prompt_over_max_model_len_names_the_limit(server, helpers):
    resp = server.http.post(COMPLETIONS, json={"prompt": [40] * (MAX_MODEL_LEN + 1)})
    err = helpers.assert_openai_error(resp, 400)
    assert str(MAX_MODEL_LEN) in err["message"]


def test_unknown_route_and_wrong_method_use_openai_error_body(server, helpers):
    helpers.assert_openai_error(server.http.get("/v1/nothing-here"), 404)
    helpers.assert_openai_error(server.http.get(COMPLETIONS), 405)


def _stream_body(max_tokens: int = LONG_GENERATION) -> dict:
    return {"prompt": "tell me a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


def _disconnect_once_generating(server, helpers, conn, before: float) -> float:
    """Close `conn` once /metrics shows its request generating; the tokens generated since `before`
    (the generation counter read while idle, before the request was sent).

    /metrics is a snapshot published every ~0.1 s: without the wait, the "all pages free" read
    afterwards could be the snapshot from before the request started.
    """
    helpers.wait_until(lambda: server.metrics().get("fastdeploy:generation_tokens_total", 0) > before,
                       helpers.POLL_TIMEOUT_S, "/metrics to show the request generating")
    conn.close()
    return server.wait_idle_with_all_pages_free()["fastdeploy:generation_tokens_total"] - before


@pytest.mark.parametrize("n", [1, MAX_CONCURRENCY])
def test_disconnect_mid_stream_aborts_request_and_frees_its_pages(server, helpers, n):
    before = server.wait_idle_with_all_pages_free()["fastdeploy:generation_tokens_total"]
    conn = server.raw_request(COMPLETIONS, dict(_stream_body(), n=n))
    head = conn.read_until(b"}\n\n")  # headers plus at least one event: generation has started
    assert head.startswith(b"HTTP/1.1 200")
    generated = _disconnect_once_generating(server, helpers, conn, before)
    # Below one full generation: had any choice run to its end, this would fail.
    assert 1 <= generated < LONG_GENERATION, "a choice ran to its end instead of being aborted"
    server.assert_still_serves()


def test_more_choices_than_max_concurrency_is_a_400_not_a_retryable_429(server, helpers):
    before = server.wait_idle_with_all_pages_free()
    resp = server.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "n": MAX_CONCURRENCY + 1})
    err = helpers.assert_openai_error(resp, 400, "n")
    assert str(MAX_CONCURRENCY) in err["message"]
    after = server.wait_idle_with_all_pages_free()
    assert after["fastdeploy:generation_tokens_total"] == before["fastdeploy:generation_tokens_total"]
    server.assert_still_serves()


def test_choices_that_do_not_all_fit_get_429_and_leave_nothing_in_flight(server, helpers):
    server.wait_idle_with_all_pages_free()
    conn = server.raw_request(COMPLETIONS, _stream_body())  # takes one of the MAX_CONCURRENCY slots
    try:
        assert conn.read_until(b"}\n\n").startswith(b"HTTP/1.1 200")
        resp = server.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "n": MAX_CONCURRENCY})
        helpers.assert_openai_error(resp, 429)
        assert server.metrics()["fastdeploy:num_requests_in_flight"] == 1  # live count: no choice was admitted
    finally:
        conn.close()
    server.wait_idle_with_all_pages_free()
    server.assert_still_serves()


@pytest.mark.parametrize("n", [1, MAX_CONCURRENCY])
def test_disconnect_while_waiting_for_non_streamed_response_aborts_request(server, helpers, n):
    tracebacks_before = server.log_path.read_text(errors="replace").count("Traceback")
    before = server.wait_idle_with_all_pages_free()["fastdeploy:generation_tokens_total"]
    conn = server.raw_request(COMPLETIONS, dict(_stream_body(), stream=False, n=n))
    generated = _disconnect_once_generating(server, helpers, conn, before)
    assert generated < LONG_GENERATION, "the request ran to its end instead of being aborted"
    server.assert_still_serves()
    assert server.log_path.read_text(errors="replace").count("Traceback") == tracebacks_before


def test_requests_over_max_concurrency_get_429(server, helpers):
    server.wait_idle_with_all_pages_free()
    streams = [server.raw_request(COMPLETIONS, _stream_body()) for _ in range(MAX_CONCURRENCY)]
    try:
        for conn in streams:
            assert conn.read_until(b"}\n\n").startswith(b"HTTP/1.1 200")
        resp = server.http.post(COMPLETIONS, json={"prompt": "one too many", "max_tokens": 2})
        err = helpers.assert_openai_error(resp, 429)
        assert err["type"] == "rate_limit_error"
        resp = server.http.post(CHAT, json={"messages": USER_MSG, "max_tokens": 2})
        helpers.assert_openai_error(resp, 429)
    finally:
        for conn in streams:
            conn.close()
    server.wait_idle_with_all_pages_free()
    server.assert_still_serves()


def test_sigterm_ends_streams_stops_engine_and_exits_zero(server_factory, helpers):
    srv = server_factory(*SERVER_ARGS)
    engine_pids = srv.engine_pids()
    assert len(engine_pids) == 1
    conn = srv.raw_request(COMPLETIONS, _stream_body())
    conn.read_until(b"}\n\n")
    srv.proc.send_signal(signal.SIGTERM)
    tail = conn.read_to_eof()  # the in-flight stream is ended by the server, not left hanging
    conn.close()
    assert b"data: [DONE]" in tail
    assert b'"error"' in tail  # the client learns its stream was cut, not that it finished
    assert srv.proc.wait(helpers.SHUTDOWN_TIMEOUT_S) == 0, srv.log_tail()
    for pid in engine_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigterm_to_the_whole_process_group_shuts_down_quietly(server_factory, helpers):
    """docker stop / systemd signal every process of the group, the engine process included."""
    srv = server_factory(*SERVER_ARGS)
    resp = srv.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
    os.killpg(srv.proc.pid, signal.SIGTERM)
    assert srv.proc.wait(helpers.SHUTDOWN_TIMEOUT_S) == 0, srv.log_tail()
    assert "Traceback" not in srv.log_tail()


def test_dead_engine_turns_health_and_requests_into_503(server_factory, helpers):
    srv = server_factory(*SERVER_ARGS)
    (engine_pid,) = srv.engine_pids()
    os.kill(engine_pid, signal.SIGKILL)
    helpers.wait_until(lambda: srv.http.get("/health").status_code == 503, helpers.POLL_TIMEOUT_S,
                       "/health to report the dead engine")
    helpers.assert_openai_error(srv.http.get("/health"), 503)
    helpers.assert_openai_error(srv.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}), 503)
    helpers.assert_openai_error(srv.http.post(CHAT, json={"messages": USER_MSG}), 503)
    assert srv.http.get("/metrics").status_code == 200  # the server itself is still up
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(helpers.SHUTDOWN_TIMEOUT_S) == 0, srv.log_tail()


def test_bad_engine_flag_fails_before_serving_with_a_message(tmp_path, helpers):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(helpers.REPO), os.environ.get("PYTHONPATH")))))
    proc = subprocess.run([sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--host", "127.0.0.1",
                           "--port", "0", "--max-model-len", "1"],
                          cwd=helpers.REPO, env=env, capture_output=True, text=True,
                          timeout=helpers.SHUTDOWN_TIMEOUT_S)
    assert proc.returncode == 2
    assert "max_model_len" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extreme", [{"repetition_penalty": 1e-308}, {"temperature": 1e-308}])
def test_extreme_sampling_values_are_served_not_fatal(server, extreme):
    body = {"prompt": "hello hello hello", "max_tokens": 4, "ignore_eos": True, "temperature": 1.0, **extreme}
    resp = server.http.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    server.assert_still_serves()


def test_an_escaped_surrogate_pair_is_ordinary_text(server):
    body = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2, "ignore_eos": true}'
    resp = server.http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len("smile ".encode()) + 4  # the emoji's 4 UTF-8 bytes
