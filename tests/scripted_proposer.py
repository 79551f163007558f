"""A draft proposer the tests steer: it knows the tokens the model will produce and drafts the next
`num_right(request, k)` of them correctly, then wrong ones. Injected into the real scheduler in
place of the n-gram proposer (`ResourceManagerV1(cfg, proposer=...)` or
`engine.scheduler.proposer = ...`), it forces any acceptance pattern: always wrong, always right,
right then wrong exactly at a page boundary or a window edge."""

from __future__ import annotations


class ScriptedProposer:
    def __init__(self, truth, num_right, wrong):
        self.truth = truth          # (request, output index) -> the token the model will sample there
        self.num_right = num_right  # (request, k) -> how many leading drafts are right (0..k)
        self.wrong = wrong          # token -> a token that is not it
        self.proposed = 0

    def propose(self, request, max_drafts: int) -> list:
        n = len(request.output_token_ids)
        right = max(0, min(max_drafts, self.num_right(request, max_drafts)))
        drafts = [self.truth(request, n + j) for j in range(right)]
        drafts += [self.wrong(self.truth(request, n + j)) for j in range(right, max_drafts)]
        self.proposed += len(drafts)
        return drafts


def oracle_truth(oracle: dict):
    """truth() of a model whose outputs per prompt (tuple of ids) are known from a run without drafts."""
    return lambda request, i: oracle[tuple(request.prompt_token_ids)][i]


def always_right(request, k):
    return k


def always_wrong(request, k):
    return 0


def boundary_hugging(block_size: int, windows=(128,)):
    """Accept up to a page boundary or a sliding window's kill point when one is within reach, so the
    rejected drafts sit just past it (their pages must go back; the window must not move); else a
    number that cycles through 0..k. `windows`: the sliding windows whose kill points count (a block of
    window W dies when the processed tokens reach (b + 1) * block_size + W - 1; the tiny preset's 128)."""
    def at_edge(end: int) -> bool:
        return any((end - w + 1) % block_size in (0, 1) for w in windows) or end % block_size in (0, 1)

    def num_right(request, k):
        n = request.num_computed_tokens + 1  # KV kept after the step if m drafts are accepted: n + m
        for m in range(k + 1):
            if at_edge(n + m):
                return m
        return (n * 7) % (k + 1)
    return num_right
