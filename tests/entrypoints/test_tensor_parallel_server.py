"""The api_server with --tensor-parallel-size 2: two worker processes under the engine process,
the same completions as one rank, per-rank pools on /metrics, SIGTERM and a killed worker."""

import json
import os
import signal
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

TP_ARGS = ("--tensor-parallel-size", "2")
COMPLETIONS = "/v1/completions"


def worker_pids(srv, helpers=None) -> dict:
    """rank -> pid, from /metrics (waiting for the engine's first stats when helpers are given)."""
    if helpers is not None:
        helpers.wait_until(lambda: "tp_worker_info" in srv.http.get("/metrics").text, helpers.POLL_TIMEOUT_S,
                           "the workers on /metrics")
    text = srv.http.get("/metrics").text
    pids = {}
    for line in text.splitlines():
        if line.startswith("fastdeploy:tp_worker_info{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            pids[int(labels["rank"].strip('"'))] = int(labels["pid"].strip('"'))
    return pids


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1])


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(*TP_ARGS)


def test_completion_matches_one_rank_in_process(server, monkeypatch):
    from fastdeploy import LLM, SamplingParams

    body = {"prompt": "Tensor parallel ranks", "max_tokens": 12, "temperature": 0}
    resp = server.http.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    llm = LLM(block_size=16, num_gpu_blocks_override=64, max_num_seqs=8)
    expected = llm.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert resp.json()["choices"][0]["text"] == expected.outputs.text


def test_streamed_chat_under_two_ranks(server):
    client = server.openai_client()
    chunks = list(client.chat.completions.create(model=server.model_name(), stream=True, max_tokens=6,
                                                 messages=[{"role": "user", "content": "hi"}], temperature=0))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1


def test_metrics_show_each_ranks_pool_and_its_worker_process(server, helpers):
    metrics = server.wait_idle_with_all_pages_free()
    # 64 blocks x 2 KV heads per rank
    for rank in (0, 1):
        assert metrics[f'fastdeploy:kv_pages_total_per_rank{{rank="{rank}"}}'] == 128
        assert metrics[f'fastdeploy:kv_pages_free_per_rank{{rank="{rank}"}}'] == 128
    pids = worker_pids(server, helpers)
    (engine_pid,) = server.engine_pids()
    assert sorted(pids) == [0, 1]
    for rank, pid in pids.items():
        assert parent_of(pid) == engine_pid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"fastdeploy.worker.worker_process" in cmdline and cmdline[cmdline.index(b"--rank") + 1] == \
            str(rank).encode()


def test_sigterm_stops_the_engine_and_every_worker(server, helpers):
    pids = list(worker_pids(server, helpers).values()) + server.engine_pids()
    assert len(pids) == 3
    assert server.stop() == 0, server.log_tail()
    helpers.wait_until(lambda: not any(running(p) for p in pids), helpers.POLL_TIMEOUT_S, "no process left")


def test_a_killed_worker_fails_in_flight_requests_and_the_server_reports_unhealthy(server_factory, helpers):
    srv = server_factory(*TP_ARGS)
    pids = worker_pids(srv, helpers)
    (engine_pid,) = srv.engine_pids()
    conn = srv.raw_request(COMPLETIONS, {"prompt": "x" * 40, "max_tokens": 900, "temperature": 0,
                                         "stream": True, "ignore_eos": True})
    try:
        conn.read_until(b'"text"')  # generating
        os.kill(pids[1], signal.SIGKILL)
        body = conn.read_to_eof().decode()
    finally:
        conn.close()
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    error = events[-1]["error"]
    assert "rank 1" in error["message"] and "killed by signal 9" in error["message"], error
    helpers.wait_until(lambda: srv.http.get("/health").status_code == 503, helpers.POLL_TIMEOUT_S, "503")
    helpers.assert_openai_error(srv.http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}), 503)
    helpers.wait_until(lambda: not any(running(p) for p in [*pids.values(), engine_pid]), helpers.POLL_TIMEOUT_S,
                       "the engine and both workers to exit")
    assert "engine failed" in srv.log_tail(200)
