"""Calibration and held-out text that installs everywhere: CPython's `pydoc_data.topics`.

The topics (the help() pages of the language reference, ~465k characters of English prose with
code) are joined in sorted-key order; the first 80% of the characters calibrate the head finder,
the rest is held out for the evaluation, so a config is never judged on the text that chose it.
"""

from __future__ import annotations

CALIBRATION_SHARE = 0.8


def _all_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


def calibration_text() -> str:
    text = _all_text()
    return text[:int(len(text) * CALIBRATION_SHARE)]


def held_out_text() -> str:
    text = _all_text()
    return text[int(len(text) * CALIBRATION_SHARE):]


def token_segments(tokenizer, text: str, segment_tokens: int, num_segments: int) -> list:
    """`num_segments` consecutive, non-overlapping token-id lists of `segment_tokens` each."""
    # Tokenize in pieces of ~8 tokens' worth of characters per token needed: enough text, not all of it.
    need = segment_tokens * num_segments
    chars = need * 6
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) >= need or chars >= len(text):
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the text holds {len(ids)} tokens, fewer than {num_segments} x {segment_tokens}")
    return [ids[i * segment_tokens:(i + 1) * segment_tokens] for i in range(num_segments)]
