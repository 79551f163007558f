"""POST /v1/chat/completions: messages are rendered by the engine's chat template in the engine
process (the tokenizer lives there), then served like a completion."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from fastdeploy.entrypoints.openai.engine_client import (
    MIN_LOGPROB,
    AddPayload,
    EngineOutput,
    RequestStream,
    TokenLogprob,
)
from fastdeploy.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
    UsageInfo,
)
from fastdeploy.entrypoints.openai.serving_completion import IncrementalText, OpenAIServing, StreamChunks


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        payload = AddPayload(prompt=None, messages=messages,
                             sampling=request.sampling_kwargs(request.output_limit, request.num_logprobs))
        return await self.serve(request, raw_request, id_prefix="chatcmpl", chunk_object="chat.completion.chunk",
                                payload=payload, stream_body=self._stream, respond=self._respond)

    @staticmethod
    def _respond(request: ChatCompletionRequest, request_id: str, created: int, model: str, last: EngineOutput,
                 entries: list[TokenLogprob]) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id, created=created, model=model,
            choices=[ChatChoice(message=ChatMessageOut(content=last.text),
                                logprobs=_chat_logprobs(entries) if request.logprobs else None,
                                finish_reason=last.finish_reason)],
            usage=UsageInfo.of(last.num_prompt_tokens, last.num_output_tokens),
        )

    @staticmethod
    async def _stream(request: ChatCompletionRequest, stream: RequestStream,
                      chunks: StreamChunks) -> AsyncIterator[str]:
        def choice(delta: dict, finish_reason: Optional[str] = None, logprobs: Optional[dict] = None) -> dict:
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

        yield chunks.chunk(choice({"role": "assistant", "content": ""}))
        text = IncrementalText()
        last = None
        async for out in stream:
            last = out
            piece = text.delta(out.text, out.finished)
            logprobs = _chat_logprobs(out.new_logprobs).model_dump() if request.logprobs and out.new_logprobs else None
            if piece or logprobs is not None:
                yield chunks.chunk(choice({"content": piece}, logprobs=logprobs))
            if out.finished:
                yield chunks.chunk(choice({}, finish_reason=out.finish_reason))
        for line in chunks.close(last):
            yield line


def _chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=entry.token, logprob=entry.logprob if entry.logprob is not None else MIN_LOGPROB,
            bytes=list(entry.token.encode("utf-8")),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in entry.top],
        )
        for entry in entries
    ])
