"""Engine side of prompt log-probs (SamplingParams.prompt_logprobs, vLLM's field).

Row r of a step that computes prompt position p of a request predicts the prompt's token p + 1; for
a request that asks, every such row of every prompt chunk is scored (the last prompt position is
the sampled row: it predicts the first output token, whose log-probs are the output's). Results are
stored by position in `Request.prompt_logprobs`, so a preempted request that recomputes its prompt
writes the same entries again instead of appending. A request that asks skips prefix-cache hits
(resource_manager_v1._admit): cached positions would never be computed, so never scored.
"""

from __future__ import annotations

import numpy as np


def _segments(scheduled: list, first_rows=None) -> list:
    """(request, first scored position, rows, first row) of each request that scores prompt rows now;
    `scheduled` in the step's row order, `first_rows` each one's first token row (None: not needed)."""
    out = []
    for i, s in enumerate(scheduled):
        request = s.request
        if request.sampling_params.prompt_logprobs is None:
            continue
        end = min(s.start + s.num_tokens, request.num_prompt_tokens - 1)
        if end > s.start:
            out.append((request, s.start, end - s.start, None if first_rows is None else first_rows[i]))
    return out


def attach_prompt_rows(step, scheduled: list, first_rows: list) -> None:
    """Fill the StepInput's prompt_rows / prompt_targets / prompt_top_k for the requests that ask
    (`scheduled` in the step's row order, `first_rows` the first token row of each)."""
    segments = _segments(scheduled, first_rows)
    if not segments:
        return
    rows, targets, k = [], [], 0
    for request, first, n, row in segments:
        rows.append(np.arange(row, row + n, dtype=np.int64))
        targets.append(np.asarray(request.prompt_token_ids[first + 1:first + 1 + n], np.int64))
        k = max(k, request.sampling_params.prompt_logprobs)
    step.prompt_rows, step.prompt_targets, step.prompt_top_k = np.concatenate(rows), np.concatenate(targets), k


def store_prompt_logprobs(scheduled: list, prompt_logprobs) -> None:
    """Write the step's scored rows into each request's prompt_logprobs, by position (`scheduled` in the
    order attach_prompt_rows was given)."""
    if prompt_logprobs is None:
        return
    chosen, top_ids, top_lps = prompt_logprobs
    at = 0
    for request, first, n, _ in _segments(scheduled):
        k = request.sampling_params.prompt_logprobs
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None] * request.num_prompt_tokens
        for j in range(n):
            entry = {int(t): float(lp) for t, lp in zip(top_ids[at + j, :k], top_lps[at + j, :k])}
            entry[request.prompt_token_ids[first + 1 + j]] = float(chosen[at + j])
            request.prompt_logprobs[first + 1 + j] = entry
        at += n
