"""Run the api_server as a child process: what benchmarks and end-to-end tests drive over HTTP.

    server = ApiServerProcess(["--max-num-seqs", "8"], env={"FD_HEAD_WISE_KV_CACHE": "1"},
                              log_path="server.log")
    try:
        server.wait_healthy(timeout_s=180)
        ...  # talk to server.base_url
    finally:
        server.stop()

The child's output goes to a log file, not a pipe (a pipe nobody reads fills up and blocks the
server); start-up failures quote the end of that log. The child gets its own session, so a signal
sent to the caller's terminal does not reach it twice, as under a process supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence

logger = logging.getLogger("fastdeploy.entrypoints.server_process")

API_SERVER_MODULE = "fastdeploy.entrypoints.openai.api_server"
# The directory holding the fastdeploy package: the child imports this copy, not another install.
PACKAGE_ROOT = Path(__file__).resolve().parents[3]


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy while starting; the message ends with its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS picks it); another process could still take it first."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port P with P and P + 1 both free right now (an event socket and its replay socket)."""
    for _ in range(100):
        port = free_port(host)
        if port < 65535:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports found")


def settings_to_flags(settings: Mapping[str, object]) -> list[str]:
    """{"max_num_seqs": 8, "head_wise_swa_config": {...}} -> ["--max-num-seqs", "8", ...].

    None is left out, dicts and lists become JSON, and a bool becomes `--flag` / `--no-flag`
    (the engine's switches are BooleanOptionalAction).
    """
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        flags += [flag, str(value)]
    return flags


class ApiServerProcess:
    """One api_server child process, started on construction.

    args: extra command-line flags (see settings_to_flags); port: a free one when None;
    metrics_port: passed as --metrics-port when given (the server's default serves /metrics on
    --port); env: variables set over this process's environment; entry: what `python` runs (upstream's
    module by default; `("-m", "fastdeploy.cli", "serve")` is the `fastdeploy serve` command).
    """

    def __init__(self, args: Sequence[str] = (), *, log_path, port: Optional[int] = None,
                 metrics_port: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                 host: str = "127.0.0.1", prefix: Sequence[str] = (),
                 entry: Sequence[str] = ("-m", API_SERVER_MODULE)):
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.metrics_port = metrics_port
        self.base_url = f"http://{host}:{self.port}"
        self.log_path = Path(log_path)
        # prefix: a command the server runs under, e.g. `ip netns exec NS` (a test host of its own)
        self.cmd = [*prefix, sys.executable, *entry, "--host", host, "--port", str(self.port)]
        if metrics_port is not None:
            self.cmd += ["--metrics-port", str(metrics_port)]
        self.cmd += list(args)
        full_env = dict(os.environ, **(env or {}))
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
        self._log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.cmd, cwd=PACKAGE_ROOT, env=full_env, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            self._log.close()
            raise

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_bytes().decode("utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def wait_healthy(self, timeout_s: float, poll_interval_s: float = 0.2) -> None:
        """Return once GET /health answers 200; raise ServerStartError if the server exits first
        or is still not healthy after timeout_s (it is left running then: stop() it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"the api_server exited with code {self.proc.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the engine starts
            time.sleep(poll_interval_s)
        raise ServerStartError(f"the api_server did not answer /health within {timeout_s:.0f} s; "
                               f"last lines of {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> Optional[int]:
        """SIGTERM (the server ends in-flight requests and its engine, then exits), then SIGKILL
        to its whole process group after timeout_s so no engine process outlives it. Returns the
        exit code. Safe to call twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("api_server pid %d ignored SIGTERM for %.0f s; killing it", self.proc.pid, timeout_s)
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: pgid == pid
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
