"""A checkpoint's Jinja chat template, rendered the way Hugging Face / PaddleFormers render it.

The template comes from `chat_template.jinja` or the `chat_template` field of
`tokenizer_config.json` (a string, or a list of named templates of which `default` serves). It is
rendered in a sandbox with `trim_blocks` and `lstrip_blocks`, the loop-control extension,
`{% generation %}` blocks, `raise_exception`, `strftime_now` and transformers' `tojson` (its `indent`,
`separators`, `sort_keys`), with `messages`, `add_generation_prompt` and the tokenizer's
special tokens (`bos_token`, `eos_token`, `cls_token`, `sep_token`, ...) as variables. The rendered
text is then encoded without adding special tokens: the template places them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from typing import Optional

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def validate_messages(messages) -> list:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
    return messages


def find_chat_template(model_dir: Optional[str], tokenizer_config: dict) -> Optional[str]:
    """`chat_template.jinja` wins over tokenizer_config.json's `chat_template` (as in transformers)."""
    if model_dir:
        path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        path = os.path.join(model_dir, "chat_template.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f).get("chat_template")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _generation_blocks():
    """A Jinja extension for `{% generation %}...{% endgeneration %}`, which transformers offers (it marks the
    assistant's tokens for training; checkpoints ship templates that use it): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationBlocks


class JinjaChatTemplate:
    def __init__(self, source: str, special_tokens: dict):
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise RuntimeError("the model ships a chat template: pip install jinja2") from None

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_blocks()])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"chat template does not parse: {exc}") from None
        self.special_tokens = dict(special_tokens)
        self.source = source  # served by GET /tokenizer_info
        self._error = TemplateError

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except self._error as exc:
            raise ValueError(f"chat template: {exc}") from None


class PlainChatTemplate:
    """For the built-in presets and checkpoints without a template (a base model such as Gemma 3 270M):
    a plain transcript, "User: ...\nAssistant:", which a base model continues as a dialogue. It has no
    end-of-turn token, so the assistant's turn ends where the model starts the next user line
    (`turn_stops`, added to a chat request's stop strings); the rendered text is a raw prompt, so it
    starts with <bos> where the tokenizer adds one to raw prompts."""

    turn_stops = ("\nUser:",)
    raw_prompt = True

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
        return text + ("Assistant:" if add_generation_prompt else "")


def with_turn_stops(params, template):
    """`params` (a SamplingParams) with the template's end-of-turn stop strings added, for a chat request."""
    stops = getattr(template, "turn_stops", ())
    if not stops:
        return params
    return dataclasses.replace(params, stop=list(dict.fromkeys([*(params.stop or []), *stops])))
