"""The status line reports speed over the busy time only, and a burst's end gets one line."""

from __future__ import annotations

import logging

from fastdeploy.engine.activity_log import ActivityLog

STATS = dict(num_requests_running=3, num_requests_waiting=0, kv_pages_free=90, kv_pages_total=120,
             kv_pages_free_per_head=[30, 20, 20, 20], swa_pages_recycled_total=7, num_preemptions_total=0)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _burst(log: ActivityLog, clock: Clock, steps: int, tokens_per_step: int, step_s: float) -> None:
    for i in range(steps):
        log.step_started()
        clock.now += step_s
        log.step_finished(tokens_per_step, lambda: STATS, busy=i < steps - 1)


def test_speed_after_a_long_idle_gap_is_measured_over_the_burst_not_the_gap(caplog):
    clock = Clock()
    log = ActivityLog(10, logging.getLogger("test.activity"), clock)
    caplog.set_level(logging.INFO, logger="test.activity")
    _burst(log, clock, steps=100, tokens_per_step=8, step_s=0.01)  # 800 tokens in 1 s
    clock.now += 3600  # an hour idle: no step, so no line and no dilution
    _burst(log, clock, steps=1100, tokens_per_step=16, step_s=0.01)  # 1600 tok/s for 11 s
    lines = [r.getMessage() for r in caplog.records]
    status = [line for line in lines if line.startswith("running=")]
    assert len(status) == 1
    assert "gen_tok/s=1600.0" in status[0]
    ended = [line for line in lines if line.startswith("burst ended")]
    assert len(ended) == 2
    assert "800 tokens generated in 1.0 s (800.0 tok/s) over 100 steps" in ended[0]
    assert "17600 tokens generated in 11.0 s (1600.0 tok/s) over 1100 steps" in ended[1]


def test_interval_zero_logs_nothing(caplog):
    clock = Clock()
    log = ActivityLog(0, logging.getLogger("test.activity.off"), clock)
    caplog.set_level(logging.INFO, logger="test.activity.off")
    _burst(log, clock, steps=2000, tokens_per_step=4, step_s=0.01)
    assert not caplog.records
