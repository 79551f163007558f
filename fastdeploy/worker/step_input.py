"""The per-step message from the engine to the model workers, and the answer of rank 0.

Plain numpy arrays and ints, so it pickles small and both sides import it without importing each
other: the engine builds it from a scheduled batch, a worker (in-process for TP=1, one process per
rank otherwise) turns it into a ForwardMeta.

The block table is persistent (vLLM's persistent input batch): every worker keeps one
`[max_num_seqs, rows, max_blocks]` table, a request keeps its batch row while it runs, and a step
carries only the entries that changed (`table_updates`), never a whole table. Rows of the table are
the KV cache manager's rows: 1 in 1-D mode (block ids, the same on every rank), one per slot head-wise
(page ids local to the slot's rank); `for_rank` gives each rank the updates of its own slots.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np


@dataclass
class TableUpdate:
    """Entries [col, col + width) of `slots` (None: every row) in batch row `row` become `ids`
    (int32 [len(slots) or rows, width]), or -1 when `ids` is None; width None reaches the row's end."""

    row: int
    slots: Optional[np.ndarray]
    col: int
    width: Optional[int]
    ids: Optional[np.ndarray] = None

    def for_rank(self, rank: int, rows_per_rank: int) -> Optional["TableUpdate"]:
        """This update as a rank holding global rows [rank * rows_per_rank, (rank + 1) * rows_per_rank)
        sees it, rows renumbered locally; None if none of them changes."""
        lo, hi = rank * rows_per_rank, (rank + 1) * rows_per_rank
        if self.slots is None:
            return replace(self, ids=None if self.ids is None else self.ids[lo:hi])
        mine = (self.slots >= lo) & (self.slots < hi)
        if not mine.any():
            return None
        return replace(self, slots=self.slots[mine] - lo, ids=None if self.ids is None else self.ids[mine])


@dataclass
class StepInput:
    input_ids: np.ndarray           # int64 [token_num]: the tokens computed this step, in batch-row order
    # Per batch row [bsz] (bsz: the highest row scheduled + 1; rows not scheduled now are idle: all 0)
    seq_lens_encoder: np.ndarray    # int32: chunk length while in the prompt (or > 1 token), else 0
    seq_lens_decoder: np.ndarray    # int32: tokens already in the cache
    seq_lens_this_time: np.ndarray  # int32
    cu_seqlens_q: np.ndarray        # int32 [bsz + 1]
    table_updates: list             # TableUpdate, applied in order to the persistent table before the step
    sample_rows: np.ndarray         # int64 [num_sampled]: last row of each request that samples (every
                                    # row of its piece for a request verifying drafts)
    greedy: np.ndarray              # bool [num_sampled]: plain argmax is this request's whole sampler
    slot_ids: list                  # the scheduled requests' batch rows, in order (also the dense
                                    # reference backend's per-request storage)
    # Prompt log-probs (engine/prompt_logprobs.py): rows whose next-token log-probs are wanted, the
    # token each row is scored against, and how many top entries to return (the step's largest k).
    prompt_rows: Optional[np.ndarray] = None     # int64 [num_prompt_rows]
    prompt_targets: Optional[np.ndarray] = None  # int64 [num_prompt_rows]
    prompt_top_k: int = 0

    def for_rank(self, rank: int, tp: int, table_rows: int) -> "StepInput":
        """This step as rank `rank` of `tp` sees it, the table having `table_rows` rows over all ranks
        (FDConfig.table_rows): the updates of its own rows (a 1-D table's one row is every rank's: its
        block ids address each rank's own cache)."""
        if tp == 1 or table_rows == 1:
            return self
        per = table_rows // tp
        updates = [u for u in (u.for_rank(rank, per) for u in self.table_updates) if u is not None]
        return replace(self, table_updates=updates)

    @property
    def starts(self) -> list:
        """Tokens already cached, per scheduled request (in slot_ids order)."""
        return self.seq_lens_decoder[self.slot_ids].tolist()

    @property
    def lengths(self) -> list:
        return self.seq_lens_this_time[self.slot_ids].tolist()


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
