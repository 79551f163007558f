"""Stop strings: where a request's text ends, and how much of it a client may see so far.

A stop string can arrive split across tokens, so the search for it reaches back over the text
already checked by up to (longest stop string - 1) characters. While a request runs, the tail of
its text that could still grow into a stop string is held back, so a streaming client never sees
text that the final answer cuts off. The stop string itself is not part of the output (OpenAI).
"""

from __future__ import annotations

from typing import Optional, Sequence


def find_stop(text: str, stops: Sequence[str], checked: int) -> Optional[int]:
    """Index where the earliest stop string in `text` begins, among those that end past `checked`;
    or None.

    `checked`: length of the prefix of `text` seen by an earlier call (searched with no match, or
    produced before min_tokens allowed a stop).
    """
    found = [i for i in (text.find(s, max(0, checked - len(s) + 1)) for s in stops) if i >= 0]
    return min(found) if found else None


def releasable(text: str, stops: Sequence[str]) -> str:
    """`text` without its longest tail that is the beginning of some stop string."""
    longest = min(len(text), max(len(s) for s in stops) - 1)
    firsts = {s[0] for s in stops}
    # Earliest start first, so the first hit is the longest tail; a tail must begin like a stop
    # string, which rules out almost every position with one set lookup.
    for start in range(len(text) - longest, len(text)):
        if text[start] in firsts:
            tail = text[start:]
            if any(s.startswith(tail) for s in stops):
                return text[:start]
    return text
