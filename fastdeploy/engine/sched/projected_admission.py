"""Projected admission (FD_ADMISSION_POLICY=projected, the default): page curves of running requests.

Every running request is guaranteed one token per step, so it finishes within L steps, where
L = (tokens to compute at one per step). Its pages over those steps are bounded by a curve U(t):
in decode (one position per step, exactly) a linear bound of pages_per_rank(n + t, 1), capped at its
last step's need; while it still prefills (it may run ahead of one token per step) that last step's
need, flat. The invariant kept: the running requests' U(t) sum to at most the cache at every future
step t. A step moves every curve at least one step left and never up, so the invariant survives it
and no running request ever has to be preempted. Admission adds the newcomer's curve only if the sum
still fits at every step. A prefill chunk beyond its curve takes the difference from the pages no
curve claims this step (the slack), or shrinks; a newcomer also needs the slack for its whole first
chunk.

Page counts here are in units of pages x block_size, so the curves stay integer.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional

from functools import lru_cache

from fastdeploy.engine.request import Request
from fastdeploy.engine.sched.admission import AdmissionPolicy


class ProjectedAdmission(AdmissionPolicy):
    """Admit while the running requests' page curves, the newcomer's added, fit every future step."""

    def __init__(self, fd_config, kv, running: list):
        super().__init__(fd_config, kv, running)
        self.budget = fd_config.scheduler_config.max_num_batched_tokens
        self.max_running = self.budget  # every running request must get a token each step (the curves count on it)
        self.curves = PageCurves(self.layout, self.capacity, running)

    def new_step(self) -> None:
        self.curves.new_step()

    def admissions_with(self, chunk: int, waiting, seats: int) -> int:
        return self.curves.admissions_with(chunk, self.budget, waiting, seats)

    def running_chunk(self, request: Request, num_new: int, num_behind: int) -> int:
        """The chunk's pages beyond its own curve's claim come from the slack, keeping one token of budget
        for each request behind it. A guard for the curves' premise (one token per running request per
        step): while admission keeps the running list in order no request runs behind a prefilling one,
        so num_behind is 0 here (the proof is in docs/mutation_testing.md), but a change to admission must
        not starve one."""
        num_new = max(1, num_new - num_behind)
        if num_new == 1:
            return 1
        n = request.num_computed_tokens
        own = self.curves.claim(self.curves.curve(request, n))
        return self.curves.take_transient(n, num_new, own)

    def admit(self, request: Request, start: int, step_chunk: int) -> Optional[list]:
        return self.curves.admit(request, start, step_chunk)

    def first_chunk(self, request: Request, num_new: int, claim) -> int:
        if num_new <= 1:
            return num_new
        return self.curves.take_transient(request.num_computed_tokens, num_new, claim)

    def draft_limit(self):
        """A request drafts only while the curves still fit with its curve moved as far as its drafts could
        take it (PageCurves.drafts_within)."""
        curves = self.curves.running_curves()
        return lambda request, num: self.curves.drafts_within(curves, self.running.index(request), num)

    def check(self) -> None:
        if not self.curves.fit(self.curves.running_curves()):
            raise AssertionError("projected admission: the running requests' page curves overflow the cache "
                                 "at some future step")


class PageCurves:
    """The curves of one scheduler's running requests and this step's unclaimed pages (the slack)."""

    def __init__(self, layout, capacity: list, running: list):
        self.layout = layout
        self.block_size = layout.block_size
        self.capacity = capacity  # pages per rank
        self.running = running  # the scheduler's running list, read where the slack is first needed
        self.head_counts = layout.rank_head_counts()  # per rank (keeping slots, recycling slots of each type...)
        # One sliding type: a curve's recycling bound y is one number and a rank's claim is f * x + r * y.
        # None or several: y is one bound per type and the claim f * x + sum_k r_k * y_k.
        self.one_type = len(self.head_counts[0]) == 2
        self._last_step = lru_cache(maxsize=4096)(self._bounds_at)
        self.new_step()

    def _bounds_at(self, last: int) -> tuple:
        """(recycling bound y, exact pages x bs of the last step, rounding) of a request whose last
        one-token step is at position `last`: what its curve needs besides its progress."""
        bs = self.block_size
        peak = bs * self.layout.pages_needed(last, 1)[0]  # a slot keeping every page: the table's length
        bounds = self.layout.recycling_bounds(last)
        return bounds[0] if self.one_type else bounds, peak, last + bs - peak

    def new_step(self) -> None:
        """Forget the last step's slack and curves; the first reader this step recomputes them."""
        self.slack: Optional[list] = None  # unclaimed pages left this step, per rank (x block_size)
        self.curves: Optional[list] = None  # the running requests' curves at this step's start
        # Whether a newcomer's curve fits beside the running ones alone, by curve: the chunk rule's dry runs
        # and the admission that follows ask it of the same queue head in one step.
        self._fits_beside_running: dict = {}

    def curve(self, request: Request, n: int) -> tuple:
        """(L, x, y, decoding, rounding) of a request with `n` tokens computed. On a rank with f keeping
        and r recycling heads its U(t), t < L, is f * min(x + t, x + L - 1 - rounding) + r * y when
        decoding (the linear bound, capped at the exact table length of its last step), else
        f * x + r * y with x that exact last-step value. With several sliding types y is a tuple, one
        bound per type, and r * y stands for sum_k r_k * y_k."""
        total = request.num_tokens + request.max_new_tokens
        y, peak, rounding = self._last_step(total - 2)  # the last one-token step (the last token is never cached)
        if n == request.num_tokens - 1:  # decoding: exactly one position per step from here
            return total - 1 - n, n + self.block_size, y, True, rounding
        return total - 1 - n, peak, y, False, 0

    def claim(self, curve: tuple) -> list:
        """U(0) per rank (x block_size): the pages the curve claims now."""
        steps, x, y, _, rounding = curve
        x = min(x, x + steps - 1 - rounding)
        if self.one_type:
            return [f * x + r * y for f, r in self.head_counts]
        return [c[0] * x + sum(r * yk for r, yk in zip(c[1:], y)) for c in self.head_counts]

    def unclaimed(self) -> list:
        """Pages (x bs, per rank) that no running request's curve claims now, less transients granted."""
        if self.slack is None:
            self.curves = self.running_curves()
            self._num_running_curves = len(self.curves)
            bs = self.block_size
            slack = [c * bs for c in self.capacity]
            for curve in self.curves:
                slack = [s - o for s, o in zip(slack, self.claim(curve))]
            self.slack = slack
        return self.slack

    def running_curves(self) -> list:
        return [self.curve(r, r.num_computed_tokens) for r in self.running]

    def admit(self, request: Request, start: int, max_chunk: int) -> Optional[list]:
        """The newcomer's U(0) if its curve fits beside the running ones now and at every future step;
        None if it must wait. On an idle cache it is always admitted (add_request checked its peak)."""
        curve = self.curve(request, start)
        own = self.claim(curve)
        slack = self.unclaimed()
        if self.running and not self._fits(curve, own, start, min(request.num_tokens - start, max_chunk),
                                           slack, self.curves):
            return None
        self.slack = [s - o for s, o in zip(slack, own)]
        self.curves.append(curve)
        return own

    def _fits(self, curve: tuple, own: list, start: int, first: int, slack: list, curves: list) -> bool:
        # Its first chunk must run whole now (so admitting more never squeezes prefill into tiny
        # chunks; later chunks find the same pages again once the SWA ones are recycled)...
        need = self.layout.pages_per_rank(start, first)
        if any(max(o, p * self.block_size) > s for o, p, s in zip(own, need, slack)):
            return False
        if len(curves) != self._num_running_curves:  # ...and its curve must fit beside the others'
            return self.fit(curves + [curve])  # (a list that already holds this step's newcomers)
        fits = self._fits_beside_running.get(curve)
        if fits is None:
            fits = self._fits_beside_running[curve] = self.fit(curves + [curve])
        return fits

    def admissions_with(self, max_chunk: int, budget: int, waiting, seats: int) -> int:
        """How many of `waiting`, in order and at most `seats`, `admit` would take at this step's start if
        every prefill chunk were at most `max_chunk` tokens: the running requests take their chunks (and
        their transients from the slack, as take_transient would) first. Changes nothing."""
        bs, slack, curves = self.block_size, list(self.unclaimed()), list(self.curves)
        for request in self.running:
            n = request.num_computed_tokens
            take = min(request.num_tokens - n, max_chunk, budget)
            budget -= take
            if take > 1:
                own = self.claim(self.curve(request, n))
                need = self.layout.pages_per_rank(n, take)
                slack = [s - min(s, max(0, p * bs - o)) for s, p, o in zip(slack, need, own)]
        count = 0
        for request in itertools.islice(waiting, seats):
            if budget <= 0:
                break
            curve = self.curve(request, 0)
            own = self.claim(curve)
            first = min(request.num_tokens, max_chunk)
            if (self.running or count) and not self._fits(curve, own, 0, first, slack, curves):
                break
            need = self.layout.pages_per_rank(0, first)
            slack = [s - max(o, p * bs) for s, o, p in zip(slack, own, need)]
            curves.append(curve)
            budget, count = budget - min(first, budget), count + 1
        return count

    def take_transient(self, n: int, num_new: int, own: list) -> int:
        """Largest chunk <= num_new whose pages beyond the request's own claim `own` (x bs, per rank)
        fit the slack; at least one token, which never exceeds `own`."""
        slack = self.unclaimed()
        bs = self.block_size
        limit = [(o + s) // bs for o, s in zip(own, slack)]
        num_new = max(1, self.layout.largest_chunk_within(n, num_new, limit))
        need = self.layout.pages_per_rank(n, num_new)
        self.slack = [s - max(0, p * bs - o) for s, p, o in zip(slack, need, own)]
        return num_new

    def drafts_within(self, curves: list, i: int, num_drafts: int) -> int:
        """Most of `num_drafts` draft tokens the decoding request of `curves[i]` may verify this step.

        Accepted, d drafts move its position d + 1 ahead instead of 1: its curve afterwards is the
        old one read d steps later (a decoding curve advances one position per step), which is
        higher at every future step. The drafts are allowed only while the curves still fit with
        curves[i] moved by d (it then covers any number accepted); curves[i] becomes that curve, so
        the next request that drafts in this step is checked beside it."""
        steps, x, y, decoding, rounding = curves[i]
        for d in range(min(num_drafts, steps - 1), 0, -1):
            moved = (steps - d, x + d, y, decoding, rounding)
            if self.fit(curves[:i] + [moved] + curves[i + 1:]):
                curves[i] = moved
                return d
        return 0

    def fit(self, curves: list, limits: Optional[list] = None) -> bool:
        """Whether the sum of the curves U(t) fits every rank at every future step.

        Between two request ends the sum only grows, so it is checked just before each end (t = L - 1),
        in closed form: the linear parts sum up, less what the decoding curves already capped at t have
        above their cap. A decoding curve is capped from t = D - 1 on, D = L - rounding; at t = L' - 1
        it lies L' - D above its cap when D < L'. Scanning the ends latest first, L' only falls, so a
        heap of the capped curves' D keeps that sum (count * L' - sum of D) in O(n log n)."""
        curves = sorted(curves, key=lambda c: c[0], reverse=True)
        if limits is None:
            limits = [c * self.block_size for c in self.capacity]
        one_type = self.one_type
        sum_x = decoding = 0
        sum_y = 0 if one_type else [0] * (len(self.head_counts[0]) - 1)
        capped, capped_count, capped_sum = [], 0, 0  # max-heap (negated) of D of the capped curves
        for i, (steps, x, y, dec, rounding) in enumerate(curves):
            sum_x += x
            if one_type:
                sum_y += y
            else:
                sum_y = [a + b for a, b in zip(sum_y, y)]
            if dec:
                decoding += 1
                if rounding:
                    heapq.heappush(capped, rounding - steps)
                    capped_count, capped_sum = capped_count + 1, capped_sum + steps - rounding
            if i + 1 < len(curves) and curves[i + 1][0] == steps:
                continue  # evaluate once per group of curves ending together
            while capped and -capped[0] >= steps:  # D >= L': no longer above its cap at t = L' - 1
                d = -heapq.heappop(capped)
                capped_count, capped_sum = capped_count - 1, capped_sum - d
            t = steps - 1
            above = capped_count * steps - capped_sum
            if one_type:
                for (f, r), limit in zip(self.head_counts, limits):
                    if f * (sum_x + decoding * t - above) + r * sum_y > limit:
                        return False
                continue
            for counts, limit in zip(self.head_counts, limits):
                if counts[0] * (sum_x + decoding * t - above) + sum(r * y for r, y in zip(counts[1:], sum_y)) > limit:
                    return False
        return True
