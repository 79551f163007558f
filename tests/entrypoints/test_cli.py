"""The `fastdeploy` command: its verbs, its errors, and `serve` taking api_server's flags with a real
model as its default (`fastdeploy serve` alone answering chat: test_real_model_server.py)."""

import shutil
import subprocess
import sys

import pytest

from fastdeploy import cli
from fastdeploy.model_executor.models.named_models import NAMED_MODELS


def test_help_lists_every_verb(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for verb in ("serve", "download", "models", "find-swa-heads", "find-swa-windows"):
        assert f"  {verb} " in out


def test_the_console_script_is_installed_and_runs():
    script = shutil.which("fastdeploy") or pytest.fail("no `fastdeploy` on PATH: pip install -e . installs it")
    done = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("fastdeploy-headwise-swa "), done.stderr


def test_no_verb_or_an_unknown_one_is_usage_and_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["srve"]) == 2
    assert "unknown verb 'srve'" in capsys.readouterr().err


def test_serve_takes_the_api_servers_flags():
    done = subprocess.run([sys.executable, "-m", "fastdeploy.cli", "serve", "--help"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "--head-wise-swa-config" in done.stdout and "--model" in done.stdout


def test_serve_defaults_to_the_real_model_and_keeps_a_given_one(monkeypatch):
    from fastdeploy.entrypoints.openai import api_server

    seen = []
    monkeypatch.setattr(api_server, "main", lambda argv: seen.append(argv) or 0)
    cli.main(["serve", "--port", "9"])
    cli.main(["serve", "--model=x.gguf"])
    assert seen == [["--model", "smollm2-135m-instruct", "--port", "9"], ["--model=x.gguf"]]


def test_download_names_the_known_models_when_given_another(capsys):
    assert cli.main(["download", "llama-70b"]) == 2
    err = capsys.readouterr().err
    assert "'llama-70b' is not a named model" in err and all(name in err for name in NAMED_MODELS)


def test_models_lists_each_named_model_and_where_it_is(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FD_MODEL_DIR", str(tmp_path))
    (tmp_path / NAMED_MODELS["gemma-3-270m"].filename).write_bytes(b"")
    assert cli.main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("smollm2-135m-instruct") and "not downloaded yet" in line and "default" in line
               for line in lines)
    assert any(line.startswith("gemma-3-270m") and str(tmp_path) in line for line in lines)
