"""gpt-oss's harmony replies, split into what a chat client reads: `content` and `reasoning_content`.

A harmony reply is a run of messages, each `header<|message|>body` closed by `<|end|>` (more follows),
`<|return|>` (the answer is done) or `<|call|>` (a tool call). The prompt ends with `<|start|>assistant`, so
the reply opens with the rest of the first header; later messages open with `<|start|>`:

    <|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

A header names the message's channel after `<|channel|>` (`analysis`, `commentary`, `final`), maybe a
recipient (`to=functions.x`, before or after the channel) and a `<|constrain|>` format. Plain chat needs:
the `final` channel's text is the content, the `analysis` channel's the reasoning; a message with a
recipient or on any other channel (`commentary`: tool calls and their preambles) goes to neither. A message
with no channel in its header is content. Several messages of one kind are joined by a newline.

The parser reads the generated token ids as they come (`feed` takes the cumulative ids) and gives the
cumulative content and reasoning after each step, each only ever growing, so streamed deltas join to the
non-streamed answer. The markers are told apart by id, never by text: the text of a reply can say
"<|channel|>" without becoming markup. A reply that does not open with markup (a model that answers
plainly) is passed through: its content is the engine's own text, unchanged. Whether it does is known at
its first marker, or after LEAD_LIMIT tokens without one; until then the reply shows nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fastdeploy.engine.stop_strings import find_stop, releasable

logger = logging.getLogger("fastdeploy.input.harmony_parser")

NAME = "harmony"  # --reasoning-parser's value
GPT_OSS_ARCHITECTURE = "GptOssForCausalLM"
MARKERS = {"start": "<|start|>", "channel": "<|channel|>", "message": "<|message|>", "end": "<|end|>",
           "return_": "<|return|>", "call": "<|call|>", "constrain": "<|constrain|>"}
REQUIRED = ("start", "channel", "message", "end", "return_")
# Tokens a reply may spend on a header before its first marker (a recipient such as " to=functions.name"
# can precede <|channel|>); a reply with this many tokens and no marker yet is plain text.
LEAD_LIMIT = 16
JOIN = "\n"  # between two messages of the same kind

_LEAD, _HEADER, _BODY, _PLAIN = "lead", "header", "body", "plain"


def token_id(tokenizer, text: str) -> Optional[int]:
    """The id of the one token `text` is, or None (it is no single token of this vocabulary)."""
    try:
        ids = tokenizer.encode(text)
    except Exception:
        return None
    if len(ids) != 1 or not hasattr(tokenizer, "id_to_token") or tokenizer.id_to_token(ids[0]) != text:
        return None
    return int(ids[0])


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of the harmony markers in one vocabulary (<|call|> and <|constrain|> may be missing)."""

    start: int
    channel: int
    message: int
    end: int
    return_: int
    call: Optional[int] = None
    constrain: Optional[int] = None

    @classmethod
    def of(cls, tokenizer) -> Optional["HarmonyTokens"]:
        """The tokenizer's harmony markers, or None when it lacks one of the required ones."""
        ids = {field: token_id(tokenizer, text) for field, text in MARKERS.items()}
        if any(ids[field] is None for field in REQUIRED):
            return None
        return cls(**ids)

    @property
    def closers(self) -> frozenset:
        return frozenset(i for i in (self.end, self.return_, self.call) if i is not None)


def harmony_for(requested: Optional[str], architectures: Sequence[str], tokenizer) -> Optional[HarmonyTokens]:
    """The markers chat replies are parsed with, or None (replies are served as the engine decodes them).

    `requested`: --reasoning-parser; "harmony" needs the markers in the tokenizer (ValueError otherwise).
    Without the flag a GptOssForCausalLM checkpoint whose tokenizer has them gets the parser too."""
    if requested is not None and requested != NAME:
        raise ValueError(f"--reasoning-parser: unknown parser {requested!r} (known: {NAME})")
    tokens = HarmonyTokens.of(tokenizer)
    if requested == NAME:
        if tokens is None:
            missing = [MARKERS[f] for f in REQUIRED if token_id(tokenizer, MARKERS[f]) is None]
            raise ValueError(f"--reasoning-parser {NAME}: the tokenizer has no single token for {', '.join(missing)}")
        logger.info("reasoning parser harmony (--reasoning-parser): chat replies' final channel is the content, "
                    "the analysis channel the reasoning_content")
        return tokens
    if GPT_OSS_ARCHITECTURE in architectures and tokens is not None:
        logger.info("reasoning parser harmony: %s with harmony tokens, so chat replies' final channel is the "
                    "content and the analysis channel the reasoning_content", GPT_OSS_ARCHITECTURE)
        return tokens
    return None


def end_stops_replies(tokens: HarmonyTokens, eos_token_ids) -> bool:
    """Whether the model's end ids (config.json + generation_config.json) include <|end|>, which ends every
    message: a reply then stops after its first one (often the analysis), and its content is what final text
    came before. gpt-oss's own list is <|return|>, <|endoftext|>, <|call|>."""
    ids = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids or ())
    return tokens.end in ids


