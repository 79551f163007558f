"""A constrained request's matcher, and the step's token masks computed beside the forward pass.

Each step, `StepMasks.start(batch)` hands the constrained requests' matchers to a background
thread, which has llguidance fill one bitmask row per sampled row (its worker threads, outside the
GIL) while the model runs; `result()` gives each request a bool [rows, vocab] array of the tokens
its grammar bans (the inversion is done there too, off the sampling path). Free requests in the same batch cost nothing. With drafts (n-gram speculation), row j's
mask is the matcher's after drafts 1..j: llguidance walks the drafts and rolls itself back, and the
scheduler only proposes drafts the grammar accepts (`GrammarState.valid_drafts`), so verification
samples every row exactly as one-by-one decoding would and the output is the same with speculation
on or off. After sampling, `GrammarState.accept` advances the matcher by the tokens kept.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

logger = logging.getLogger("fastdeploy.guided_decoding")
_pool: Optional[ThreadPoolExecutor] = None
_executor = None
_lock = threading.Lock()


def _workers():
    """One Python thread that waits on llguidance's executor (its own threads, GIL released)."""
    global _pool, _executor
    with _lock:
        if _pool is None:
            import llguidance

            _executor = llguidance.LLExecutor()
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fd-grammar-masks")
    return _pool, _executor


class GrammarState:
    """The matcher of one request: its grammar, advanced by the tokens the request has kept.

    `end_ids`: the request's end tokens the grammar does not know (chat turn stops,
    stop_token_ids): allowed wherever the grammar allows its own end, and they end the request."""

    def __init__(self, matcher, vocab_size: int, eos_ids, end_ids=()):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = np.asarray(sorted(eos_ids), np.int64)
        self.end_ids = frozenset(int(t) for t in end_ids) - set(self.eos_ids.tolist())
        self._extra_ends = np.asarray(sorted(t for t in self.end_ids if 0 <= t < vocab_size), np.int64)

    def valid_drafts(self, drafts: list) -> list:
        """The longest prefix of `drafts` the grammar allows from here (a forbidden draft ends the draft)."""
        if not drafts:
            return drafts
        return list(drafts[:self.matcher.validate_tokens(list(drafts))])

    def accept(self, tokens: list) -> None:
        """Advance past the tokens the request kept this step. A token that ends the request outside the
        grammar (a turn stop) stops here: nothing follows it."""
        for token in tokens:
            if token in self.end_ids:
                return
            if not self.matcher.consume_token(int(token)):
                raise ValueError(f"guided decoding: token {token} does not match the grammar "
                                 f"({self.matcher.get_error().splitlines()[0]})")

    def finish_rows(self, allowed: np.ndarray) -> None:
        """Rows where the grammar is complete also allow the request's own end tokens; a row with nothing
        allowed (drafts past the grammar's end) allows the end tokens only."""
        ends = allowed[:, self.eos_ids].any(axis=1) if len(self.eos_ids) else np.zeros(len(allowed), bool)
        empty = ~allowed.any(axis=1)
        if empty.any():
            allowed[np.ix_(empty, self.eos_ids)] = True
            ends |= empty
        if len(self._extra_ends) and ends.any():
            allowed[np.ix_(ends, self._extra_ends)] = True


class StepMasks:
    """The masks of one step's constrained rows, being computed while the model runs."""

    def __init__(self, future, work: list):
        self._future = future
        self._work = work

    @classmethod
    def start(cls, batch) -> Optional["StepMasks"]:
        """None when no request of `batch` samples under a grammar (the free path: nothing to do)."""
        work = [(i, s.request.grammar, list(s.draft_token_ids)) for i, s in enumerate(batch.requests)
                if s.samples and s.request.grammar is not None]
        if not work:
            return None
        pool, executor = _workers()
        return cls(pool.submit(_compute, executor, work), work)

    def result(self) -> dict:
        """{batch index: bool [1 + drafts, vocab], True where the grammar bans the token}. Should
        llguidance fail, the step's constrained requests get every token banned, so each fails alone
        (sampler: every token is banned) and the engine and the free requests go on."""
        try:
            return self._future.result()
        except Exception:
            logger.exception("guided decoding: computing the token masks failed")
            return {i: np.ones((1 + len(drafts), state.vocab_size), bool) for i, state, drafts in self._work}


def _compute(executor, work: list) -> dict:
    from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

    vocab = work[0][1].vocab_size
    firsts = np.cumsum([0] + [1 + len(drafts) for _, _, drafts in work])
    # Rows llguidance does not write (past a draft that ends the grammar) stay 0: nothing allowed.
    bits = np.zeros((int(firsts[-1]), (vocab + 31) // 32), np.int32)
    plain = [(state.matcher, int(first)) for (_, state, drafts), first in zip(work, firsts) if not drafts]
    drafted = [(state.matcher, int(first), drafts) for (_, state, drafts), first in zip(work, firsts) if drafts]
    if plain:
        fill_next_token_bitmask_par(executor, plain, bits)
    if drafted:  # llguidance takes only non-empty draft lists here
        fill_next_token_bitmask_par_with_draft_tokens(executor, drafted, bits)
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)
    for (i, state, drafts), first in zip(work, firsts):
        state.finish_rows(allowed[first:first + 1 + len(drafts)])
    banned = ~allowed
    return {i: banned[first:first + 1 + len(drafts)] for (i, _, drafts), first in zip(work, firsts)}
