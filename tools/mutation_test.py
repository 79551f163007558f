"""Mutation testing of one core module with mutmut, against the fast tests that guard it.

    python tools/mutation_test.py MODULE        # run every mutant of MODULE afresh
    python tools/mutation_test.py MODULE --show # list the surviving mutants with their diffs
    python tools/mutation_test.py --list        # the modules and their test subsets

Each module runs in its own scratch copy under .mutmut/MODULE (git-ignored): mutmut mutates only
that file and runs only the listed tests, so one module takes minutes, not the whole suite's time.
Not part of CI. See docs/mutation_testing.md for the last results and the equivalent mutants.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# module -> (source file, the tests that guard it: fast, no servers, no subprocesses)
MODULES = {
    "sampler": ("fastdeploy/model_executor/layers/sampler.py",
                ["tests/layers/test_sampler.py", "tests/layers/test_sampler_distribution.py",
                 "tests/layers/test_sampler_adjustments.py"]),
    "stop_strings": ("fastdeploy/engine/stop_strings.py",
                     ["tests/engine/test_stop_strings.py", "tests/engine/test_stop_strings_exact.py"]),
    "head_wise": ("fastdeploy/cache_manager/head_wise.py",
                  ["tests/cache_manager/test_head_wise.py", "tests/cache_manager/test_page_need_edges.py",
                   "tests/cache_manager/test_hit_validity_edges.py",
                   "tests/engine/test_scheduler_capacity_edges.py"]),
    "prefix_cache_manager": ("fastdeploy/cache_manager/prefix_cache_manager.py",
                             ["tests/cache_manager/test_prefix_cache_manager.py",
                              "tests/cache_manager/test_manager_messages_and_modes.py",
                              "tests/cache_manager/test_free_errors.py", "tests/cache_manager/test_prefix_tree.py",
                              "tests/engine/test_scheduler_capacity_edges.py",
                              "tests/engine/test_scheduler_exploration.py"]),
    "prefix_tree": ("fastdeploy/cache_manager/prefix_tree.py",
                    ["tests/cache_manager/test_prefix_tree.py", "tests/cache_manager/test_prefix_caching_policy.py",
                     "tests/cache_manager/test_hit_validity_edges.py", "tests/cache_manager/test_free_errors.py",
                     "tests/cache_manager/test_prefix_tree_edges.py"]),
    "projected_admission": ("fastdeploy/engine/sched/projected_admission.py",
                            ["tests/engine/test_projected_admission_exact.py",
                             "tests/engine/test_admission_policy.py",
                             "tests/engine/test_scheduler_liveness.py",
                             "tests/engine/test_scheduler_exploration.py"]),
    "resource_manager_v1": ("fastdeploy/engine/sched/resource_manager_v1.py",
                            ["tests/engine/test_resource_manager_v1.py",
                             "tests/engine/test_scheduler_capacity_edges.py",
                             "tests/engine/test_scheduler_exploration.py",
                             "tests/engine/test_prefix_caching_scheduler.py",
                             "tests/engine/test_scheduler_counters.py",
                             "tests/engine/test_scheduler_integrity_messages.py",
                             "tests/engine/test_scheduler_step_edges.py",
                             "tests/engine/test_admission_policy.py",
                             "tests/engine/test_scheduler_liveness.py",
                             "tests/engine/test_projected_admission_exact.py",
                             "tests/cache_manager/test_prefix_caching_policy.py"]),
}

# Copied into the scratch tree as they are (the engine tests build the CPU op from custom_ops).
SHARED = ["fastdeploy", "custom_ops", "tests/conftest.py"]


def prepare(name: str) -> Path:
    source, tests = MODULES[name]
    work = REPO / ".mutmut" / name
    shutil.rmtree(work, ignore_errors=True)  # mutmut's cache would keep verdicts from older tests
    for rel in SHARED + tests:
        src, dst = REPO / rel, work / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "build"))
        else:
            shutil.copy2(src, dst)
    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = fastdeploy\n"
        "also_copy = custom_ops\n"
        # A mutant that loops (eviction, borrowing) is stopped after 4x the clean run, not mutmut's 15x.
        "timeout_multiplier = 4.0\n"
        f"only_mutate = {source}\n"
        "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests) +
        "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -q\n")
    return work


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", nargs="?", choices=sorted(MODULES))
    parser.add_argument("--show", action="store_true", help="print the surviving mutants' diffs")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1: a shared machine)")
    parser.add_argument("--list", action="store_true", help="list the modules and their tests")
    parser.add_argument("--only", action="append", metavar="FUNCTION",
                        help="mutate only this function or method (repeatable; a quick re-check after a fix)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list or args.module is None:
        for name, (source, tests) in MODULES.items():
            print(f"{name:22s} {source}\n{'':22s} tests: {' '.join(tests)}")
        return 0
    work = prepare(args.module) if not args.show else REPO / ".mutmut" / args.module
    env = dict(os.environ, PYTHONPATH=str(work))
    mutmut = [sys.executable, "-m", "mutmut"]
    if not args.show:
        selected = [f"*{name}__mutmut_*" for name in args.only or ()]
        subprocess.run([*mutmut, "run", "--max-children", str(args.jobs), *selected], cwd=work, env=env, check=False)
    results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=work, env=env, capture_output=True,
                             text=True)
    verdicts = dict(line.strip().rsplit(": ", 1) for line in results.stdout.splitlines() if ": " in line)
    if args.only:
        verdicts = {m: v for m, v in verdicts.items() if any(f"{name}__mutmut_" in m for name in args.only)}
    for mutant, verdict in verdicts.items():
        if verdict != "killed":
            print(f"{mutant}: {verdict}")
            if args.show:
                subprocess.run([*mutmut, "show", mutant], cwd=work, env=env, check=False)
    counts = sorted(set(verdicts.values()))
    print(f"{args.module}: {len(verdicts)} mutants: " + ", ".join(f"{v} {list(verdicts.values()).count(v)}"
                                                              for v in counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