class HarmonyParser:
    """One reply's parse. `decode(ids) -> str` drops special tokens (the engine tokenizer's decode);
    `stops`: the request's stop strings, which end each part where the engine ends the text."""

    def __init__(self, tokens: HarmonyTokens, decode: Callable[[list], str], stops: Optional[Sequence[str]] = None):
        self.tokens = tokens
        self._decode = decode
        self._stops = list(stops or ())
        self._markers = frozenset(i for i in (tokens.start, tokens.channel, tokens.message, tokens.constrain)
                                  if i is not None)
        self.seen = 0  # generated tokens read so far
        self.state = _LEAD
        self._header: list = []
        self._body: list = []
        self._target: Optional[str] = None  # "content" / "reasoning" / None (neither) for the open body
        self._closed = {"content": [], "reasoning": []}  # texts of finished messages, empty ones left out

    # -- reading tokens -------------------------------------------------------------------------------
    def feed(self, token_ids: Sequence[int]) -> None:
        """Read the reply's cumulative ids (only those past `seen` are new)."""
        if len(token_ids) < self.seen:  # cannot happen with this engine; start over rather than misparse
            self.__init__(self.tokens, self._decode, self._stops)
        for tid in token_ids[self.seen:]:
            self._step(int(tid))
        self.seen = len(token_ids)

    def _step(self, tid: int) -> None:
        t = self.tokens
        if self.state == _PLAIN:
            return
        if self.state == _LEAD:
            if tid in self._markers:
                self.state = _HEADER  # the lead tokens were the start of the first header
            elif tid in t.closers:
                self.state = _PLAIN  # a whole reply without markup
                return
            else:
                self._header.append(tid)
                if len(self._header) >= LEAD_LIMIT:
                    self.state = _PLAIN
                return
        if self.state == _HEADER:
            if tid == t.message:
                self._target = self._route(self._header)
                self._header, self._body, self.state = [], [], _BODY
            elif tid == t.start or tid in t.closers:
                self._header = []  # a new message begins (or a header ended with no message: nothing to show)
            else:
                self._header.append(tid)
            return
        # _BODY
        if tid in t.closers or tid == t.start:  # <|start|> without <|end|> still opens a new message
            self._close()
            self.state = _HEADER
        else:
            self._body.append(tid)

    def _close(self) -> None:
        if self._target is not None:
            text = self._decode(self._body)
            if text:
                self._closed[self._target].append(text)
        self._body, self._target = [], None

    def _route(self, header: list) -> Optional[str]:
        """Where a message with this header goes: "content", "reasoning" or None (neither)."""
        t = self.tokens
        role_ids, channel_ids, rest, part = [], [], [], "role"
        for tid in header:
            if tid == t.channel:
                part = "channel"
            elif tid == t.constrain:
                part = "rest"
            else:
                (role_ids if part == "role" else channel_ids if part == "channel" else rest).append(tid)
        role, channel = self._decode(role_ids), self._decode(channel_ids)
        if "to=" in role or "to=" in channel:
            return None  # addressed to a tool
        if role.strip() not in ("", "assistant"):
            return None  # a turn of another role the model went on to write
        if part == "role":  # no <|channel|>: a message without a channel is the answer
            return "content"
        words = channel.split()
        name = words[0] if words else ""
        return {"final": "content", "analysis": "reasoning"}.get(name)

    # -- what a client sees -----------------------------------------------------------------------------
    @property
    def plain(self) -> bool:
        return self.state == _PLAIN

    def _text(self, kind: str) -> str:
        parts = list(self._closed[kind])
        if self._target == kind:
            open_text = self._decode(self._body)
            if open_text:
                parts.append(open_text)
        return JOIN.join(parts)

    def _stopped(self, text: str, finished: bool) -> str:
        if not self._stops:
            return text
        cut = find_stop(text, self._stops, 0)
        if cut is not None:
            return text[:cut]
        return text if finished else releasable(text, self._stops)

    def result(self, engine_text: str, finished: bool) -> tuple:
        """(content, reasoning) so far. `engine_text`: the engine's text of the reply (special tokens dropped,
        stop strings applied), which is the content of a plain reply; a reply still undecided at its end is
        plain."""
        if self.state == _PLAIN or (finished and self.state == _LEAD):
            return engine_text, ""
        if self.state == _LEAD:
            return "", ""
        return self._stopped(self._text("content"), finished), self._stopped(self._text("reasoning"), finished)


def parse(tokens: HarmonyTokens, decode: Callable[[list], str], token_ids: Sequence[int],
          engine_text: Optional[str] = None) -> tuple:
    """(content, reasoning) of a whole reply; `engine_text` defaults to decode(token_ids)."""
    parser = HarmonyParser(tokens, decode)
    parser.feed(token_ids)
    return parser.result(decode(list(token_ids)) if engine_text is None else engine_text, True)
