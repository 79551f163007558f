"""POST /v1/chat/completions: messages are rendered by the engine's chat template in the engine
process (the tokenizer lives there), then served like a completion."""

from __future__ import annotations

from typing import AsyncIterator

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
    UsageInfo,
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
                             sampling=request.sampling_kwargs(request.output_limit, request.num_logprobs),
                             kv_transfer_params=request.kv_transfer_params)
        return await self.serve(request, raw_request, id_prefix="chatcmpl", chunk_object="chat.completion.chunk",
                                payloads=[payload], stream_body=self._stream, respond=self._respond)

    @staticmethod
    def _respond(request: ChatCompletionRequest, request_id: str, created: int, model: str, lasts: list,
                 entries: list) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=request_id, created=created, model=model,
            choices=[ChatChoice(index=index, message=ChatMessageOut(content=last.text,
                                                                    reasoning_content=last.reasoning_text),
                                logprobs=_chat_logprobs(choice_entries) if request.logprobs else None,
                                finish_reason=last.finish_reason)
                     for index, (last, choice_entries) in enumerate(zip(lasts, entries))],
            usage=usage_of(lasts, request.n),
        )

    @staticmethod
    async def _stream(request: ChatCompletionRequest, choices: ChoiceStreams,
                      chunks: StreamChunks) -> AsyncIterator[str]:
        """One chunk per generated token, as upstream FastDeploy streams. Each choice opens, when its
        first token arrives, with a role-only chunk (`{"role": "assistant", "content": ""}`, as
        upstream and OpenAI send it; upstream's benchmark therefore reads the first token's server
        time from the second chunk); the last token's chunk carries the finish reason. A reply read by a
        reasoning parser (--reasoning-parser harmony) has `reasoning_content` in every delta too: the new
        reasoning text, as `content` is the new answer text ("" when none)."""
        texts = [IncrementalText() for _ in choices.streams]
        reasonings = [IncrementalText() for _ in choices.streams]
        started = [False] * len(choices.streams)
        lasts: dict = {}
        async for index, out in choices:
            lasts[index] = out
            if not started[index]:
                started[index] = True
                opening = {"role": "assistant", "content": ""}
                if out.reasoning_text is not None:
                    opening["reasoning_content"] = ""
                yield chunks.chunk({"index": index, "delta": opening,
                                    "logprobs": None, "finish_reason": None, "arrival_time": out.arrival_time},
                                   usage=_usage_before_token(lasts, index, request.n))
            delta = {"content": texts[index].delta(out.text, out.finished)}
            if out.reasoning_text is not None:
                delta["reasoning_content"] = reasonings[index].delta(out.reasoning_text, out.finished)
            logprobs = _chat_logprobs(out.new_logprobs).model_dump() if request.logprobs and out.new_logprobs else None
            yield chunks.chunk({"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": out.finish_reason if out.finished else None,
                                "arrival_time": out.arrival_time}, lasts)
        for line in chunks.close(lasts):
            yield line


def _usage_before_token(lasts: dict, index: int, n: int) -> UsageInfo:
    """The usage so far without choice `index`'s newest output: its role chunk precedes its tokens."""
    so_far = usage_of(lasts, n)
    cached = so_far.prompt_tokens_details.cached_tokens if so_far.prompt_tokens_details else 0
    return UsageInfo.of(so_far.prompt_tokens, so_far.completion_tokens - lasts[index].num_output_tokens, cached)


def _chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(
            token=entry.token, logprob=entry.logprob if entry.logprob is not None else MIN_LOGPROB,
            bytes=list(entry.bytes),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(raw)) for t, lp, raw in entry.top],
        )
        for entry in entries
    ])
