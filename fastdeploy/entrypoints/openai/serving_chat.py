"""POST /v1/chat/completions: messages are rendered by the engine's chat template in the engine
process (the tokenizer lives there), then served like a completion."""

from __future__ import annotations

from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from fastdeploy.entrypoints.openai.engine_client import MIN_LOGPROB, AddPayload, TokenLogprob
from fastdeploy.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    TopLogprob,
)
from fastdeploy.entrypoints.openai.serving_completion import (
    ChoiceStreams,
    IncrementalText,
    OpenAIServing,
    StreamChunks,
    usage_of,
)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        payload = AddPayload(prompt=None, messages=messages,
                             sampling=request.sampling_kwargs(request.output_limit, request.num_logprobs))
        return await self.serve(request, raw_request, id_prefix="chatcmpl", chunk_object="chat.completion.chunk",
                                payload=payload, stream_body=self._stream, respond=self._respond)

    @staticmethod
    def _respond(request: ChatCompletionRequest, request_id: str, created: int, model: str, lasts: list,
                 entries: list) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id, created=created, model=model,
            choices=[ChatChoice(index=index, message=ChatMessageOut(content=last.text),
                                logprobs=_chat_logprobs(choice_entries) if request.logprobs else None,
                                finish_reason=last.finish_reason)
                     for index, (last, choice_entries) in enumerate(zip(lasts, entries))],
            usage=usage_of(lasts),
        )

    @staticmethod
    async def _stream(request: ChatCompletionRequest, choices: ChoiceStreams,
                      chunks: StreamChunks) -> AsyncIterator[str]:
        def choice(index: int, delta: dict, finish_reason: Optional[str] = None,
                   logprobs: Optional[dict] = None) -> dict:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

        for index in range(len(choices.streams)):
            yield chunks.chunk(choice(index, {"role": "assistant", "content": ""}))
        texts = [IncrementalText() for _ in choices.streams]
        lasts: dict = {}
        async for index, out in choices:
            lasts[index] = out
            piece = texts[index].delta(out.text, out.finished)
            logprobs = _chat_logprobs(out.new_logprobs).model_dump() if request.logprobs and out.new_logprobs else None
            if piece or logprobs is not None:
                yield chunks.chunk(choice(index, {"content": piece}, logprobs=logprobs))
            if out.finished:
                yield chunks.chunk(choice(index, {}, finish_reason=out.finish_reason))
        for line in chunks.close(lasts):
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
