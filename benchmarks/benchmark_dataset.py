"""Datasets of benchmark_serving.py, shaped like upstream FastDeploy's benchmark_dataset.py.

- `EB`: a jsonl file, one completion request per line: `text` (the prompt), `max_dec_len`
  (output length), `input_token_num`, and optional sampling fields (`temperature`, `topp`,
  `penalty_score`, `frequency_score`, `presence_score`).
- `EBChat`: a jsonl file, one chat per line: `messages` (the history, sent as is; the prompt is
  the last message's content), optional `max_tokens` (default: --sharegpt-output-len, else 12288)
  and `response_format`.
- `random`: upstream's random text: each prompt is N common English words (N uniform in
  [len*(1-r), len*(1+r)]), sent to chat as one user message with its output length fixed
  (`max_tokens` and `metadata.min_tokens`).
- `random-ids` (ours, in addition): prompts of random token ids with exact lengths, for the
  completions endpoint (single-byte ASCII text for chat); token for token comparable runs.

Small samples ship in benchmarks/datasets/ so every README command runs offline.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

# Ids 0-2 are pad/bos/eos-like specials in ERNIE-style vocabularies; random
# prompts avoid them so a prompt never ends early or means something special.
FIRST_REGULAR_TOKEN_ID = 3
# Printable, non-space ASCII: one byte each, so one token each for a
# byte-level tokenizer, and nothing a server might strip.
ASCII_PROMPT_CHARS = np.array([chr(c) for c in range(33, 127)])
# EBChat's output length when neither the line nor --sharegpt-output-len gives one (upstream's).
EBCHAT_DEFAULT_OUTPUT_LEN = 12288

# Everyday English words for the random text dataset (our own list; upstream draws from a longer
# one of the same kind, so prompt token counts are alike in distribution, not equal).
COMMON_WORDS = (
    "the be to of and a in that have it for not on with he as you do at this but his by from they we say "
    "her she or an will my one all would there their what so up out if about who get which go me when make "
    "can like time no just him know take people into year your good some could them see other than then now "
    "look only come its over think also back after use two how our work first well way even new want "
    "because any these give day most us is are was were been has had did said told asked went saw found "
    "took gave made put set got ran came walked stood sat felt heard knew understood believed wanted needed "
    "liked loved hoped expected planned decided agreed argued discussed explained described reported "
    "announced suggested proposed recommended promised offered refused admitted thanked celebrated welcomed "
    "showed proved tested studied learned taught trained practiced played worked built created designed "
    "developed improved changed fixed solved completed finished started began continued stopped left arrived "
    "traveled moved stayed waited rested slept ate drank cooked cleaned washed painted drew wrote read spoke "
    "listened watched noticed remembered forgot wondered considered chose preferred prepared organized "
    "river mountain city garden window table letter market teacher doctor engine signal memory cache"
).split()


class DatasetError(ValueError):
    """A dataset file or setting that cannot be used; the message names it."""


@dataclass
class SampleRequest:
    """One request to send (upstream's fields, plus `fixed_output_len`, ours)."""

    no: int
    prompt: Union[str, list, Any]
    history_QA: Any = field(default_factory=list)  # chat messages; [] for completion datasets
    json_data: Optional[dict] = None
    prompt_len: int = 0
    expected_output_len: int = 0
    response_format: Optional[dict] = None
    random_flag: bool = False       # upstream: chat requests fix their output length (metadata.min_tokens)
    fixed_output_len: bool = False  # ours: completions too (random-ids)


def _read_jsonl(path: Optional[str], dataset: str) -> list:
    if path is None:
        raise DatasetError(f"--dataset-name {dataset} needs --dataset-path (a jsonl file)")
    entries = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{path} line {number} is not JSON: {exc.msg}") from None
    if not entries:
        raise DatasetError(f"{path} holds no requests")
    return entries


def _oversample(samples: list, num_requests: int, seed: int) -> list:
    """Upstream repeats randomly chosen samples when the file is shorter than --num-prompts."""
    if len(samples) < num_requests:
        rng = random.Random(seed)
        samples = samples + rng.choices(samples, k=num_requests - len(samples))
    return samples


def sample_eb(path: Optional[str], num_requests: int, seed: int = 0, shuffle: bool = False) -> list:
    entries = _read_jsonl(path, "EB")
    if shuffle:
        random.Random(seed).shuffle(entries)
    samples = []
    for no, entry in enumerate(entries[:num_requests], 1):
        if "text" not in entry:
            raise DatasetError(f"{path}: EB line {no} has no 'text'")
        samples.append(SampleRequest(no=no, prompt=entry["text"], history_QA=[], json_data=entry,
                                     prompt_len=int(entry.get("input_token_num", 0)),
                                     expected_output_len=int(entry.get("max_dec_len", 0))))
    return _oversample(samples, num_requests, seed)


def sample_eb_chat(path: Optional[str], num_requests: int, output_len: Optional[int] = None, seed: int = 0,
                   shuffle: bool = False) -> list:
    entries = _read_jsonl(path, "EBChat")
    if shuffle:
        random.Random(seed).shuffle(entries)
    samples = []
    for no, entry in enumerate(entries[:num_requests], 1):
        messages = entry.get("messages")
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{path}: EBChat line {no} has no 'messages' list")
        samples.append(SampleRequest(
            no=no, prompt=messages[-1].get("content", ""), history_QA=messages, json_data=entry,
            expected_output_len=int(entry.get("max_tokens", output_len or EBCHAT_DEFAULT_OUTPUT_LEN)),
            response_format=entry.get("response_format")))
    return _oversample(samples, num_requests, seed)


def _upstream_len(rng: random.Random, base: int, ratio: Optional[float]) -> int:
    """Upstream's rule: uniform integer in [max(1, int(base*(1-r))), int(base*(1+r))]."""
    if not ratio or ratio <= 0:
        return base
    return rng.randint(max(1, int(base * (1 - ratio))), int(base * (1 + ratio)))


def sample_random_text(num_requests: int, input_len: int, output_len: int, range_ratio: float,
                       seed: int = 0) -> list:
    """Upstream's random dataset: words, one user message, output length fixed per request."""
    if input_len < 1 or output_len < 1:
        raise DatasetError("--random-input-len and --random-output-len must be >= 1")
    rng = random.Random(seed)
    samples = []
    for no in range(1, num_requests + 1):
        n_in = _upstream_len(rng, input_len, range_ratio)
        n_out = _upstream_len(rng, output_len, range_ratio)
        text = " ".join(rng.choice(COMMON_WORDS) for _ in range(n_in))
        messages = [{"role": "user", "content": text}]
        samples.append(SampleRequest(no=no, prompt=text, history_QA=messages, json_data={"messages": messages},
                                     prompt_len=n_in, expected_output_len=n_out, random_flag=True))
    return samples


def _lengths(rng: np.random.Generator, center: int, range_ratio: float, n: int) -> np.ndarray:
    """Integer lengths uniform in [center*(1-r), center*(1+r)], at least 1."""
    low = max(1, math.floor(center * (1 - range_ratio)))
    high = max(low, math.ceil(center * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def sample_random_ids(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                      seed: int, as_text: bool = False) -> list:
    """Ours: random prompts with exact lengths -- token ids, or single-byte ASCII text for chat.

    Token-id prompts reach the model untouched, so `prompt_len` is the true input length; text
    prompts are for the chat endpoint, whose template adds its own tokens on top.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise DatasetError("--random-input-len and --random-output-len must be >= 1")
    if not as_text and vocab_size <= FIRST_REGULAR_TOKEN_ID:
        raise DatasetError(f"vocab size {vocab_size} leaves no regular token ids")
    rng = np.random.default_rng(seed)
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    samples = []
    for no, (n_in, n_out) in enumerate(zip(input_lens.tolist(), output_lens.tolist()), 1):
        if as_text:
            prompt = "".join(rng.choice(ASCII_PROMPT_CHARS, size=n_in).tolist())
            history = [{"role": "user", "content": prompt}]
        else:
            prompt = rng.integers(FIRST_REGULAR_TOKEN_ID, vocab_size, size=n_in).tolist()
            history = []
        samples.append(SampleRequest(no=no, prompt=prompt, history_QA=history, prompt_len=n_in,
                                     expected_output_len=n_out, random_flag=True, fixed_output_len=True))
    return samples
