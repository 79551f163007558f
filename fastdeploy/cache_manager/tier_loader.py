"""Loads from the prefix cache's lower tiers (host memory, disk), run off the engine loop.

A prefix hit whose pages only the host or disk tier holds gets new pool pages at admission
(PrefixCacheManager.load_prefix); the copies into them -- a file read for a disk entry, then a memory copy
(or a decode, --swap-space-dtype) -- run on one worker thread while the engine runs other requests' steps.
numpy copies and file reads release the GIL, so on a CPU they overlap the model's step.

Division of labour, so no lock is needed: the worker only reads the entries its load pinned (nothing stores
into them) and writes the pool pages its load holds (nothing else reads or writes them: they are referenced
by the load, so never evicted, and no lookup may read them, PrefixCache.reads_loading). Every change of
bookkeeping -- the tier's entries, the trie, counters, deleting a corrupt file -- is made by the engine loop
when it ends the load (PrefixCacheManager.end_load), after the worker has said it is done.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Optional

logger = logging.getLogger("fastdeploy.cache")

_ids = itertools.count()


class TierLoad:
    """One admission's copies: lower-tier entries into the pool pages that will hold them.

    The load is the owner of those pages' references while it runs (a request may come and go meanwhile);
    `request_id` is the request that waits for it in the loading state, if one was admitted.
    """

    def __init__(self, entries: list, paths: list):
        self.name = f"<tier load {next(_ids)}>"
        self.entries = entries      # the tier's entries (host memory rows, or file handles)
        self.paths = paths          # per entry: its file (a disk entry) or None (a host memory entry)
        self.pages: list = []       # per entry: the pool page it is copied into (rank 0)
        self.request_id = None
        self.bad: list = []         # indexes of entries whose file was truncated or corrupt: pages not written
        self.error: Optional[str] = None  # an unexpected failure: no page of the load counts as written
        self.read_seconds = 0.0     # reading files (worker)
        self.copy_seconds = 0.0     # copying (or decoding) into the pool (worker)
        self.started = time.perf_counter()
        self.done = threading.Event()

    @property
    def ok(self) -> bool:
        return not self.bad and self.error is None

    def unwritten(self) -> list:
        """Indexes of the entries whose pool page does not hold their bytes."""
        return list(range(len(self.entries))) if self.error is not None else list(self.bad)

    def __repr__(self) -> str:
        return self.name


class TierLoader:
    """One worker thread running loads in submission order; the engine loop polls for the finished ones."""

    def __init__(self, tier):
        self.tier = tier  # tier.copy_in(load) does the work (looked up per load, so a test can gate it)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: list = []  # submitted and not yet handed back by finished(), oldest first
        self._thread: Optional[threading.Thread] = None

    def submit(self, load: TierLoad) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="fd-tier-loader", daemon=True)
            self._thread.start()
        self._in_flight.append(load)
        self._queue.put(load)

    def finished(self, wait: float = 0.0) -> list:
        """The loads the worker has finished, oldest first (each handed back once); with `wait`, first wait
        up to that many seconds for the oldest one in flight (loads finish in order)."""
        if wait and self._in_flight:
            self._in_flight[0].done.wait(wait)
        done = [load for load in self._in_flight if load.done.is_set()]
        if done:
            self._in_flight = [load for load in self._in_flight if not load.done.is_set()]
        return done

    def copy_here(self, load: TierLoad) -> None:
        """Run `load` in the caller's thread (the engine loop: a copy too short to be worth a wait), as the
        worker would: failures recorded on the load, never raised."""
        self._copy(load)

    def close(self) -> list:
        """Let every submitted load finish, stop the worker; returns the loads not yet handed back."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._thread = None
        done, self._in_flight = self._in_flight, []
        return done

    def _run(self) -> None:
        while True:
            load = self._queue.get()
            if load is None:
                return
            self._copy(load)

    def _copy(self, load: TierLoad) -> None:
        try:
            self.tier.copy_in(load)
        except Exception as exc:  # the request recomputes; one bad load never stops the engine
            load.error = f"{type(exc).__name__}: {exc}"
            logger.warning("loading %d page(s) from the lower tiers failed (%s); they are recomputed",
                           len(load.entries), load.error)
        finally:
            load.done.set()
