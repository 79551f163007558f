"""Worker side of prompt log-probs: the final hidden states of the rows a step asks for, through the
model's own final norm and LM head, reduced to the scored token's log-prob and the top k.

Only steps whose StepInput lists `prompt_rows` pay for it. The rows are read off the model's
`hidden_observer` hook (chained with any observer a tool installed), so the forward pass is the
engine's real one: chunked prefill, paging and head-wise recycling are whatever the step does.
The LM head runs in blocks of ROW_BLOCK rows, so a long chunk never holds [chunk, vocab] logits.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import numpy as np
import paddle


# Rows per LM-head pass (a multiple of the model's row alignment of 8): 256 x 49152 float32 = 48 MiB.
ROW_BLOCK = 256
ROW_ALIGN = 8  # the model's row alignment: padded to it, a row's result is batch-independent


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise, in numpy: Paddle's CPU log_softmax over a 50k-wide axis takes seconds per row block."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def row_logprobs(model, hidden: paddle.Tensor) -> np.ndarray:
    """Next-token log-probs [rows, vocab] of final hidden states, through the model's own final norm and
    LM head; rows padded to ROW_ALIGN, so a row's result does not depend on how many come with it."""
    rows = hidden.shape[0]
    padded = -(-rows // ROW_ALIGN) * ROW_ALIGN
    if padded != rows:
        hidden = paddle.concat([hidden, paddle.zeros([padded - rows, hidden.shape[1]], hidden.dtype)])
    return log_softmax(model.lm_logits(hidden)[:rows].numpy())


class PromptRowCapture:
    def __init__(self, model, step):
        self.model, self.step = model, step
        self.rows = paddle.to_tensor(step.prompt_rows, dtype="int64")
        self.previous = model.hidden_observer
        self.hidden: Optional[paddle.Tensor] = None

    def __call__(self, meta, hidden) -> None:
        if self.previous is not None:
            self.previous(meta, hidden)
        self.hidden = paddle.gather(hidden, self.rows)

    def logprobs(self) -> tuple:
        """(target logprob float32 [R], top ids int64 [R, k], top logprobs float32 [R, k])."""
        targets, k = self.step.prompt_targets, self.step.prompt_top_k
        n = len(targets)
        chosen = np.empty(n, np.float32)
        top_ids = np.empty((n, k), np.int64)
        top_lps = np.empty((n, k), np.float32)
        for a in range(0, n, ROW_BLOCK):
            lp = row_logprobs(self.model, self.hidden[a:a + ROW_BLOCK])
            rows = lp.shape[0]
            chosen[a:a + rows] = lp[np.arange(rows), targets[a:a + rows]]
            if k:
                part = np.argpartition(-lp, k - 1, axis=1)[:, :k]
                vals = np.take_along_axis(lp, part, axis=1)
                order = np.argsort(-vals, axis=1, kind="stable")
                top_ids[a:a + rows] = np.take_along_axis(part, order, axis=1)
                top_lps[a:a + rows] = np.take_along_axis(vals, order, axis=1)
        return chosen, top_ids, top_lps


@contextmanager
def capture_prompt_rows(model, step):
    """Yields a PromptRowCapture while the step's forward runs, or None when it asks for no rows."""
    if step.prompt_rows is None or not len(step.prompt_rows):
        yield None
        return
    capture = PromptRowCapture(model, step)
    model.hidden_observer = capture
    try:
        yield capture
    finally:
        model.hidden_observer = capture.previous
