"""The CUDA-on-CPU library's cache key names what built it: the same sources under another compiler (or
another release of it) get another folder, never a library built by the other one."""

import stat

from fastdeploy.model_executor.layers.attention.ops import cuda_on_cpu_loader


def _compiler(tmp_path, name: str, version: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho '{version}'\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_the_build_key_changes_with_the_compiler_and_its_version(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    default = cuda_on_cpu_loader.source_key()
    assert cuda_on_cpu_loader.source_key() == default  # stable
    monkeypatch.setenv("CXX", _compiler(tmp_path, "cxx-a", "cxx 12.2.0"))
    first = cuda_on_cpu_loader.source_key()
    monkeypatch.setenv("CXX", _compiler(tmp_path, "cxx-b", "cxx 12.2.0"))
    other_name = cuda_on_cpu_loader.source_key()
    (tmp_path / "cxx-a").write_text("#!/bin/sh\necho 'cxx 13.1.0'\n")
    monkeypatch.setenv("CXX", str(tmp_path / "cxx-a"))
    cuda_on_cpu_loader._compiler_identity.cache_clear()
    upgraded = cuda_on_cpu_loader.source_key()
    assert len({default, first, other_name, upgraded}) == 4
