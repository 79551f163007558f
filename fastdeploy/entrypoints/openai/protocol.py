"""OpenAI-shaped request/response models and the API error type.

Requests are validated here, before anything reaches the engine, so every client mistake becomes a
4xx with an OpenAI-style error body. Fields OpenAI defines but this engine cannot honour (best_of
other than n, suffix, tools) are rejected by name instead of being
silently ignored; unknown extra fields are ignored, as OpenAI clients send many optional ones.

Completions take a string, a list of token ids, or a list of either (one choice per prompt and n,
as OpenAI does). `metadata` is merged into the request as upstream FastDeploy merges it: its keys
that name sampling fields (e.g. `{"min_tokens": 64}`) override those fields; other keys are ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, ValidationError, field_validator,
                      model_serializer, model_validator)

from fastdeploy.engine.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
)
from fastdeploy.entrypoints.openai.response_format import guided_decoding_of
from fastdeploy.input.tokenizer import CHAT_ROLES


class APIError(Exception):
    """A failure the client should see as an OpenAI error body with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_error_to_api_error(err: ValidationError) -> APIError:
    """Report the first pydantic error as a 400 naming the offending field (`messages.0.content`)."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    # Custom validators raise ValueError; pydantic prefixes "Value error, " which reads poorly.
    msg = msg.removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def _one_error_for_union(value, handler, message: str):
    """Run the field's own validation, but report a failed union as one plain error on the field
    (pydantic would report one error per member, with member names in the location)."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(message) from None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Most choices (n) one request may ask for; each is a separate engine request.
MAX_CHOICES = 16
# Most prompts one completions request may batch (each times n is an engine request).
MAX_PROMPTS = 64
# Request fields a `metadata` key may set (upstream copies every metadata key into the request it
# sends its engine; these are the ones this engine has).
METADATA_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed",
                   "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias")


class _Request(BaseModel):
    """Fields shared by both endpoints; sampling extras follow upstream FastDeploy/vLLM names."""

    model_config = ConfigDict(extra="ignore")
    # Prefill/decode disaggregation: vLLM's NixlConnector fields, which vllm-router sends (checked by the
    # engine: disaggregation/transfer_config.py).
    kv_transfer_params: Optional[dict] = None

    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional["StreamOptions"] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)  # choices: one engine request each
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    presence_penalty: Optional[float] = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: Optional[float] = Field(default=None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: Optional[dict[str, float]] = None  # JSON keys are strings: {"50256": -100}
    user: Optional[str] = None
    metadata: Optional[dict[str, Any]] = None
    # Structured outputs (response_format.py): OpenAI's response_format, or upstream's guided_* fields.
    response_format: Optional[dict] = None
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_json_object: Optional[bool] = None
    _guided_decoding = PrivateAttr(default=None)  # what those fields ask, built (and checked) once

    @model_validator(mode="before")
    @classmethod
    def _merge_metadata(cls, data):
        """Upstream FastDeploy's rule: metadata's keys override the request's own fields."""
        if isinstance(data, dict) and isinstance(data.get("metadata"), dict):
            merged = {k: v for k, v in data["metadata"].items() if k in METADATA_FIELDS and k in cls.model_fields}
            if merged:
                data = {**data, **merged}
        return data

    @model_validator(mode="after")
    def _guided_decoding_compiles(self):
        self._guided_decoding = guided_decoding_of(self)  # a 400 naming the problem, before the engine sees it
        return self

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_strings(cls, v, handler):
        v = _one_error_for_union(v, handler, "stop must be a string or a list of strings")
        stops = [v] if isinstance(v, str) else list(v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(len(s) > MAX_STOP_STRING_LENGTH for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_LENGTH} characters")
        return stops or None

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_non_negative(cls, v):
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_token_ids(cls, v):
        if v is None:
            return v
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"bias for token {key} must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}")
        return v

    def sampling_kwargs(self, max_tokens: Optional[int], logprobs: Optional[int]) -> dict:
        """Keyword arguments for SamplingParams; max_tokens=None means 'up to max_model_len'."""
        kw: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "logprobs": logprobs,
            "stop_token_ids": list(self.stop_token_ids) if self.stop_token_ids else None,
            "stop": self.stop,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None,
            "guided_decoding": self._guided_decoding,
        }
        if self.temperature is not None:
            kw["temperature"] = self.temperature
        if self.top_p is not None:
            kw["top_p"] = self.top_p
        if self.top_k is not None:
            kw["top_k"] = max(self.top_k, 0)  # OpenAI-style -1 means "disabled", the engine's 0
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM / upstream: usage so far on every chunk too


class CompletionRequest(_Request):
    # Strict: JSON true/false or 5.0 is no token id (lax mode would read them as 1, 0, 5).
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    # None: up to max_model_len, as upstream; 0: score the prompt only (echo, see serving_completion.py)
    max_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt's logprobs too
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @model_validator(mode="after")
    def _zero_max_tokens_scores_the_prompt(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing: it needs echo=true (scoring the prompt)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens=0 (scoring the prompt) is not supported with stream=true")
        return self

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (={self.n}): choices are not ranked")
        return self

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _non_empty_prompts(cls, v, handler):
        v = _one_error_for_union(v, handler, "prompt must be a string, a list of token ids, or a list of either")
        prompts = v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
        for prompt in prompts:
            if len(prompt) == 0:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt, list) and any(t < 0 for t in prompt):
                raise ValueError("token ids must be >= 0")
        return v

    @property
    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        v = self.prompt
        return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[CHAT_ROLES]  # the roles the engine's chat template renders
    content: Union[str, list["TextPart"], None] = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_shape(cls, v, handler):
        return _one_error_for_union(v, handler, "content must be a string or a list of text parts")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list] = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise ValueError("tool calling is not supported")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def output_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


# ----------------------------------------------------------------------------- responses

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str
    # The reply's reasoning (vLLM's and upstream FastDeploy's field), set where a reasoning parser read the
    # reply (--reasoning-parser harmony); otherwise the field is left out, not null.
    reasoning_content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_absent_reasoning(self, handler):
        data = handler(self)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
        return data


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fastdeploy"
    root: str
    max_model_len: int
    vocab_size: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_Request.model_rebuild()
ChatMessage.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
