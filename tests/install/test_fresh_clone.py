"""The README's set-up walked as a newcomer does: the project's files copied as a fresh clone has them,
a fresh virtual environment, the first line (`pip install -e ".[cpu]" && fastdeploy serve`: no pip
conflict, and with no --model a chat request answered with SmolLM2's text, the model fetched into an
empty model cache), then the second line's install (`pip install -e ".[cpu,test]"`, no conflict, `pip
check` clean). Its `pytest tests` is what CI runs, after its own run of that install."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUESTION = {"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
            "max_tokens": 24, "temperature": 0}


def _fresh_clone(target: Path) -> None:
    """The files a clone of this work tree holds: tracked and new ones, nothing git ignores."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _run(cmd: str, cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _assert_no_conflict(done: subprocess.CompletedProcess) -> None:
    output = done.stdout + done.stderr
    assert "dependency conflicts" not in output and "incompatible" not in output, output[-3000:]


def _chat(port: int) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(QUESTION).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_two_commands_install_and_serve_smollm2_from_a_fresh_clone(tmp_path):
    from fastdeploy.entrypoints.openai.server_process import free_port

    clone = tmp_path / "clone"
    _fresh_clone(clone)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(Path(sys.executable).parent)))
    env["FD_MODEL_DIR"] = str(tmp_path / "models")  # an empty model cache: the first start fetches
    _run("python3 -m venv .venv", clone, env, 300)
    _assert_no_conflict(_run('. .venv/bin/activate && pip install -e ".[cpu]"', clone, env, 1800))
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(["bash", "-c", f". .venv/bin/activate && exec fastdeploy serve --port {port}"],
                              cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "fastdeploy serve was not ready in 15 minutes"
            time.sleep(1)
        assert "Paris" in _chat(port)
        assert (tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()
    # The second line's install, over the first: everything the suite needs, in one resolver pass.
    _assert_no_conflict(_run('. .venv/bin/activate && pip install -e ".[cpu,test]"', clone, env, 2400))
    _run(". .venv/bin/activate && pip check", clone, env, 300)
