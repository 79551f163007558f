"""The engine's periodic status line, measured over the time the engine was busy.

A burst starts with the first step after the engine was idle and ends with the step after which no
request is left. Status lines (every FD_LOG_INTERVAL seconds while busy) report generation speed
over the busy part of the interval only, so a burst at 1760 tok/s followed by idle minutes is not
reported as 0.7 tok/s; the end of a burst gets one summary line.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional


class ActivityLog:
    def __init__(self, interval_s: float, logger: logging.Logger, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.logger = logger
        self.clock = clock
        self._burst_start: Optional[float] = None
        self._burst_tokens = 0
        self._burst_steps = 0
        self._burst_peak_running = 0
        self._interval_start = 0.0
        self._interval_tokens = 0

    def step_started(self) -> None:
        """Call before a step that has work; opens a burst if the engine was idle."""
        if self._burst_start is None:
            now = self.clock()
            self._burst_start = self._interval_start = now
            self._burst_tokens = self._burst_steps = self._burst_peak_running = self._interval_tokens = 0

    def step_finished(self, new_tokens: int, stats: Callable[[], dict], busy: bool) -> None:
        """Call after the step; `stats()` is read only when a line is written."""
        if self.interval_s <= 0 or self._burst_start is None:
            return
        now = self.clock()
        self._burst_tokens += new_tokens
        self._burst_steps += 1
        self._interval_tokens += new_tokens
        s = None
        if now - self._interval_start >= self.interval_s:
            s = stats()
            self._burst_peak_running = max(self._burst_peak_running, s["num_requests_running"])
            self.logger.info(
                "running=%d waiting=%d free_pages=%d/%d per_head=%s swa_recycled=%d preemptions=%d gen_tok/s=%.1f%s",
                s["num_requests_running"], s["num_requests_waiting"], s["kv_pages_free"], s["kv_pages_total"],
                s["kv_pages_free_per_head"], s["swa_pages_recycled_total"], s["num_preemptions_total"],
                self._interval_tokens / (now - self._interval_start), _spec_decode_summary(s))
            self._interval_start, self._interval_tokens = now, 0
        if not busy:
            s = s or stats()
            elapsed = max(now - self._burst_start, 1e-9)
            self.logger.info("burst ended: %d tokens generated in %.1f s (%.1f tok/s) over %d steps; "
                             "free_pages=%d/%d preemptions=%d%s", self._burst_tokens, elapsed,
                             self._burst_tokens / elapsed, self._burst_steps, s["kv_pages_free"],
                             s["kv_pages_total"], s["num_preemptions_total"], _spec_decode_summary(s))
            self._burst_start = None


def _spec_decode_summary(s: dict) -> str:
    """Speculation's share of the line (engine totals so far), empty when it is off."""
    if "spec_decode_num_draft_tokens_total" not in s:
        return ""
    return (f" spec_accepted={s['spec_decode_num_accepted_tokens_total']}/{s['spec_decode_num_draft_tokens_total']}"
            f" ({s['spec_decode_draft_acceptance_rate']:.0%}) tokens/verify_step="
            f"{s['spec_decode_mean_accepted_length']:.2f}")
