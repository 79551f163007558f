"""Installing the project must not replace a user's Paddle, and a missing Paddle is one clear line."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Runs code with `paddle` unimportable, as on a machine where no Paddle wheel is installed.
BLOCK_PADDLE = """
import sys
class _NoPaddle:
    def find_spec(self, name, path=None, target=None):
        if name == "paddle" or name.startswith("paddle."):
            raise ModuleNotFoundError("No module named 'paddle'", name=name)
        return None
sys.meta_path.insert(0, _NoPaddle())
"""


def _setup_keywords() -> dict:
    """The literal keyword arguments of setup() in setup.py (read, not run)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
            if kw.arg in ("install_requires", "extras_require", "python_requires")}


def _names(requirements) -> set[str]:
    from packaging.requirements import Requirement

    return {Requirement(r).name.lower() for r in requirements}


def test_install_requires_no_paddle_wheel_so_an_installed_paddlepaddle_gpu_is_left_alone():
    setup = _setup_keywords()
    assert not {n for n in _names(setup["install_requires"]) if n.startswith("paddlepaddle")}
    assert "paddlepaddle" in _names(setup["extras_require"]["cpu"])


def test_readme_sets_up_in_two_lines_that_ci_runs_as_written():
    """The README's set-up block is a venv line and two command lines, neither with --no-deps: one installs
    and serves, one installs and tests; .ci/run starts with the second as written, then the slow tier."""
    readme, ci = (REPO / "README.md").read_text(), (REPO / ".ci" / "run").read_text()
    block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]
    assert commands[0].startswith("python3 -m venv")
    assert commands[1:] == ['pip install -e ".[cpu]" && fastdeploy serve',
                            'pip install -e ".[cpu,test]" && pytest tests'], commands
    assert "--no-deps" not in block
    ci_commands = [line.split("#")[0].strip() for line in ci.splitlines()
                   if line.split("#")[0].strip() and not line.startswith(("set ", "cd ", ". ", "python3 -m venv"))]
    assert ci_commands[0] == commands[2] and "pytest -m slow tests" in ci_commands, ci_commands


def test_the_test_extra_holds_the_references_and_the_pd_extra():
    """One resolver pass installs everything: transformers pinned in the extra, NIXL and the router
    through the pd extra (their dependencies resolved), PaddleFormers nowhere (its own environment)."""
    extras = _setup_keywords()["extras_require"]
    assert "transformers==5.24.0" in extras["test"] and "torch==2.13.0" in extras["test"]
    assert "fastdeploy-headwise-swa[pd]" in extras["test"]
    assert {"nixl-cu12", "vllm-router"} <= _names(extras["pd"])
    assert not any("paddleformers" in _names(reqs) for reqs in extras.values())


def _run_without_paddle(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_PADDLE + code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_server_without_paddle_exits_with_one_line_naming_both_wheels():
    proc = _run_without_paddle(
        "from fastdeploy.entrypoints.openai.api_server import main\nraise SystemExit(main([]))")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "`paddlepaddle`" in lines[0] and "`paddlepaddle-gpu`" in lines[0]


def test_offline_api_without_paddle_raises_import_error_naming_both_wheels():
    proc = _run_without_paddle(
        "try:\n    from fastdeploy import LLM\nexcept ImportError as e:\n    print(e)\n    raise SystemExit(3)")
    assert proc.returncode == 3, proc.stderr
    assert "`paddlepaddle`" in proc.stdout and "`paddlepaddle-gpu`" in proc.stdout


def test_importing_the_project_and_paddle_prints_no_ccache_warning():
    # PATH without ccache, as on a fresh machine: Paddle warns at import unless the project filtered it.
    proc = subprocess.run(
        [sys.executable, "-c", "import fastdeploy.model_executor.layers.attention.ops, paddle"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": str(Path(sys.executable).parent)})
    assert proc.returncode == 0, proc.stderr
    assert "ccache" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
