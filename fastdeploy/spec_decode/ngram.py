"""Prompt-lookup (n-gram) drafts: the request's own prompt and output are the draft model.

For the last n tokens of a request (n from max_ngram_size down to min_ngram_size, longest first),
find the latest earlier place where those n tokens occurred and propose the tokens that followed
them there. Code edits, extraction and reformatted lists repeat long runs of their prompt, so the
model's next tokens are often exactly those.

Each request keeps an index (on `request.draft_state`): every n-gram of its tokens -> the position
just after its latest occurrence, extended by the tokens added since the last call, so a lookup is
O(1) whatever the context length.
"""

from __future__ import annotations


class NgramProposer:
    def __init__(self, min_ngram_size: int, max_ngram_size: int):
        self.min_n = min_ngram_size
        self.max_n = max_ngram_size

    def propose(self, request, max_drafts: int) -> list:
        """Up to `max_drafts` draft tokens to follow `request`'s tokens; [] when nothing matches."""
        length = request.num_tokens
        if max_drafts < 1 or length <= self.min_n:
            return []
        index, indexed = request.draft_state or ({}, 0)
        lo = max(0, indexed - self.max_n)
        tokens = request.token_ids(lo, length)
        # Index the n-grams that end before the last token (their continuation is known); the
        # suffix n-grams themselves are the keys looked up, so they must not find their own end.
        for end in range(max(indexed, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index[tuple(tokens[end - n - lo:end - lo])] = end
        request.draft_state = (index, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            follows = index.get(tuple(tokens[length - n - lo:]))
            if follows is not None:
                return request.token_ids(follows, min(length, follows + max_drafts))
        return []
