"""The scheduler driver: the real ResourceManagerV1 and KV cache manager, run without a model.

One loop for everything that asks the scheduler what it would do: the serving simulator (each step timed
by a roofline step model, benchmarks/serving_sim), the dry A/B of benchmarks/bench_recycling.py (a step is
one unit of time) and the scheduler tests (fake_step). Requests arrive at their times; a step is schedule()
-> `step_time(batch)` -> update_from_output() with a fixed token (ignore_eos, so every request produces
exactly its output length). Nothing about admission, chunking, recycling or preemption is modelled here:
it is the engine's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from fastdeploy.engine.request import Request, SamplingParams

SAMPLED_TOKEN = 7  # any id but the model's EOS; ignore_eos makes lengths fixed anyway


def fake_step(rm, sample: Optional[Callable] = None, check: bool = False):
    """One step: schedule, then a 'model' that samples `sample(request)` (default SAMPLED_TOKEN) wherever a
    chunk ends a request; the batch. With `check`, check_integrity() after it."""
    batch = rm.schedule()
    rm.update_from_output(batch, [(SAMPLED_TOKEN if sample is None else sample(s.request)) if s.samples else None
                                  for s in batch.requests])
    if check:
        rm.check_integrity()
    return batch


@dataclass
class Run:
    """What a driven workload did, per request (in arrival order) and per step."""

    first_token: list
    done: list
    steps: int = 0
    peak_running: int = 0
    peak_pages_used: int = 0
    pages_time: float = 0.0     # integral of pages in use over time
    running_time: float = 0.0   # integral of running requests over time
    recomputed: int = 0         # tokens computed again below a request's high water (after a preemption)
    computed: int = 0           # every token of every scheduled chunk
    saturated_until: float = 0.0  # last time a request was waiting or not yet arrived
    series: dict = field(default_factory=lambda: {"t": [], "running": [], "pages_used": []})

    @property
    def makespan(self) -> float:
        return max(self.done)


def drive(rm, requests: list, step_time: Callable = lambda batch: 1.0, on_step: Optional[Callable] = None,
          eos: int = 2, check: bool = False) -> Run:
    """Run `requests` (serving_sim.workload.SimRequest: index, arrival, input_len, output_len; by arrival) to
    completion on a clock advanced by `step_time(batch)` after each schedule(); `on_step(batch, now)` sees
    each step before its outputs are applied. Raises if the scheduler stalls or pages stay held."""
    cm = rm.cache_manager
    n, total_pages = len(requests), cm.num_total_pages
    run = Run([math.nan] * n, [math.nan] * n)
    index, high_water = {}, [0] * n
    now, nxt, finished = 0.0, 0, 0
    while finished < n:
        while nxt < n and requests[nxt].arrival <= now:
            r = requests[nxt]
            index[str(r.index)] = nxt
            rm.add_request(Request(str(r.index), [SAMPLED_TOKEN] * r.input_len,
                                   SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                   arrival_time=r.arrival, eos_token_id=eos))
            nxt += 1
        if not rm.has_unfinished_requests():
            now = requests[nxt].arrival  # idle until the next arrival (nothing held meanwhile)
            continue
        batch = rm.schedule()
        n_run, n_used = len(rm.running), total_pages - cm.num_free_pages  # the step's pages, just allocated
        if not batch.requests:
            if nxt == n:
                raise RuntimeError(f"scheduler scheduled nothing with {n_run} running and {len(rm.waiting)} "
                                   f"waiting requests: it would never finish")
            wait = max(0.0, requests[nxt].arrival - now)
            run.pages_time, run.running_time, now = run.pages_time + n_used * wait, run.running_time + n_run * wait, \
                now + wait
            continue
        if rm.waiting or nxt < n:
            run.saturated_until = now
        if on_step is not None:
            on_step(batch, now)
        dt = step_time(batch)
        now += dt
        run.steps += 1
        run.pages_time += n_used * dt
        run.running_time += n_run * dt
        for s in batch.requests:
            run.computed += s.num_tokens
            i, end = index[s.request.request_id], s.start + s.num_tokens
            run.recomputed += max(0, min(end, high_water[i]) - s.start)
            high_water[i] = max(high_water[i], end)
        # update_from_output reads a token only where the chunk samples, so one constant list serves.
        for req in rm.update_from_output(batch, [SAMPLED_TOKEN] * len(batch.requests)):
            i = index[req.request_id]
            if math.isnan(run.first_token[i]):
                run.first_token[i] = now
            if req.is_finished:
                run.done[i] = now
                finished += 1
        if check:
            rm.check_integrity()
        run.peak_running, run.peak_pages_used = max(run.peak_running, n_run), max(run.peak_pages_used, n_used)
        for key, value in (("t", now), ("running", n_run), ("pages_used", n_used)):
            run.series[key].append(value)
    if cm.num_free_pages != total_pages:
        raise AssertionError(f"{total_pages - cm.num_free_pages} pages still held after every request finished")
    cm.check_integrity()
    return run
