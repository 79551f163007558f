"""Requests, their sampling parameters and the outputs the engine emits (all plain, picklable)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from fastdeploy.model_executor.guided_decoding.params import GuidedDecodingParams


# Most top-k logprobs a request may ask for (vLLM's limit; OpenAI allows 5 for completions, 20 for chat).
MAX_LOGPROBS = 20
# OpenAI's bound on a logit_bias value: -100 effectively bans a token, +100 effectively forces it.
MAX_LOGIT_BIAS = 100
# Stop strings are searched every step: bound their number and length (OpenAI allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty
MAX_REPETITION_PENALTY = 100.0  # no standard bound; a larger one is a typo rather than a choice


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    seed: Optional[int] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    stop_token_ids: Optional[list] = None
    logit_bias: Optional[dict] = None  # token id -> added to its logit before sampling (OpenAI's range)
    stop: Optional[list] = None  # strings that end the output (not included in it); a str is one
    # Penalties as in vLLM/upstream FastDeploy: presence and frequency subtract from the logits of
    # tokens already generated (once, or per occurrence); repetition divides positive (multiplies
    # negative) logits of tokens in the prompt or the output. 0, 0 and 1 turn them off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Structured output (upstream FastDeploy's field): the output must match a JSON schema, regex,
    # choice list or grammar (model_executor/guided_decoding/).
    guided_decoding: Optional[GuidedDecodingParams] = None
    # vLLM's prompt_logprobs: for every prompt position after the first, the log-prob of the prompt's
    # token there and of the k most likely ones (0: the prompt's token only). Costs an LM-head pass
    # over every prompt row, so only requests that ask pay it (engine/prompt_logprobs.py).
    prompt_logprobs: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def validate(self) -> None:
        """Raise ValueError with a user-facing message for a parameter no request can run with."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "must be an integer >= -1 (0 or -1 disables it)")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if self.seed is not None and not _is_int(self.seed):
            bad("seed", "must be an integer")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.stop_token_ids is not None and not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                bad(name, f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY}]")
        if self.stop is not None and not (
                isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_STRINGS
                and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LENGTH for s in self.stop)):
            bad("stop", f"must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at most "
                        f"{MAX_STOP_STRING_LENGTH} characters")
        if self.logit_bias is not None and not (
                isinstance(self.logit_bias, dict) and all(_is_int(t) for t in self.logit_bias)
                and all(_is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values())):
            bad("logit_bias", f"must map token ids to numbers in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                bad("guided_decoding", "must be a GuidedDecodingParams")
            self.guided_decoding.validate()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class CompletionOutput:
    index: int = 0
    token_ids: list = field(default_factory=list)
    text: str = ""
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: CompletionOutput
    finished: bool = False
    prompt: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first, else
    # {token id: logprob} of that token and the top k (vLLM's shape, floats for Logprob objects).
    prompt_logprobs: Optional[list] = None
    # Disaggregation: what a prefill server's answer tells the decode server (vLLM's kv_transfer_params),
    # or why a decode server could not load the prompt's KV (kv_load_failure_policy "fail").
    kv_transfer_params: Optional[dict] = None
    error: Optional[str] = None


class Request:
    """A request as the scheduler sees it: tokens and progress. Its KV pages are the KV cache manager's
    (cache_manager/kv_cache_manager.py), by request id.

    `num_computed_tokens` counts tokens whose KV is in the cache.
    """

    def __init__(self, request_id: str, prompt_token_ids: list, sampling_params: SamplingParams,
                 arrival_time: Optional[float] = None, eos_token_id=None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # One id or several (config.json / generation_config.json may list more than one end token).
        self.eos_token_ids = frozenset(() if eos_token_id is None else
                                       (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id)
        self.output_token_ids: list = []
        self.output_logprobs: list = []
        self.prompt_logprobs: Optional[list] = None  # filled by position as prompt chunks run
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # tokens the last admission found in the prefix cache
        self.computed_high_water = 0  # most tokens ever computed; a preemption makes it recompute them
        self.generator = None  # numpy Generator for sampling, set by the engine (seeded or not)
        self.draft_state = None  # the draft proposer's index of this request's tokens (spec_decode/)
        self.grammar = None  # guided decoding: its matcher (guided_decoding/masks.py GrammarState), set by the engine
        self.detokenize_state = [0, ""]  # incremental detokenization: [tokens decoded, their text]
        self.stop_checked = 0  # characters of the output text searched for stop strings so far
        self.num_preemptions = 0
        self.first_token_time: Optional[float] = None
        # Prefill/decode disaggregation (fastdeploy/disaggregation/): `remote_kv` is the transfer that fills
        # this request's first tokens' KV on a decode server (RemotePrefill, None once loaded or given up);
        # `kv_loading` is true while its pages are taken and the transfer runs; `hands_off_kv` marks a
        # prefill server's request whose pages wait for the decode server when it finishes.
        self.remote_kv = None
        self.kv_loading = False
        self.hands_off_kv = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_new_tokens(self) -> int:
        """Tokens still to be generated at most (sampling params bound it; the scheduler caps it)."""
        return self.sampling_params.max_tokens - len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def append_output(self, token_id: int, logprobs: Optional[dict] = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    def stop_reason(self) -> Optional[str]:
        """'stop' or 'length' once the newest token ends the request, else None."""
        params = self.sampling_params
        n = len(self.output_token_ids)
        if n >= params.max_tokens:
            return "length"
        if n < params.min_tokens or not self.output_token_ids:
            return None
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if params.stop_token_ids and last in params.stop_token_ids:
            return "stop"
        return None

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens})")
