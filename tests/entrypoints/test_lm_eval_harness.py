"""lm-evaluation-harness 0.4.13's `local-completions` model with `tokenizer_backend=remote` runs the three
task kinds of benchmarks/lm_eval_tasks/ against the server: multiple choice (loglikelihood), rolling
perplexity (loglikelihood_rolling) and generation (generate_until). It needs /tokenizer_info,
/tokenize, /detokenize and completions echo with prompt logprobs; before those it failed on every
loglikelihood task. Both memory modes: with head-wise recycling the scores are what the sliding heads see.
lm-eval comes with the test extra (pip install -e ".[test]")."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_NAME

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

TASKS = ("pydoc_next_sentence", "pydoc_perplexity", "pydoc_recall", "pydoc_needles")


@pytest.fixture(scope="module", params=["1d", "head_wise_recycle_on"])
def server(request, server_factory):
    flag = "0" if request.param == "1d" else "1"
    return server_factory(env={"FD_HEAD_WISE_KV_CACHE": flag, "FD_HEAD_WISE_SWA_RECYCLE": "1"})


def _tasks_in(folder: Path, repo: Path) -> None:
    """The task files, their data written to `folder` (the repository copies read data/ under it)."""
    subprocess.run([sys.executable, str(repo / "benchmarks/lm_eval_tasks/make_data.py"), "--out", str(folder),
                    "--needles-model", TINY_PRESET_NAME], check=True, capture_output=True)
    for task in TASKS:
        text = (repo / f"benchmarks/lm_eval_tasks/{task}.yaml").read_text()
        (folder / f"{task}.yaml").write_text(
            text.replace(f"benchmarks/lm_eval_tasks/data/{task}.jsonl", str(folder / f"{task}.jsonl")))


def test_lm_eval_local_completions_runs_every_task_kind(server, helpers, tmp_path):
    import lm_eval.evaluator  # noqa: F401 (the test extra installs it: a missing one fails here, never skips)
    _tasks_in(tmp_path, helpers.REPO)
    args = (f"model={server.model_name()},base_url={server.base_url}/v1/completions,tokenizer_backend=remote,"
            f"max_length=384,num_concurrent=1,max_retries=1")
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                          "--include_path", str(tmp_path), "--tasks", ",".join(TASKS), "--limit", "1",
                          "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    mc, ppl, gen, needles = (results[t] for t in TASKS)
    assert 0.0 <= mc["acc,none"] <= 1.0
    assert math.isfinite(ppl["word_perplexity,none"]) and ppl["word_perplexity,none"] > 1.0
    assert 0.0 <= gen["exact_match,first_four_words"] <= 1.0
    assert 0.0 <= needles["exact_match,first_number"] <= 1.0
    # Every request reached the engine: 4 choices, >= 2 rolling windows (a ~6,000-byte document), 2 generations.
    finished = sum(v for k, v in server.metrics().items() if k.startswith("fastdeploy:request_success_total"))
    assert finished >= 8
