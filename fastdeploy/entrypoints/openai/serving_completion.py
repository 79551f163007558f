"""POST /v1/completions, plus the request plumbing chat shares (admission, streaming, disconnects).

A request's life: validate -> admit into the engine (errors become 4xx/5xx *before* any byte is
sent, so a streamed request can still get a proper status) -> relay outputs. A client that goes
away is noticed in both modes and its engine requests aborted, which frees their KV pages at once.
Each of the n choices is its own engine request; their outputs are relayed as they arrive.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Iterator, Optional

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from fastdeploy.entrypoints.openai import completion_echo as echo
from fastdeploy.entrypoints.openai.engine_client import (
    AddPayload,
    ConcurrencyLimitError,
    EngineClient,
    EngineOutput,
    EngineUnavailableError,
    KVTransferFailedError,
    RequestRejectedError,
    TokenLogprob,
)
from fastdeploy.entrypoints.openai.protocol import (
    APIError,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)

# Accepted as an alias of the served model, so generic clients work without knowing its name.
DEFAULT_MODEL_ALIAS = "default"
# Status nginx uses for "client closed request"; nobody reads it, it only shows in access logs.
CLIENT_CLOSED_REQUEST = 499


def engine_error_to_api_error(exc: Exception) -> APIError:
    if isinstance(exc, KVTransferFailedError):
        return APIError(503, str(exc), type="service_unavailable_error", code="kv_load_failed")
    if isinstance(exc, ConcurrencyLimitError):
        return APIError(429, str(exc), type="rate_limit_error", code="rate_limit_exceeded")
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), type="service_unavailable_error", code="engine_unavailable")
    if isinstance(exc, RequestRejectedError):
        if exc.is_client_error:
            return APIError(400, str(exc), type="invalid_request_error")
        return APIError(500, str(exc), type="internal_server_error")
    raise exc


def sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class StreamChunks:
    """The OpenAI envelope of one streamed response's chunks, and its closing usage + [DONE].

    Upstream FastDeploy's granularity: one chunk per generated token, the finish reason on the last
    token's chunk, then (stream_options.include_usage) a usage chunk with no choices. With
    continuous_usage_stats every chunk also carries the usage so far.
    """

    request_id: str
    object: str
    created: int
    model: str
    include_usage: bool
    continuous_usage: bool = False
    n: int = 1  # choices per prompt: usage counts each prompt once

    def chunk(self, choice: dict, lasts: Optional[dict] = None, usage: Optional[UsageInfo] = None) -> str:
        """`usage`: the usage so far when it is not that of `lasts` (a chat choice's role chunk)."""
        body = {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.include_usage:  # stream_options.include_usage: null on every chunk but the last
            if usage is None and lasts:
                usage = usage_of(lasts, self.n)
            body["usage"] = usage.model_dump() if self.continuous_usage and usage else None
        return sse(body)

    def close(self, lasts: dict) -> Iterator[str]:
        """`lasts`: choice index -> its latest EngineOutput."""
        if self.include_usage and lasts:
            yield sse({"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_of(lasts, self.n).model_dump()})
        yield SSE_DONE


def usage_of(lasts, n: int = 1) -> UsageInfo:
    """`lasts`: the latest output of each choice, as a list in choice order or a dict index -> output.
    Each prompt (choices index // n) is counted once; the completion tokens of every choice."""
    items = lasts.items() if isinstance(lasts, dict) else enumerate(lasts)
    prompt_tokens = cached = completion = 0
    seen_prompts = set()
    for index, out in items:
        completion += out.num_output_tokens
        if index // n not in seen_prompts:
            seen_prompts.add(index // n)
            prompt_tokens += out.num_prompt_tokens
            cached += out.num_cached_tokens
    return UsageInfo.of(prompt_tokens, completion, cached)


class ChoiceStreams:
    """The engine requests of one API request's n choices, read as (index, output) in arrival order."""

    def __init__(self, streams: list):
        self.streams = streams

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def __aiter__(self) -> AsyncIterator[tuple]:
        if len(self.streams) == 1:  # the common case needs no tasks
            async for out in self.streams[0]:
                yield 0, out
            return
        iterators = [stream.__aiter__() for stream in self.streams]
        pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=pending.get):
                    index = pending.pop(task)
                    try:
                        out = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(iterators[index].__anext__())] = index
                    yield index, out
        finally:
            for task in pending:
                task.cancel()


class IncrementalText:
    """Turns the engine's cumulative text into deltas that never split a character.

    Decoding a prefix of a byte-level token stream can end in half a UTF-8 sequence, which the
    tokenizer renders as U+FFFD; holding trailing U+FFFD back until more tokens (or the end)
    arrive keeps streamed text identical to the non-streamed text.
    """

    def __init__(self):
        self.sent = ""

    def delta(self, text: str, final: bool) -> str:
        stable = text if final else text.rstrip("\ufffd")
        if len(stable) <= len(self.sent):
            return ""
        piece = stable[len(self.sent):]
        self.sent = stable
        return piece


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServing:
    """What both endpoints share: model check, admission, collecting, streaming."""

    def __init__(self, client: EngineClient):
        self.client = client

    async def serve(self, request, raw_request: Request, *, id_prefix: str, chunk_object: str,
                    payloads: list, stream_body: Callable, respond: Callable) -> Response:
        """One request's life for either endpoint: admit, then stream SSE chunks or answer once.

        `payloads`: one AddPayload per prompt; choice `p * n + i` is choice i of prompt p.

        `stream_body(request, choices, chunks)` yields the SSE lines; `respond(request, request_id,
        created, model, last_outputs, logprob_entries)` builds the non-streamed response model from
        one final output and one list of logprob entries per choice.
        """
        model = self.model_name(request.model)
        if request.kv_transfer_params is not None and (request.n != 1 or len(payloads) != 1):
            raise APIError(400, "kv_transfer_params: a prefill/decode request has one prompt and n=1",
                           param="kv_transfer_params")
        request_id = random_id(id_prefix)
        choices = await self.admit_choices(request_id, payloads, request.n)
        created = int(time.time())
        if request.stream:
            chunks = StreamChunks(request_id, chunk_object, created, model, request.include_usage,
                                  request.continuous_usage, request.n)
            return self.streaming_response(choices, stream_body(request, choices, chunks))
        collected = await self.collect(choices, raw_request)
        if collected is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        body = respond(request, request_id, created, model, *collected).model_dump()
        if collected[0][0].kv_transfer_params is not None:  # a prefill server's answer (vLLM's field)
            body["kv_transfer_params"] = collected[0][0].kv_transfer_params
        return JSONResponse(body)

    def model_name(self, requested: Optional[str]) -> str:
        self.client.check_available()
        served = self.client.info.served_model_name
        if requested is not None and requested not in (served, DEFAULT_MODEL_ALIAS):
            raise APIError(404, f"The model `{requested}` does not exist.", param="model", code="model_not_found")
        return served

    async def admit_choices(self, request_id: str, payloads: list, n: int) -> ChoiceStreams:
        """One engine request per choice (n per prompt), all or none. A seeded request gives choice i
        of a prompt seed + i, so its choices differ from each other and each is reproducible."""
        limit = self.client.max_concurrency
        total = n * len(payloads)
        if limit is not None and total > limit:  # a 429 would invite retries that can never succeed
            raise APIError(400, f"{total} choices (n={n} x {len(payloads)} prompts) exceed this server's "
                                f"--max-concurrency of {limit}", param="n")
        items = []
        for payload in payloads:
            for i in range(n):
                choice_payload = payload
                if i and payload.sampling.get("seed") is not None:
                    choice_payload = replace(payload, sampling={**payload.sampling,
                                                                "seed": (payload.sampling["seed"] + i) % 2 ** 63})
                items.append((request_id if total == 1 else f"{request_id}-{len(items)}", choice_payload))
        try:
            return ChoiceStreams(await self.client.add_requests(items))
        except (ConcurrencyLimitError, EngineUnavailableError, RequestRejectedError) as exc:
            raise engine_error_to_api_error(exc) from None

    async def collect(self, choices: ChoiceStreams,
                      raw_request: Request) -> Optional[tuple[list[EngineOutput], list[list[TokenLogprob]]]]:
        """Each choice's final output and all its logprob entries; None if the client left first
        (the requests are then aborted)."""

        async def drain() -> tuple[list[EngineOutput], list[list[TokenLogprob]]]:
            n = len(choices.streams)
            lasts: list = [None] * n
            entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
            async for index, out in choices:
                if lasts[index] is not None and out.prompt_text is None:  # echo: only the first output has it
                    out = replace(out, prompt_text=lasts[index].prompt_text, prompt_logprobs=lasts[index].prompt_logprobs)
                lasts[index] = out
                entries[index].extend(out.new_logprobs or ())
            return lasts, entries

        work = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
        client_left = True
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            client_left = not work.done()
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()  # takes effect at its next await, not here
                choices.abort()
        if client_left:
            return None
        try:
            return work.result()
        except EngineUnavailableError as exc:
            raise engine_error_to_api_error(exc) from None

    @staticmethod
    def streaming_response(choices: ChoiceStreams, body: AsyncIterator[str]) -> StreamingResponse:
        async def guarded() -> AsyncIterator[str]:
            try:
                async for chunk in body:
                    yield chunk
            except EngineUnavailableError as exc:
                yield sse(engine_error_to_api_error(exc).to_dict())
                yield SSE_DONE
            finally:
                choices.abort()  # no-op when finished; frees pages when the client went away

        # Starlette cancels the body when the client disconnects; if that happens before the body
        # started, `guarded`'s finally never runs, but this background task still does.
        return StreamingResponse(guarded(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(choices.abort))


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        sampling = echo.engine_sampling(request)
        payloads = [AddPayload(prompt=prompt, sampling=sampling, echo=request.echo,
                               kv_transfer_params=request.kv_transfer_params) for prompt in request.prompts]
        return await self.serve(request, raw_request, id_prefix="cmpl", chunk_object="text_completion",
                                payloads=payloads, stream_body=self._stream, respond=self._respond)

    @staticmethod
    def _respond(request: CompletionRequest, request_id: str, created: int, model: str, lasts: list,
                 entries: list) -> CompletionResponse:
        choices = []
        scoring_only = echo.scoring_only(request)
        for index, (last, choice_entries) in enumerate(zip(lasts, entries)):
            prefix, prompt_entries = echo.echo_prefix(request, last)
            text = prefix + ("" if scoring_only else last.text)
            logprobs = None
            if request.logprobs is not None:
                logprobs = CompletionLogprobs()
                _extend_logprobs(logprobs, prompt_entries, 0)
                if not scoring_only:
                    _extend_logprobs(logprobs, choice_entries, len(prefix))
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=echo.finish_reason(request, last)))
        usage = usage_of(lasts, request.n)
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=echo.scoring_usage(usage) if scoring_only else usage)

    @staticmethod
    async def _stream(request: CompletionRequest, choices: ChoiceStreams,
                      chunks: StreamChunks) -> AsyncIterator[str]:
        """One chunk per engine output, i.e. per generated token; its text may be empty while a half
        character or a possible stop string is held back."""
        texts = [IncrementalText() for _ in choices.streams]
        # Offsets count the tokens' text, as the non-streamed answer does: the text sent so far
        # can lag behind (a half character, or a possible stop string, is held back).
        token_offsets = [0] * len(choices.streams)
        lasts: dict = {}
        async for index, out in choices:
            first = index not in lasts
            lasts[index] = out
            piece = texts[index].delta(out.text, out.finished)
            prefix, prompt_entries = echo.echo_prefix(request, out) if first else ("", [])
            piece = prefix + piece
            logprobs = None
            if request.logprobs is not None and (out.new_logprobs or prompt_entries):
                logprobs = CompletionLogprobs()
                _extend_logprobs(logprobs, prompt_entries, 0)
                token_offsets[index] = _extend_logprobs(logprobs, out.new_logprobs or (),
                                                        token_offsets[index] + len(prefix))
            yield chunks.chunk({"index": index, "text": piece,
                                "logprobs": logprobs.model_dump() if logprobs else None,
                                "finish_reason": out.finish_reason if out.finished else None,
                                "arrival_time": out.arrival_time}, lasts)
        for line in chunks.close(lasts):
            yield line


def _extend_logprobs(logprobs: CompletionLogprobs, entries: list[TokenLogprob], text_offset: int) -> int:
    """Append the entries; returns the text offset after them."""
    offset = text_offset
    for entry in entries:
        logprobs.tokens.append(entry.token)
        logprobs.token_logprobs.append(entry.logprob)
        top: dict[str, float] = {}
        for tok, lp, _ in entry.top:  # most likely first; byte tokens have distinct "bytes:\\xNN" texts
            top.setdefault(tok, lp)
        logprobs.top_logprobs.append(top or None)
        logprobs.text_offset.append(offset)
        offset += len(entry.token)
    return offset
