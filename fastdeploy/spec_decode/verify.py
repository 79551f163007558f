"""Verification: which drafts a request accepts, given the model's rows for its piece.

The piece is the request's last token followed by drafts d_1..d_K; row j of the model's output
is the distribution of the token after d_j (row 0: after the last token). Row j is sampled exactly
as plain decoding would sample that position — same adjusted distribution (temperature, top-k/p,
penalties and min_tokens over the output so far, accepted drafts included), same per-request
generator, in the same order — and d_{j+1} is accepted iff the sampled token equals it. The first
token that differs (or, with every draft accepted, the token of the last row) ends the run.

For a draft of one candidate this is the standard speculative sampling rule: d is accepted with
probability p(d), and on rejection the token is distributed as p with d removed, renormalised.
It also means a request's tokens do not depend on its drafts at all: greedy or seeded, the output
with speculation is token for token the output without it (the rows have the bits of one-by-one
decoding, docs/op_contract.md), whatever drafts were proposed and whichever batch it ran in.
"""

from __future__ import annotations

from typing import Callable


def accept_drafts(drafts, sample_row: Callable[[int, list], tuple]) -> tuple:
    """(tokens, logprobs): the accepted drafts, then the token sampled where the first draft failed
    (or after the last). `sample_row(j, accepted)` -> (token, logprobs or None) samples row j
    given the tokens accepted before it."""
    tokens, logprobs = [], []
    for j in range(len(drafts) + 1):
        token, lp = sample_row(j, tokens)
        tokens.append(token)
        logprobs.append(lp)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens, logprobs


class AcceptedHistory:
    """A request as its sampler sees it at row j of a piece: the output so far plus the drafts
    accepted before that row (penalties and min_tokens read it). Shares the request's generator."""

    def __init__(self, request, accepted: list):
        self.request_id = request.request_id
        self.sampling_params = request.sampling_params
        self.prompt_token_ids = request.prompt_token_ids
        self.output_token_ids = request.output_token_ids + accepted if accepted else request.output_token_ids
        self.generator = request.generator
