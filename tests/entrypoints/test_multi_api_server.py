"""The documented replicas command (python -m fastdeploy.entrypoints.openai.multi_api_server): two replicas
and vllm-router (kv_aware, fed by their KV-cache events) come up; a replica that dies is reported and the
router keeps serving from the other; SIGTERM stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fastdeploy.entrypoints.openai.server_process import PACKAGE_ROOT, free_port, free_port_pair

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

TINY = ["--block-size", "16", "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--max-model-len", "1024"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_replicas_behind_the_router_start_serve_survive_a_death_and_stop(tmp_path):
    if not (Path(sys.executable).parent / "vllm-router").exists():
        pytest.skip("vllm-router is not installed (pip install -e \".[cpu,pd]\")")
    ports, router_port = [free_port(), free_port()], free_port()
    events = [free_port_pair() for _ in range(2)]
    log = open(tmp_path / "launcher.log", "wb")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "fastdeploy.entrypoints.openai.multi_api_server", "--num-servers", "2",
         "--ports", ",".join(map(str, ports)), "--router-port", str(router_port), "--policy", "kv_aware",
         "--router-metrics-port", str(free_port()),
         "--kv-events-ports", ",".join(map(str, events)), "--log-dir", str(tmp_path / "log"), "--args", *TINY],
        cwd=PACKAGE_ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FD_HEAD_WISE_KV_CACHE": "1"})
    router = f"http://127.0.0.1:{router_port}"
    try:
        wait_for(lambda: answers(router) or launcher.poll() is not None, 300, "the router")
        assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
        assert all(answers(f"http://127.0.0.1:{p}") for p in ports)
        body = {"prompt": "Replicas behind a router", "max_tokens": 4, "temperature": 0}
        texts = {httpx.post(router + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(4)}
        assert len(texts) == 1  # the same greedy text from whichever replica served it
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 3  # two replicas and the router, children of the launcher
        replica = next(int(pid) for pid in children
                       if str(ports[1]).encode() in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.killpg(replica, signal.SIGKILL)
        wait_for(lambda: b"replica 1" in (tmp_path / "launcher.log").read_bytes(), 30, "the death to be reported")
        for _ in range(3):
            resp = httpx.post(router + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(90) == 0
        assert not answers(router) and not answers(f"http://127.0.0.1:{ports[0]}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        log.close()
