"""A flag whose value is a JSON object (`--head-wise-swa-config`, `--speculative-config`): given as a dict
or as its JSON text, it is read the same way and bad text is one line naming the flag."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: Any, where: str, expected: str) -> Any:
    """`value` with JSON text decoded; a ValueError naming `where` if it is neither JSON nor an object
    (`expected` says what the object holds)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg} at character {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object {expected}, got {type(value).__name__}")
    return value
