"""Speculative decoding: draft tokens proposed from the request itself, verified in one model step.

config.py   SpeculativeConfig (`--speculative-config`), checked at start-up
ngram.py    NgramProposer: prompt lookup over the request's own prompt and output
verify.py   the acceptance rule applied to the logits of every row of a verified piece
The scheduler (engine/sched/resource_manager_v1.py) gives drafts their budget and pages; the
contract with sliding windows is docs/scheduler.md, "Speculative decoding".
"""

from fastdeploy.spec_decode.config import SpeculativeConfig
from fastdeploy.spec_decode.ngram import NgramProposer


def build_proposer(config: SpeculativeConfig):
    """The proposer a config selects (method "ngram": prompt lookup)."""
    if config.method == "ngram":
        return NgramProposer(config.min_ngram_size, config.max_ngram_size)
    raise ValueError(f"speculative_config: method {config.method!r} has no proposer")
