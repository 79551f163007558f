"""Streaming request functions of benchmark_serving.py, with upstream FastDeploy's interface.

Backends (upstream's names): `openai` -> POST /v1/completions, `openai-chat` -> POST
/v1/chat/completions. The payloads are upstream's (`completions_payload`, `chat_payload`): the
request yaml (`--hyperparameter-path`) is merged into every request; a chat request of the random
dataset fixes its output length with `max_tokens` and `metadata.min_tokens`; completions send no
`max_tokens` unless the yaml does (the server then generates up to max_model_len).

The server streams one chunk per generated token, each choice with `arrival_time` (seconds from
the request's arrival in the engine); a chat choice opens with a role-only chunk, as upstream's does. Per request the client records TTFT (first chunk with
choices), ITL (gaps between later chunks), E2E latency, `arrival_time` of every chunk (from which
benchmark_serving derives the server-side S_TTFT / S_ITL / S_E2EL / S_decode), and from `usage`:
completion tokens, prompt tokens and prefix-cache hits (`prompt_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import aiohttp

# Long enough for the slowest CPU benchmark; a request that outlives it is a
# hung server, not a slow one.
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestFuncInput:
    """One request as the benchmark wants it sent (upstream's fields, plus `fixed_output_len`)."""

    no: int
    prompt: object                      # str, or a list of token ids (ours: random-ids on completions)
    history_QA: Optional[list]          # chat messages
    hyper_parameters: dict              # the request yaml, merged into the payload
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    model_name: Optional[str] = None
    logprobs: Optional[int] = None
    extra_body: Optional[dict] = None
    ignore_eos: bool = False
    debug: bool = False
    pd_metrics: bool = False
    response_format: Optional[dict] = None
    random_flag: bool = False
    fixed_output_len: bool = False


@dataclass
class RequestFuncOutput:
    """What the client observed for one request (times in seconds). As upstream: `prompt_len` is
    the prompt tokens served from the prefix cache ("Cached Tokens"), `prompt_tokens` the prompt
    length the server counted."""

    no: int = 0
    request_id: str = ""
    generated_text: str = ""
    reasoning_content: str = ""
    success: bool = False
    latency: float = 0.0
    end_timestamp: float = 0.0        # perf_counter() of the last chunk
    output_tokens: int = 0
    ttft: float = 0.0
    arrival_time: list = field(default_factory=list)  # server-side time of every chunk with choices
    itl: list = field(default_factory=list)
    tpot: float = 0.0
    prompt_len: int = 0
    prompt_tokens: int = 0
    reasoning_tokens: int = 0
    res_ttft: float = 0.0
    error: str = ""
    metrics: dict = field(default_factory=dict)


def _stream_options() -> dict:
    return {"include_usage": True, "continuous_usage_stats": True}


def completions_payload(request: RequestFuncInput) -> dict:
    """Upstream's `openai` backend payload."""
    payload = {"model": request.model, "prompt": request.prompt, "stream": True,
               "stream_options": _stream_options()}
    payload.update(request.hyper_parameters or {})
    if request.fixed_output_len:  # ours (random-ids): the same fixed length as upstream's chat rule
        payload["max_tokens"] = request.output_len
        payload["metadata"] = {**(payload.get("metadata") or {}), "min_tokens": request.output_len}
    if request.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def chat_payload(request: RequestFuncInput) -> dict:
    """Upstream's `openai-chat` backend payload."""
    payload = {"model": request.model, "messages": request.history_QA, "stream": True,
               "stream_options": _stream_options(), "max_tokens": request.output_len,
               "collect_metrics": request.pd_metrics}
    if request.response_format:
        payload["response_format"] = request.response_format
    payload.update(request.hyper_parameters or {})
    if request.random_flag:
        payload["max_tokens"] = request.output_len
        payload["metadata"] = {**(payload.get("metadata") or {}), "min_tokens": request.output_len}
    if request.ignore_eos:
        payload["ignore_eos"] = True
    return payload


async def iter_sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """Yield the payload of every `data:` line of a server-sent-event stream.

    Reads raw chunks and splits lines itself: aiohttp's line iterator has a
    per-line size cap, and a long generated text can exceed it.
    """
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[len(b"data:"):].strip().decode("utf-8")
    line = buffer.strip()
    if line.startswith(b"data:"):
        yield line[len(b"data:"):].strip().decode("utf-8")


def _choice_text(choice: dict) -> tuple[str, str]:
    """(content, reasoning content) of one streamed choice, either endpoint."""
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return delta.get("content") or "", delta.get("reasoning_content") or ""
    return choice.get("text") or "", ""


def _opens_a_chat_choice(choice: dict) -> bool:
    """The role-only chunk that opens a streamed chat choice (upstream and OpenAI send one): no token."""
    delta = choice.get("delta") or {}
    return "role" in delta and not delta.get("content") and choice.get("finish_reason") is None


async def _stream(request: RequestFuncInput, payload: dict, session: aiohttp.ClientSession) -> RequestFuncOutput:
    output = RequestFuncOutput(no=request.no)
    headers = {"Content-Type": "application/json"}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    if request.debug:
        print(f"payload: {json.dumps(payload, ensure_ascii=False)}")
    text: list[str] = []
    reasoning: list[str] = []
    start = time.perf_counter()
    last = start
    token_chunks = 0
    try:
        async with session.post(request.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                output.error = f"HTTP {response.status}: {(await response.text())[:500]}"
                return output
            async for data in iter_sse_data(response):
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                message = json.loads(data)
                if "error" in message:
                    output.error = f"stream error: {message['error']}"
                    return output
                output.request_id = output.request_id or message.get("id", "")
                if "metrics" in message:
                    output.metrics = message["metrics"]
                usage = message.get("usage") or {}
                choices = message.get("choices")
                if choices:
                    choice = choices[0]
                    content, thought = _choice_text(choice)
                    if not output.arrival_time:
                        output.ttft = now - start
                        output.prompt_len = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    else:
                        output.itl.append(now - last)
                    if not output.res_ttft and content:
                        output.res_ttft = choice.get("arrival_time", now - start)
                    output.arrival_time.append(choice.get("arrival_time", now - start))
                    token_chunks += not _opens_a_chat_choice(choice)
                    text.append(content)
                    reasoning.append(thought)
                    last = now
                elif usage:
                    output.output_tokens = usage.get("completion_tokens", 0)
                    output.prompt_tokens = usage.get("prompt_tokens", 0)
                    output.prompt_len = (usage.get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                                      output.prompt_len)
        output.end_timestamp = last
        output.latency = last - start
        output.generated_text = "".join(text)
        output.reasoning_content = "".join(reasoning)
        if not output.output_tokens:  # a server that sends no usage: one chunk per token
            output.output_tokens = token_chunks
        if output.output_tokens > 1:
            output.tpot = (output.latency - output.ttft) / (output.output_tokens - 1)
        if not output.arrival_time:
            output.error = "Never received a valid chunk to calculate TTFT."
        else:
            output.success = True
    except Exception as exc:  # one bad request is reported, not fatal to the run
        output.error = f"{type(exc).__name__}: {exc}"
    if request.debug:
        print(f"final_output: {output}")
    return output


async def async_request_eb_openai_completions(request_func_input: RequestFuncInput, pbar=None,
                                              session: Optional[aiohttp.ClientSession] = None) -> RequestFuncOutput:
    return await _with_session(request_func_input, completions_payload(request_func_input), pbar, session)


async def async_request_eb_openai_chat_completions(request_func_input: RequestFuncInput, pbar=None,
                                                   session: Optional[aiohttp.ClientSession] = None
                                                   ) -> RequestFuncOutput:
    return await _with_session(request_func_input, chat_payload(request_func_input), pbar, session)


async def _with_session(request: RequestFuncInput, payload: dict, pbar,
                        session: Optional[aiohttp.ClientSession]) -> RequestFuncOutput:
    if session is None:
        async with aiohttp.ClientSession(trust_env=True, timeout=AIOHTTP_TIMEOUT) as own:
            output = await _stream(request, payload, own)
    else:
        output = await _stream(request, payload, session)
    if pbar is not None:
        pbar.update(1)
    return output


ASYNC_REQUEST_FUNCS = {
    "openai": async_request_eb_openai_completions,
    "openai-chat": async_request_eb_openai_chat_completions,
}

DEFAULT_ENDPOINTS = {
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
