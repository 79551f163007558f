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


def test_readme_and_ci_install_the_cpu_extra_so_a_fresh_machine_still_gets_paddle():
    assert 'pip install -e ".[cpu,test]"' in (REPO / "README.md").read_text()
    assert '-e ".[cpu,test]"' in (REPO / ".ci" / "run").read_text()


def test_readme_and_ci_install_the_transformers_release_that_tokenizes_gemma_as_llama_cpp():
    """The reference must read Gemma 3's vocabulary as llama.cpp does (5.3.0 cut its words into pieces);
    it is installed after the extras because paddleformers 1.2.0 declares transformers<5.4."""
    pin = 'pip install "transformers==5.24.0"'
    assert pin in (REPO / "README.md").read_text() and pin in (REPO / ".ci" / "run").read_text()
    assert "transformers" not in _names(_setup_keywords()["extras_require"]["test"])


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
