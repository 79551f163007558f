"""POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's tokenizer endpoints, names and shapes.

Clients that count or build token-id prompts themselves use them (lm-evaluation-harness's
`tokenizer_backend=remote` needs all three). The server process loads the same tokenizer the
engine process uses (load_tokenizer on the same model config), so a tokenize here answers without
waiting for an engine step, and its ids are the ids a completions prompt string becomes:
`add_special_tokens` (default true, as vLLM) puts bos first where the model's tokenizer adds one to
a raw prompt; `messages` are rendered with the chat template as /v1/chat/completions renders them.
"""

from __future__ import annotations

from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from fastdeploy.entrypoints.openai.protocol import ChatMessage, bad_request


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    # None: true for a prompt (vLLM's default); for messages, what the chat endpoint does (the template
    # places the specials; a plain transcript is a raw prompt)
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (a string) and messages (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    tokens: list[StrictInt]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, v):
        if any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


class OpenAIServingTokenization:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: Callable[[], int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len  # the engine's once it is ready (its KV cache may cap it)

    def tokenize(self, request: TokenizeRequest) -> dict:
        tok = self.tokenizer
        if request.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            try:
                if request.add_special_tokens is None:  # exactly the ids /v1/chat/completions runs
                    ids = tok.encode_chat(messages, request.add_generation_prompt)
                else:
                    text = tok.apply_chat_template(messages, request.add_generation_prompt)
                    ids = tok.encode_prompt(text) if request.add_special_tokens else tok.encode(text)
            except ValueError as exc:
                raise bad_request(str(exc), param="messages") from None
        else:
            ids = tok.encode(request.prompt) if request.add_special_tokens is False else tok.encode_prompt(request.prompt)
        body = {"count": len(ids), "max_model_len": self.max_model_len(), "tokens": ids}
        if request.return_token_strs:
            body["token_strs"] = [tok.id_to_token(i) for i in ids]
        return body

    def detokenize(self, request: DetokenizeRequest) -> dict:
        bad = next((t for t in request.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              param="tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}

    def info(self) -> dict:
        tok = self.tokenizer
        named = dict(getattr(tok, "special_tokens", None) or {})
        for key in ("bos_token", "eos_token", "pad_token"):  # the byte tokenizer names its specials by id
            if key not in named:
                token_id = getattr(tok, f"{key}_id", None)
                if isinstance(token_id, (list, tuple, set, frozenset)):
                    token_id = next(iter(token_id), None)
                named[key] = tok.id_to_token(token_id) if isinstance(token_id, int) else None
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": named.get("bos_token"),
            "eos_token": named.get("eos_token"),
            "pad_token": named.get("pad_token"),
            "unk_token": named.get("unk_token"),
            "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
            "chat_template": getattr(tok.chat_template, "source", None),
            "model_max_length": self.max_model_len(),
            "vocab_size": self.vocab_size,
        }
