"""Completions `echo`: the prompt before the completion, and with `logprobs` the prompt's logprobs.

What evaluation harnesses score with (lm-evaluation-harness sends `echo: true, logprobs: 1,
max_tokens: 1` and reads `token_logprobs` of the prompt positions). The engine computes the prompt
positions' log-probs only for requests that ask (SamplingParams.prompt_logprobs); the first prompt
token has nothing before it, so its `token_logprobs` and `top_logprobs` entries are null, as
OpenAI's legacy format has it. `max_tokens: 0` scores the prompt only: the engine still runs the
prompt to its end (and samples one token, its smallest request), which the answer leaves out.
"""

from __future__ import annotations

from typing import Optional

from fastdeploy.entrypoints.openai.engine_client import EngineOutput
from fastdeploy.entrypoints.openai.protocol import CompletionRequest, UsageInfo


def engine_sampling(request: CompletionRequest) -> dict:
    """SamplingParams kwargs of a completions request, echo's included."""
    scoring_only = request.max_tokens == 0
    sampling = request.sampling_kwargs(1 if scoring_only else request.max_tokens, request.logprobs)
    if scoring_only:
        sampling.update(min_tokens=0)
    if request.echo and request.logprobs is not None:
        sampling["prompt_logprobs"] = request.logprobs
    return sampling


def scoring_only(request: CompletionRequest) -> bool:
    return request.max_tokens == 0


def echo_prefix(request: CompletionRequest, out: EngineOutput) -> tuple:
    """(text, prompt logprob entries) to put before a choice's completion: empty without echo."""
    if not request.echo or out.prompt_text is None:
        return "", []
    return out.prompt_text, list(out.prompt_logprobs or ())


def scoring_usage(usage: UsageInfo) -> UsageInfo:
    """The usage of a max_tokens=0 answer: the one token the engine sampled is not returned."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return UsageInfo.of(usage.prompt_tokens, 0, cached)


def finish_reason(request: CompletionRequest, out: EngineOutput) -> Optional[str]:
    return "length" if scoring_only(request) else out.finish_reason
