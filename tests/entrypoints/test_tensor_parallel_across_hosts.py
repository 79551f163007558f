"""Tensor parallelism with one rank on each of two hosts that share no loopback: two network namespaces
this test makes (veth pairs to a bridge, addresses it assigns, removed afterwards). The engine (the
api_server, FD_TP_LAUNCH_WORKERS=0) and rank 0 live on the first host, rank 1 on the second; both ranks
are started by `paddle.distributed.launch --ips A,B --host THIS` exactly as docs/tensor_parallel.md says,
with no GLOO_SOCKET_IFNAME: the worker names the interface of its endpoint itself. The greedy text equals one
rank's; cutting the second host's link ends the in-flight request with an error naming the rank, within
FD_TP_HEARTBEAT_TIMEOUT, and /health turns 503. Skips, saying why, where the machine refuses namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from network_hosts import hosts_or_skip, ip

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

REPO = Path(__file__).resolve().parents[2]
HEARTBEAT_TIMEOUT_S = 3
PROMPTS = ("Tensor parallel ranks on two hosts", "The sliding window keeps the sink and")


@pytest.fixture(scope="module")
def two_hosts():
    yield from hosts_or_skip("engine", "second")


@pytest.fixture(scope="module")
def split_server(two_hosts, server_factory, tmp_path_factory):
    """The api_server on the first host waiting for two ranks, one launched on each host."""
    from fastdeploy.entrypoints.openai.server_process import free_port

    (engine_ns, engine_ip, _), (_, second_ip, _) = two_hosts["engine"], two_hosts["second"]
    port = free_port()
    server = server_factory(
        "--tensor-parallel-size", "2", host=engine_ip, prefix=("ip", "netns", "exec", engine_ns), wait=False,
        env={"FD_TP_LAUNCH_WORKERS": "0", "FD_TP_ENGINE_HOST": engine_ip, "FD_TP_ENGINE_PORT": str(port),
             "FD_TP_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S)})
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(PADDLE_DISTRI_BACKEND="gloo", FD_HEAD_WISE_KV_CACHE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    logs = tmp_path_factory.mktemp("launch")
    launchers = [subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "paddle.distributed.launch", "--ips",
         f"{engine_ip},{second_ip}", "--host", address, "--nproc_per_node", "1", "--log_dir", str(logs / name),
         "fastdeploy/worker/worker_process.py", "--engine-address", f"{engine_ip}:{port}"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, (ns, address, _) in two_hosts.items()]
    try:
        server.wait_ready()
        yield server
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
            launcher.wait()


def greedy(server, prompt: str) -> str:
    resp = server.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_two_ranks_on_two_hosts_give_one_ranks_greedy_text(two_hosts, split_server, server_factory):
    link = Path(f"/sys/class/net/{two_hosts['second'][2]}/statistics/tx_bytes")  # into the second host
    before = int(link.read_text())
    texts = [greedy(split_server, p) for p in PROMPTS]
    moved = int(link.read_text()) - before
    one_rank = server_factory()
    assert texts == [greedy(one_rank, p) for p in PROMPTS]
    assert moved > 0  # the steps and the collectives crossed the link
    log = split_server.log_tail(400)
    assert f"at {two_hosts['second'][1]}:" in log and "collectives on eth0" in log  # rank 1, on its own host


def test_a_cut_link_ends_the_request_with_an_error_naming_the_rank(two_hosts, split_server, helpers):
    conn = split_server.raw_request("/v1/completions", {"prompt": "x" * 40, "max_tokens": 900, "temperature": 0,
                                                        "stream": True, "ignore_eos": True})
    try:
        conn.read_until(b'"text"')  # generating
        ip("link", "set", two_hosts["second"][2], "down")
        body = conn.read_to_eof().decode()
    finally:
        conn.close()
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    message = events[-1]["error"]["message"]
    assert "rank 1" in message and "FD_TP_HEARTBEAT_TIMEOUT" in message and "link" in message, message
    helpers.wait_until(lambda: split_server.http.get("/health").status_code == 503, helpers.POLL_TIMEOUT_S, "503")
