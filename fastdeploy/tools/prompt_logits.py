"""Per-position next-token log-probs of a prompt, read off the engine's real path.

The model's `hidden_observer` hook sees the final hidden states of every row of every step; this
observer turns them into log-probs with the model's own final norm and LM head. One prompt runs at
a time (max_tokens=1, prefix caching off), so every observed row belongs to it and positions follow
from the step's start; chunked prefill, paging and recycling are whatever the engine does.
"""

from __future__ import annotations

import numpy as np

from fastdeploy.engine.request import SamplingParams
from fastdeploy.worker.prompt_logprobs import log_softmax, row_logprobs  # noqa: F401 (log_softmax: this module's API too)


class _Collector:
    def __init__(self, model, num_tokens: int, on_rows):
        self.model, self.num_tokens, self.on_rows = model, num_tokens, on_rows

    def __call__(self, meta, hidden) -> None:
        if len(meta.starts) != 1:
            raise RuntimeError("prompt logits: more than one request in a step")
        start, n = meta.starts[0], meta.lengths[0]
        if start >= self.num_tokens:  # a decode step after the prompt: not a prompt position
            return
        self.on_rows(start, row_logprobs(self.model, hidden)[:n])


def prompt_logprobs(llm, token_ids: list, on_rows) -> None:
    """Run one prompt through `llm`; on_rows(start, logprobs float32 [n, vocab]) for each chunk, where
    row i predicts token start + i + 1."""
    if llm.engine.fd_config.cache_config.enable_prefix_caching:
        raise ValueError("prompt logits need every position computed: build the engine with prefix caching off")
    model = llm.engine.runner.model
    model.hidden_observer = _Collector(model, len(token_ids), on_rows)
    try:
        llm.generate([list(token_ids)], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        model.hidden_observer = None


def full_prompt_logprobs(llm, token_ids: list) -> np.ndarray:
    """float32 [len(token_ids), vocab] log-probs (small prompts: the whole matrix at once)."""
    out = np.zeros((len(token_ids), llm.engine.model_config.vocab_size), np.float32)

    def keep(start, lp):
        out[start:start + lp.shape[0]] = lp

    prompt_logprobs(llm, token_ids, keep)
    return out
