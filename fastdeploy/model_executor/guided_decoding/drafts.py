"""Speculation under a grammar: a proposer's drafts are cut at the first token the grammar forbids.

Such a draft could never be accepted (its row's mask bans it), so it would only cost a row; more to
the point, every draft left is a token the matcher can walk, so the masks of all the piece's rows
are computed before the model runs (masks.py).
"""

from __future__ import annotations


class GrammarBoundProposer:
    def __init__(self, proposer):
        self.proposer = proposer

    def propose(self, request, max_drafts: int) -> list:
        drafts = self.proposer.propose(request, max_drafts)
        grammar = request.grammar
        return grammar.valid_drafts(drafts) if grammar is not None and drafts else drafts
