"""POST /v1/chat/completions: messages are rendered by the engine's chat template in the engine
process (the tokenizer lives there), then served like a completion."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from fastdeploy.entrypoints.openai.engine_client import MIN_LOGPROB, AddPayload, RequestStream, TokenLogprob
from fastdeploy.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from fastdeploy.entrypoints.openai.serving_completion import (
    CLIENT_CLOSED_REQUEST,
    SSE_DONE,
    IncrementalText,
    OpenAIServing,
    sse,
)

# OpenAI's value for a token whose logprob was not computed (JSON has no -Infinity).
UNKNOWN_LOGPROB = MIN_LOGPROB


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.model_name(request.model)
        request_id = random_id("chatcmpl")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        sampling = request.sampling_kwargs(request.output_limit, request.num_logprobs)
        stream = await self.admit(request_id, AddPayload(prompt=None, messages=messages, sampling=sampling))
        created = int(time.time())
        if request.stream:
            return self.streaming_response(stream, self._stream(request, stream, request_id, model, created))
        collected = await self.collect(stream, raw_request)
        if collected is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        last, entries = collected
        logprobs = _chat_logprobs(entries) if request.logprobs else None
        response = ChatCompletionResponse(
            id=request_id, created=created, model=model,
            choices=[ChatChoice(message=ChatMessageOut(content=last.text), logprobs=logprobs,
                                finish_reason=last.finish_reason)],
            usage=UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens),
        )
        return JSONResponse(response.model_dump())

    async def _stream(self, request: ChatCompletionRequest, stream: RequestStream, request_id: str, model: str,
                      created: int) -> AsyncIterator[str]:
        include_usage = request.include_usage

        def chunk(delta: dict, finish_reason: Optional[str] = None, logprobs: Optional[dict] = None) -> str:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
            if include_usage:
                body["usage"] = None
            return sse(body)

        yield chunk({"role": "assistant", "content": ""})
        text = IncrementalText()
        last = None
        async for out in stream:
            last = out
            piece = text.delta(out.text, out.finished)
            logprobs = _chat_logprobs(out.new_logprobs).model_dump() if request.logprobs and out.new_logprobs else None
            if piece or logprobs is not None:
                yield chunk({"content": piece}, logprobs=logprobs)
            if out.finished:
                yield chunk({}, finish_reason=out.finish_reason)
        if include_usage and last is not None:
            usage = UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens)
            yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage.model_dump()})
        yield SSE_DONE


def _chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=entry.token, logprob=entry.logprob if entry.logprob is not None else UNKNOWN_LOGPROB,
            bytes=list(entry.token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in entry.top],
        )
        for entry in entries
    ])
