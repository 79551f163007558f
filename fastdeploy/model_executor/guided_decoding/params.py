"""GuidedDecodingParams: what a request's output must match, in upstream FastDeploy's shape.

One of `json` (a JSON schema, as a dict or its text), `regex`, `choice` (a list of strings),
`grammar` (Lark, or llama.cpp's GBNF), `json_object` (any JSON object) is set. Plain data with no
grammar-engine import, so the API server, SamplingParams and the engine can all carry it; the
grammar text itself is built and checked by guided_decoding/backend.py.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import List, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# A choice list or grammar text this large is a mistake, not a constraint (and costs compile time).
MAX_CHOICES = 1024
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass(frozen=True)
class GuidedDecodingParams:
    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None  # upstream's field; not supported here (rejected by validate)

    def kind(self) -> str:
        """The one constraint set ('json', 'regex', ...); raises ValueError unless exactly one is."""
        set_ = [k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(set_) != 1:
            raise ValueError("guided_decoding: set exactly one of json, regex, choice, grammar, json_object"
                             + (f" (got {', '.join(set_)})" if set_ else ""))
        return set_[0]

    def validate(self) -> None:
        """Shape checks that need no grammar engine; ValueError names the field."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "structural_tag":
            raise ValueError("guided_decoding: structural_tag is not supported (use json, regex, choice or grammar)")
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError(f"guided_json must be a JSON schema (an object or its JSON text), got {type(value).__name__}")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"guided_{kind} must be a non-empty string")
        if kind == "json_object" and value is not True:
            raise ValueError("guided_json_object must be true or unset")
        if kind == "choice" and not (isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_CHOICES
                                     and all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"guided_choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        if len(self.text()) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"guided_{kind} is longer than {MAX_GRAMMAR_CHARS} characters")

    def text(self) -> str:
        """The constraint as one string: the compiled-grammar cache key (with the kind)."""
        value = getattr(self, self.kind())
        if isinstance(value, str):
            return value
        return _json.dumps(value, separators=(",", ":"))  # key order kept: it orders the output
