"""transformers on torch over the file the engine serves (a GGUF file or a Hugging Face directory): the
reference the tests compare with, and the differentiable model the gate finder trains against.

PaddleFormers' dependency paddlecodec installs an import package named `torchcodec` without torchcodec's
metadata; transformers then takes it for torchcodec and fails to read its version. Nothing here decodes
audio or video, so transformers is told there is no torchcodec.
"""

from __future__ import annotations

import importlib.metadata
import os


def hide_paddlecodec_from_transformers() -> None:
    try:
        importlib.metadata.version("torchcodec")
    except importlib.metadata.PackageNotFoundError:
        import transformers.utils
        import transformers.utils.import_utils as import_utils

        import_utils.is_torchcodec_available = transformers.utils.is_torchcodec_available = lambda: False


def load(path: str, threads: int | None = None, tokenizer: bool = True):
    """(tokenizer or None, float32 model in eval mode) of a `.gguf` file or a model directory."""
    import torch
    import transformers

    hide_paddlecodec_from_transformers()
    torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
    if path.endswith(".gguf"):
        folder, name = os.path.split(path)
        kwargs = {"gguf_file": name}
    else:
        folder, kwargs = path, {}
    tok = transformers.AutoTokenizer.from_pretrained(folder, **kwargs) if tokenizer else None
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return tok, model.eval()
