"""The per-step message from the engine to the model workers, and the answer of rank 0.

Plain numpy arrays and ints, so it pickles small and both sides import it without importing each
other: the engine builds it from a scheduled batch, a worker (in-process for TP=1, one process per
rank otherwise) turns it into a ForwardMeta. Page ids in the head-wise table are rank-local and
rows are indexed by slot (KV head h for the per-head layout): the engine builds the table for every
slot, and `for_rank` gives each rank the rows of its own slots (docs/memory_model.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np


@dataclass
class StepInput:
    input_ids: np.ndarray           # int64 [token_num]: the tokens computed this step, request after request
    seq_lens_encoder: np.ndarray    # int32 [bsz]: chunk length while in the prompt (or > 1 token), else 0
    seq_lens_decoder: np.ndarray    # int32 [bsz]: tokens already in the cache
    seq_lens_this_time: np.ndarray  # int32 [bsz]
    cu_seqlens_q: np.ndarray        # int32 [bsz + 1]
    block_tables: Optional[np.ndarray]            # int32 [bsz, max_blocks] (1-D mode)
    block_tables_head_wise: Optional[np.ndarray]  # int32 [bsz, KV heads, max_blocks] (head-wise mode)
    sample_rows: np.ndarray         # int64 [num_sampled]: last row of each request that samples (every
                                    # row of its piece for a request verifying drafts)
    greedy: np.ndarray              # bool [num_sampled]: plain argmax is this request's whole sampler
    slot_ids: list                  # persistent slot per request (the dense reference backend's storage)
    # Prompt log-probs (engine/prompt_logprobs.py): rows whose next-token log-probs are wanted, the
    # token each row is scored against, and how many top entries to return (the step's largest k).
    prompt_rows: Optional[np.ndarray] = None     # int64 [num_prompt_rows]
    prompt_targets: Optional[np.ndarray] = None  # int64 [num_prompt_rows]
    prompt_top_k: int = 0

    def for_rank(self, rank: int, tp: int) -> "StepInput":
        """This step as rank `rank` of `tp` sees it: head-wise rows of its KV heads only (1-D block
        ids are the same on every rank, each addressing that rank's own cache)."""
        if tp == 1 or self.block_tables_head_wise is None:
            return self
        per = self.block_tables_head_wise.shape[1] // tp
        return replace(self, block_tables_head_wise=np.ascontiguousarray(
            self.block_tables_head_wise[:, rank * per:(rank + 1) * per]))

    @property
    def starts(self) -> list:
        return self.seq_lens_decoder.tolist()

    @property
    def lengths(self) -> list:
        return self.seq_lens_this_time.tolist()


@dataclass
class StepOutput:
    """What rank 0 sends back: argmax tokens of the greedy rows (-1 elsewhere), and the full logits
    of the other sampling rows only; their sampler needs per-request state the engine keeps
    (seeded generator, output history for penalties and min_tokens)."""

    greedy_tokens: np.ndarray  # int64 [num_sampled]
    logits: np.ndarray         # float32 [num_not_greedy, vocab], in sample-row order
    # For StepInput.prompt_rows: (target logprob float32 [R], top ids int64 [R, k], top logprobs
    # float32 [R, k]); None when the step asked for none.
    prompt_logprobs: Optional[tuple] = None
