"""SpeculativeConfig: `--speculative-config` / `LLM(speculative_config=...)`, parsed and checked once.

Field names follow upstream: FastDeploy's `method`, `num_speculative_tokens`, `max_ngram_size`,
`min_ngram_size`; vLLM's `prompt_lookup_max` / `prompt_lookup_min` are accepted as the same two
n-gram sizes, and vLLM's `disable_by_batch_size` turns speculation off in steps with more running
requests than that (a batched step is compute-bound: drafts then cost real work, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fastdeploy.json_flag import json_object

METHODS = ("ngram",)
# Upstream FastDeploy's older spelling of the n-gram method.
METHOD_ALIASES = {"ngram_match": "ngram"}
# vLLM's names for the n-gram sizes -> ours (FastDeploy's).
FIELD_ALIASES = {"prompt_lookup_max": "max_ngram_size", "prompt_lookup_min": "min_ngram_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4     # K: most draft tokens verified in one step
    max_ngram_size: int = 4             # the longest suffix n-gram looked up first ...
    min_ngram_size: int = 2             # ... down to this one
    disable_by_batch_size: Optional[int] = 4  # no drafts in a step with more running requests; None: never off

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """None / {} / "" -> None (off); a dict or its JSON text -> a checked config. Raises ValueError
        with one line naming the field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and not value.strip():
            return None
        value = json_object(value, "speculative_config", "with method and num_speculative_tokens")
        if not value:
            return None
        fields = {}
        for key, v in value.items():
            name = FIELD_ALIASES.get(key, key)
            if name not in cls.__dataclass_fields__:
                known = sorted(set(cls.__dataclass_fields__) | set(FIELD_ALIASES))
                raise ValueError(f"speculative_config: unknown field {key!r} (known: {', '.join(known)})")
            if name in fields:
                raise ValueError(f"speculative_config: {key!r} repeats another field's value "
                                 f"({name} and its vLLM alias)")
            fields[name] = v
        if "method" not in fields:
            raise ValueError(f"speculative_config: 'method' is required (one of {', '.join(METHODS)})")
        method = fields["method"]
        fields["method"] = METHOD_ALIASES.get(method, method)
        config = cls(**fields)
        config._check()
        return config

    def _check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method {self.method!r} is not supported (supported: "
                             f"{', '.join(METHODS)})")
        for name in ("num_speculative_tokens", "max_ngram_size", "min_ngram_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.min_ngram_size > self.max_ngram_size:
            raise ValueError(f"speculative_config: min_ngram_size ({self.min_ngram_size}) must not exceed "
                             f"max_ngram_size ({self.max_ngram_size})")
        n = self.disable_by_batch_size
        if n is not None and (not _is_int(n) or n < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1 or null, "
                             f"got {n!r}")

    def speculates_with(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests drafts at all."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
