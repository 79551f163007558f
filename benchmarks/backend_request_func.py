"""Streaming request functions for the serving benchmark.

Each function sends one OpenAI-compatible streaming request and returns a
RequestFuncOutput with the client-side timings the benchmark aggregates:
time to first token (TTFT), the gaps between later tokens (ITL), end-to-end
latency, and the output token count (taken from the server's `usage` when it
reports one, because a streamed chunk may carry zero or several tokens).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional, Union

import aiohttp

# Long enough for the slowest CPU benchmark; a request that outlives it is a
# hung server, not a slow one.
AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass
class RequestFuncInput:
    """One request as the benchmark wants it sent."""

    prompt: Union[str, list[int]]
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: Optional[dict] = None


@dataclass
class RequestFuncOutput:
    """What the client observed for one request (times in seconds)."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""


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


def _sampling_fields(request: RequestFuncInput) -> dict:
    fields = {
        "max_tokens": request.output_len,
        "temperature": request.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.ignore_eos:
        # Upstream extras: with both, every request generates exactly
        # output_len tokens, so runs are comparable token for token.
        fields["ignore_eos"] = True
        fields["min_tokens"] = request.output_len
    if request.extra_body:
        fields.update(request.extra_body)
    return fields


def _is_token_chunk(text: Optional[str], choice: dict) -> bool:
    """Whether a streamed choice stands for at least one generated token.

    A token whose bytes do not yet form valid UTF-8 arrives with empty text,
    so empty text still counts -- unless the chunk only closes the stream
    (finish_reason set) or only announces the assistant role (chat).
    """
    if text:
        return True
    if choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta")
    if delta is not None and "role" in delta:
        return False
    return text is not None


async def _stream_request(
    request: RequestFuncInput,
    payload: dict,
    extract_text: Callable[[dict], Optional[str]],
    session: aiohttp.ClientSession,
) -> RequestFuncOutput:
    output = RequestFuncOutput(prompt_len=request.prompt_len)
    headers = {"Content-Type": "application/json"}
    generated: list[str] = []
    token_events = 0
    usage_tokens: Optional[int] = None
    start = time.perf_counter()
    last = start
    try:
        async with session.post(request.api_url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                output.error = f"HTTP {response.status}: {body}"
                return output
            async for data in iter_sse_data(response):
                if data == "[DONE]":
                    break
                message = json.loads(data)
                if "error" in message:
                    output.error = f"stream error: {message['error']}"
                    return output
                usage = message.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    if usage.get("prompt_tokens") is not None:
                        output.prompt_len = usage["prompt_tokens"]
                for choice in message.get("choices") or []:
                    text = extract_text(choice)
                    if not _is_token_chunk(text, choice):
                        continue
                    now = time.perf_counter()
                    if token_events == 0:
                        output.ttft = now - start
                    else:
                        output.itl.append(now - last)
                    last = now
                    token_events += 1
                    generated.append(text or "")
        output.latency = time.perf_counter() - start
        output.generated_text = "".join(generated)
        output.output_tokens = usage_tokens if usage_tokens is not None else token_events
        if output.output_tokens == 0:
            output.error = "stream ended without generating a token"
        else:
            output.success = True
    except Exception as exc:  # one bad request is reported, not fatal to the run
        output.error = f"{type(exc).__name__}: {exc}"
    return output


async def async_request_openai_completions(
    request: RequestFuncInput, session: aiohttp.ClientSession
) -> RequestFuncOutput:
    """POST /v1/completions; the prompt may be a string or a list of token ids."""
    payload = {"model": request.model, "prompt": request.prompt, **_sampling_fields(request)}
    return await _stream_request(request, payload, lambda c: c.get("text"), session)


async def async_request_openai_chat_completions(
    request: RequestFuncInput, session: aiohttp.ClientSession
) -> RequestFuncOutput:
    """POST /v1/chat/completions with the prompt as a single user message."""
    if not isinstance(request.prompt, str):
        raise TypeError("openai-chat needs a text prompt, not token ids")
    payload = {
        "model": request.model,
        "messages": [{"role": "user", "content": request.prompt}],
        **_sampling_fields(request),
    }
    return await _stream_request(
        request, payload, lambda c: (c.get("delta") or {}).get("content"), session
    )


RequestFunc = Callable[[RequestFuncInput, aiohttp.ClientSession], Awaitable[RequestFuncOutput]]

ASYNC_REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": async_request_openai_completions,
    "openai-chat": async_request_openai_chat_completions,
}

DEFAULT_ENDPOINTS = {
    "openai": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
