"""What a newcomer sees from the server's command line and log: --help with defaults and env
flags, --version and GET /version, a busy port named, one log format and one 'ready' line."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from fastdeploy import __version__, envs

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
SERVER = [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server"]


def _run(helpers, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVER, *args], cwd=helpers.REPO, capture_output=True, text=True, timeout=120)


def test_help_shows_defaults_and_every_environment_flag(helpers):
    out = _run(helpers, "--help")
    assert out.returncode == 0, out.stderr
    text = re.sub(r"\s+", " ", out.stdout)
    assert "--port PORT port of the API (default: 8000)" in text
    assert "--max-request-body-bytes MAX_REQUEST_BODY_BYTES larger request bodies get HTTP 413 (default: 33554432)" \
        in text
    for name, default, _ in envs.describe():
        assert f"{name}={default}" in out.stdout, name


def test_version_flag_and_route_name_the_package_version(helpers):
    out = _run(helpers, "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"fastdeploy-headwise-swa {__version__} (")


def test_busy_port_is_named_in_the_error(helpers):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _run(helpers, "--host", "127.0.0.1", "--port", str(port))
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} (--port): Address already in use" in out.stderr


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory()


def test_version_route_is_open(server):
    resp = server.http.get("/version")
    assert resp.status_code == 200 and resp.json() == {"version": __version__}


def test_log_has_one_format_and_one_ready_line_after_the_engine_is_built(server):
    server.assert_still_serves()
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    assert lines
    assert [line for line in lines if not LOG_LINE.match(line)] == []
    ready = [i for i, line in enumerate(lines) if ": ready: serving " in line]
    built = [i for i, line in enumerate(lines) if "fastdeploy.engine: engine built: " in line]
    assert len(ready) == 1 and len(built) == 1 and built[0] < ready[0]
    assert not [line for line in lines if "Warning" in line or "ccache" in line]
