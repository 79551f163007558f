"""Every shell command the README and docs/ show still works as shown.

Commands are the lines of ```bash code blocks and inline code that starts with `python` or `pytest`.
Each one must name things that exist: a script or module whose own argument parser accepts the flags
shown (built without running the benchmark: `parse_args(argv)` or `build_parser()`), test paths,
served endpoints, known environment flags and package extras. The few that take seconds run for real
(RUN_HERE). A command that needs hardware or data this machine lacks carries a `# needs ...` comment on
its line or on a comment line above it in its block: it is parsed, never run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastdeploy import cli

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Documented commands cheap enough to run in the suite (seconds each): the script or module they call, and
# a word that picks the cheap form out of its other documented commands (None: every form).
RUN_HERE = {"fastdeploy.entrypoints.openai.api_server": "--help",
            "benchmarks/eval_swa_quality.py": "docs/swa_quality_results.json", "benchmarks/bench_recycling.py": "--tp-placements"}
OUTPUT_FLAGS = {"--json", "--plot", "--out", "--decision-json"}  # redirected to a temporary folder when run
SHELL_TOOLS = {"curl", "ps", "grep", "rm", "bash", "pip", "tar", "cmake", "vllm-router"}
ENDPOINTS_SOURCE = REPO / "fastdeploy" / "entrypoints" / "openai" / "api_server.py"


@dataclass
class Command:
    page: str
    text: str  # as shown, continuation lines joined
    argv: list
    env: dict
    needs: str  # the "# needs ..." reason, or ""

    def __str__(self):
        return f"{self.page}: {self.text}"


def _blocks(text: str):
    """(language, body) of every fenced code block."""
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        yield m.group(1), m.group(2)


def _split(line: str, variables: dict) -> list:
    """One shell line -> its simple commands' words (operators &&, ||, |, ;, & separate them)."""
    for name, value in variables.items():
        line = re.sub(rf"\$\{{?{name}\}}?\b", lambda _: value, line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words, commands = [], []
    for word in lexer:
        if word in {";", "&", "&&", "|", "||"}:
            commands.append(words)
            words = []
        else:
            words.append(word)
    return [c for c in commands + [words] if c]


def _logical_lines(body: str):
    """Lines as the shell reads them: backslash continuations joined, and a quote left open (a JSON body
    over several lines) continued on the next line."""
    pending = ""
    for line in body.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # no closing quotation yet
            continue
        yield pending
        pending = ""
    assert not pending, f"unclosed quotation: {pending}"


def _commands_of_block(page: str, body: str):
    variables, needs = {}, ""
    for line in _logical_lines(body):
        stripped = line.strip()
        if not stripped:
            needs = ""
            continue
        if stripped.startswith("#"):
            needs = stripped if re.search(r"\bneeds\b", stripped) else needs
            continue
        comment = stripped.partition(" #")[2]
        mark = comment if re.search(r"\bneeds\b", comment) else needs
        for words in _split(stripped, variables):
            if words[0] == "time":
                words = words[1:]
            env = {}
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if not words:  # NAME=value alone: a variable for the lines below
                variables.update(env)
                continue
            yield Command(page, stripped, words, env, mark)


def documented_commands() -> list:
    out = []
    for path in PAGES:
        page, text = str(path.relative_to(REPO)), path.read_text()
        for language, body in _blocks(text):
            if language in ("bash", "sh", "shell"):
                out.extend(_commands_of_block(page, body))
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for span in re.findall(r"`((?:[A-Z_]+=\S+ )*(?:python|pytest) [^`]+)`", prose):
            out.extend(_commands_of_block(page, " ".join(span.split())))
    return out


COMMANDS = documented_commands()


def _target(argv: list):
    """('module', name, args) / ('script', path, args) of a python command (or of a `fastdeploy` verb that
    is a module's command line), else None."""
    if argv[0] == "fastdeploy" and len(argv) > 1 and argv[1] in cli.MODULES:
        return "module", cli.MODULES[argv[1]], argv[2:]
    if argv[0] not in ("python", "python3"):
        return None
    if argv[1:3] == ["-m", "cProfile"]:  # the profiled program: after the profiler's own -s / -o options
        rest = argv[3:]
        while rest[0] in ("-s", "-o"):
            rest = rest[2:]
        return _target([argv[0], *rest])
    if argv[1] == "-m":
        return "module", argv[2], argv[3:]
    if argv[1] == "-c":
        return None
    return "script", argv[1], argv[2:]


def _parser_of(kind: str, name: str):
    """The documented program's own argument parsing, without running it."""
    if kind == "module":
        module = importlib.import_module(name)
    else:
        spec = importlib.util.spec_from_file_location(f"documented_{Path(name).stem}", REPO / name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        sys.path.insert(0, str((REPO / name).parent))  # as `python path.py` puts the script's folder first
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str((REPO / name).parent))
    if hasattr(module, "build_parser"):
        return module.build_parser().parse_args
    if hasattr(module, "parse_args"):
        return module.parse_args
    return None


def test_the_docs_show_commands_and_mark_what_needs_other_hardware():
    assert len(COMMANDS) > 50
    marked = [c for c in COMMANDS if c.needs]
    assert any("GPU" in c.needs for c in marked) and any("machines" in c.needs for c in marked)


def test_no_code_block_hides_a_command_from_these_checks():
    """A command in a fence without a shell language would escape every check below."""
    hidden = [f"{path.relative_to(REPO)}: a shell command in a ```{language} block" for path in PAGES
              for language, body in _blocks(path.read_text()) if language not in ("bash", "sh", "shell")
              and re.search(r"^\s*([A-Z_]+=\S+ )*(python|pytest|pip|curl) ", body, re.M)]
    assert hidden == []


def test_every_command_names_a_program_that_exists():
    unknown = []
    for c in COMMANDS:
        argv = c.argv
        target = _target(argv)
        if target and target[0] == "script" and not (REPO / target[1]).is_file():
            unknown.append(f"{c}  (no such script)")
        elif target and target[0] == "module" and target[1].startswith("fastdeploy"):
            if importlib.util.find_spec(target[1]) is None:
                unknown.append(f"{c}  (no such module)")
        elif argv[0] == "fastdeploy" and (len(argv) < 2 or argv[1] not in cli.VERBS):
            unknown.append(f"{c}  (no such fastdeploy verb)")
        elif target is None and argv[0] not in ("python", "python3", "pytest", ".", "fastdeploy", *SHELL_TOOLS):
            unknown.append(f"{c}  (what is {argv[0]!r}?)")
        elif argv[0] == "bash" and not (REPO / argv[1]).is_file():
            unknown.append(f"{c}  (no such file)")
    assert unknown == []


@pytest.mark.parametrize("command", [c for c in COMMANDS if _target(c.argv)], ids=str)
def test_the_program_accepts_the_documented_flags(command):
    kind, name, args = _target(command.argv)
    if kind == "module" and not name.startswith("fastdeploy"):
        assert command.needs or name in ("venv",), f"{command}: another project's program, not marked # needs"
        return
    parse = _parser_of(kind, name)
    if parse is None:  # e.g. a setuptools script: only acceptable where the docs say it cannot run here
        assert command.needs, f"{command}: {name} has neither build_parser() nor parse_args(argv)"
        return
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            parse(args)
        except SystemExit as exc:
            if exc.code not in (0, None):  # --help exits 0
                pytest.fail(f"{command}\n{stderr.getvalue().strip().splitlines()[-1]}")


def test_pytest_commands_name_test_paths_that_exist():
    missing = [f"{c}: {a}" for c in COMMANDS if c.argv[0] == "pytest"
               for a, before in zip(c.argv[1:], c.argv) if not a.startswith("-") and before not in ("-m", "-k")
               and not (REPO / a.split("::")[0]).exists()]
    assert missing == []


def test_curl_commands_ask_endpoints_the_server_has():
    routes = set(re.findall(r'"(/[\w/.-]*)"', ENDPOINTS_SOURCE.read_text()))
    asked = [(c, re.sub(r"^[\w.:]*?(?=/)", "", a)) for c in COMMANDS if c.argv[0] == "curl"
             for a in c.argv[1:] if a.startswith("localhost:")]
    assert asked and [f"{c}: {path}" for c, path in asked if path not in routes] == []


def test_environment_flags_in_commands_exist():
    source = "".join(p.read_text(errors="replace") for top in ("fastdeploy", "custom_ops", "tests")
                     for p in (REPO / top).rglob("*") if p.suffix in (".py", ".cc", ".h"))
    unknown = {f"{c.page}: {name}" for c in COMMANDS for name in c.env if name.startswith("FD_") and name not in source}
    assert unknown == set()


def test_pip_installs_name_extras_the_package_has():
    extras = set(re.findall(r'"(\w+)": \[', (REPO / "setup.py").read_text()))
    asked = {e for c in COMMANDS if c.argv[0] == "pip" for a in c.argv for m in [re.search(r"\.\[([\w,]+)\]", a)]
             if m for e in m.group(1).split(",")}
    assert asked and asked - extras == set()


def _run_args(command: Command, tmp_path: Path) -> list:
    """The documented command line with its output files moved to tmp_path (the repo stays clean)."""
    argv = list(command.argv)
    for i, word in enumerate(argv[:-1]):
        if word in OUTPUT_FLAGS:
            argv[i + 1] = str(tmp_path / Path(argv[i + 1]).name)
    return [sys.executable, *argv[1:]]


@pytest.mark.parametrize("program", sorted(RUN_HERE))
def test_the_documented_commands_that_take_seconds_run(program, tmp_path):
    word = RUN_HERE[program]
    shown = [c for c in COMMANDS if _target(c.argv) and _target(c.argv)[1] == program and not c.needs
             and (word is None or word in c.argv)]
    assert shown, f"no page shows a {program} command{f' with {word}' if word else ''} any more"
    for command in shown:
        done = subprocess.run(_run_args(command, tmp_path), cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**command.env, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                   "HOME": str(Path.home())})
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        assert done.stdout.strip(), f"{command} printed nothing"
