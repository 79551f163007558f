"""Real api_server subprocesses for the entrypoint tests, and small HTTP helpers.

Each test module starts its server once (tiny preset, small KV cache and context, a free port) and
talks to it over real HTTP. Every wait is bounded so a broken server fails a test, never hangs it.
Helpers reach test modules through fixtures (`server_factory`, `helpers`), not imports: tests/ has
several conftest.py files and no packages, so `import conftest` would be ambiguous.
"""

from __future__ import annotations

import json
import os
import socket
import time
import types
from pathlib import Path
from typing import Callable, Optional

import httpx
import pytest

from fastdeploy.entrypoints.openai.metrics import parse_prometheus_text
from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]
# Start-up includes importing Paddle and building the tiny model in the engine process.
STARTUP_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 60
POLL_TIMEOUT_S = 30

# Small and fast: a 64-block cache of 16-token blocks, short context.
BASE_SERVER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "64", "--max-num-seqs", "8",
                    "--disable-uvicorn-access-log")
# What users run: head-wise KV cache on (the tiny preset declares SWA heads).
BASE_SERVER_ENV = {"FD_HEAD_WISE_KV_CACHE": "1"}
# Extra flags for every server of the suite, e.g. FD_TEST_SERVER_ARGS="--tensor-parallel-size 2"
# runs the API tests against two worker ranks.
BASE_SERVER_ARGS += tuple(os.environ.get("FD_TEST_SERVER_ARGS", "").split())


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class ServerProcess(ApiServerProcess):
    """The shared launcher with this suite's base settings, an HTTP client and test helpers."""

    def __init__(self, args: tuple, env: dict, log_path: Path, separate_metrics_port: bool = False,
                 host: str = "127.0.0.1", prefix: tuple = (), **launch):
        super().__init__((*BASE_SERVER_ARGS, *args), env={**BASE_SERVER_ENV, **env}, log_path=log_path,
                         metrics_port=free_port() if separate_metrics_port else None, host=host, prefix=prefix,
                         port=free_port() if prefix else None, **launch)
        self.http = httpx.Client(base_url=self.base_url, timeout=REQUEST_TIMEOUT_S)

    def wait_ready(self) -> None:
        self.wait_healthy(STARTUP_TIMEOUT_S)

    def stop(self) -> Optional[int]:
        self.http.close()
        return super().stop(SHUTDOWN_TIMEOUT_S)

    # ------------------------------------------------------------ helpers
    def model_name(self) -> str:
        return self.http.get("/v1/models").json()["data"][0]["id"]

    def metrics(self, port: Optional[int] = None) -> dict[str, float]:
        url = f"http://{self.host}:{port or self.port}/metrics"
        resp = self.http.get(url)
        assert resp.status_code == 200, resp.text
        return parse_prometheus_text(resp.text)

    def engine_pids(self) -> list[int]:
        """The engine process(es): children of the server started by multiprocessing spawn."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except FileNotFoundError:
                    continue
                if b"spawn_main" in cmdline:
                    pids.append(int(pid))
        return pids

    def wait_idle_with_all_pages_free(self) -> dict[str, float]:
        """Poll /metrics until no request holds pages; returns that snapshot."""
        snapshot: dict[str, float] = {}

        def idle() -> bool:
            snapshot.clear()
            snapshot.update(self.metrics())
            return (snapshot.get("fastdeploy:num_requests_in_flight") == 0
                    and snapshot.get("fastdeploy:num_requests_running") == 0
                    and snapshot.get("fastdeploy:num_requests_waiting") == 0
                    and snapshot.get("fastdeploy:kv_pages_free") == snapshot.get("fastdeploy:kv_pages_total"))

        wait_until(idle, POLL_TIMEOUT_S, "all KV pages to be free again")
        return dict(snapshot)

    def openai_client(self):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                             timeout=REQUEST_TIMEOUT_S)

    def raw_request(self, path: str, body: dict) -> "RawHTTPRequest":
        return RawHTTPRequest(self.port, path, body, self.host)

    def assert_still_serves(self) -> None:
        resp = self.http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1


class RawHTTPRequest:
    """One HTTP/1.1 request on its own socket, so a test can read part of a response and hang up."""

    def __init__(self, port: int, path: str, body: dict, host: str = "127.0.0.1"):
        self.sock = socket.create_connection((host, port), timeout=REQUEST_TIMEOUT_S)
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
        self.sock.sendall(head + payload)
        self.received = b""

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.received:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {marker!r}; got {self.received[:500]!r}")
            self.received += chunk
        return self.received

    def read_to_eof(self) -> bytes:
        while chunk := self.sock.recv(65536):
            self.received += chunk
        return self.received

    def close(self) -> None:
        self.sock.close()


def assert_openai_error(resp: httpx.Response, status: int, param: Optional[str] = None) -> dict:
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text}"
    assert "Traceback" not in resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def named_model_path(name: str) -> str:
    """The GGUF file of a named real model (fetched on first use)."""
    from fastdeploy.model_executor.models.named_models import resolve

    return resolve(name)


@pytest.fixture(scope="session")
def helpers():
    return types.SimpleNamespace(assert_openai_error=assert_openai_error, wait_until=wait_until,
                                 parse_prometheus=parse_prometheus_text, POLL_TIMEOUT_S=POLL_TIMEOUT_S,
                                 SHUTDOWN_TIMEOUT_S=SHUTDOWN_TIMEOUT_S, REQUEST_TIMEOUT_S=REQUEST_TIMEOUT_S, REPO=REPO,
                                 named_model_path=named_model_path)


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory):
    """start(*args, env=, separate_metrics_port=, host=, prefix=, entry=, wait=) -> a ServerProcess, stopped when
    the module ends; ready unless wait=False (then call its wait_ready(): several servers start side by side)."""
    started: list[ServerProcess] = []

    def start(*args: str, env: Optional[dict] = None, separate_metrics_port: bool = False, host: str = "127.0.0.1",
              prefix: tuple = (), wait: bool = True, **launch) -> ServerProcess:
        log = tmp_path_factory.mktemp("api_server") / "server.log"
        srv = ServerProcess(args, env or {}, log, separate_metrics_port=separate_metrics_port, host=host,
                            prefix=prefix, **launch)
        started.append(srv)
        if wait:
            srv.wait_ready()
        return srv

    yield start
    for srv in started:
        srv.stop()


class RouterProcess:
    """vllm-router (its PyPI wheel's Rust binary) in front of this engine's servers, as users run it: in
    prefill/decode mode (`--vllm-pd-disaggregation --kv-connector nixl`, round robin), or with the routing
    arguments given (`args`, e.g. `--worker-urls ... --policy kv_aware ...`)."""

    def __init__(self, prefill_urls: list, decode_urls: list, log_path: Path, prefix: tuple = (),
                 args: Optional[list] = None):
        import shutil
        import subprocess
        import sys

        binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
        if binary is None:
            pytest.skip("vllm-router is not installed (pip install -e \".[cpu,pd]\")")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [*prefix, binary, "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port())]
        cmd += args if args is not None else ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy",
                                              "round_robin"]
        for url in prefill_urls:
            cmd += ["--prefill", url]
        for url in decode_urls:
            cmd += ["--decode", url]
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.http = httpx.Client(base_url=self.base_url, timeout=REQUEST_TIMEOUT_S)

    def wait_ready(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm-router exited with {self.proc.returncode}: "
                                     f"{self.log_path.read_text(errors='replace')[-3000:]}")
            try:
                return self.http.get("/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, STARTUP_TIMEOUT_S, "vllm-router to answer /health")

    def stop(self) -> None:
        import signal

        self.http.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def router_factory(tmp_path_factory):
    """start(prefill_urls, decode_urls) -> a ready RouterProcess, stopped when the module ends."""
    started: list[RouterProcess] = []

    def start(prefill_urls: list = (), decode_urls: list = (), prefix: tuple = (),
              args: Optional[list] = None) -> RouterProcess:
        router = RouterProcess(prefill_urls, decode_urls, tmp_path_factory.mktemp("router") / "router.log", prefix,
                               args)
        started.append(router)
        router.wait_ready()
        return router

    yield start
    for router in started:
        router.stop()
