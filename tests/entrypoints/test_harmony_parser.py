"""The harmony reply parser (fastdeploy/input/harmony_parser.py) on token sequences: gpt-oss's final channel is
a chat reply's content, its analysis channel the reasoning_content, commentary (tool calls) neither, markup
never in either; a reply without markup passes through; a stream read token by token gives, at every cut,
a prefix of what the whole reply gives. The vocabulary here is byte-level (one id per UTF-8 byte) plus the
harmony markers as special tokens, so a character can be split across tokens as in a real BPE vocabulary.
The served path (the api_server's /v1/chat/completions) is in test_family_chat_templates.py."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints.openai.protocol import ChatMessageOut
from fastdeploy.entrypoints.openai.serving_completion import IncrementalText
from fastdeploy.input.harmony_parser import (LEAD_LIMIT, HarmonyParser, HarmonyTokens, end_stops_replies, harmony_for,
                                             parse)

SPECIALS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>",
            "<|endoftext|>"]
BYTE0 = 16  # byte b is id BYTE0 + b


class ByteHarmonyTokenizer:
    """UTF-8 bytes plus special tokens, with the engine tokenizer's interface (decode drops the specials)."""

    def __init__(self, specials=SPECIALS):
        self.ids = {s: i for i, s in enumerate(specials)}

    def encode(self, text: str) -> list:
        out, i = [], 0
        while i < len(text):
            special = next((s for s in self.ids if text.startswith(s, i)), None)
            if special:
                out.append(self.ids[special])
                i += len(special)
            else:
                out.extend(BYTE0 + b for b in text[i].encode("utf-8"))
                i += 1
        return out

    def decode(self, ids: list) -> str:
        return bytes(i - BYTE0 for i in ids if i >= BYTE0).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int):
        if token_id < BYTE0:
            return next((s for s, i in self.ids.items() if i == token_id), None)
        return chr(token_id - BYTE0)


TOK = ByteHarmonyTokenizer()
TOKENS = HarmonyTokens.of(TOK)


def run(text: str, stops=None) -> tuple:
    ids = TOK.encode(text)
    parser = HarmonyParser(TOKENS, TOK.decode, stops)
    parser.feed(ids)
    return parser.result(TOK.decode(ids), True)


def test_markers_are_found_by_id_and_required():
    assert (TOKENS.start, TOKENS.channel, TOKENS.message, TOKENS.end, TOKENS.return_, TOKENS.call,
            TOKENS.constrain) == tuple(range(7))
    assert HarmonyTokens.of(ByteHarmonyTokenizer(["<|start|>", "<|channel|>", "<|message|>", "<|return|>"])) is None
    optional_missing = HarmonyTokens.of(ByteHarmonyTokenizer(SPECIALS[:5]))
    assert optional_missing is not None and optional_missing.call is None and optional_missing.constrain is None


def test_analysis_then_final():
    content, reasoning = run("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                             "<|start|>assistant<|channel|>final<|message|>Hello! ¿Qué tal? 東京<|return|>")
    assert (content, reasoning) == ("Hello! ¿Qué tal? 東京", "The user greets; answer briefly.")


def test_final_only():
    assert run("<|channel|>final<|message|>Just the answer.<|return|>") == ("Just the answer.", "")


def test_plain_text_without_markup_passes_through():
    for text in ("A plain answer, no channels.", "Short<|return|>", "x", "Plain but ends <|endoftext|>"):
        ids = TOK.encode(text)
        parser = HarmonyParser(TOKENS, TOK.decode)
        parser.feed(ids)
        engine_text = TOK.decode(ids)
        assert parser.result(engine_text, True) == (engine_text, "")
    # the engine's own text is what a plain reply shows (its stop-string cut included), once known to be plain
    parser = HarmonyParser(TOKENS, TOK.decode)
    parser.feed(TOK.encode("y" * LEAD_LIMIT))
    assert parser.plain and parser.result("engine's text", False) == ("engine's text", "")


def test_a_message_without_a_channel_is_content():
    assert run("<|message|>No channel here.<|end|>") == ("No channel here.", "")


def test_end_then_start_assistant_final_and_stopping_at_end():
    whole = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>answer<|end|>"
             "<|start|>assistant<|channel|>final<|message|>more<|return|>")
    assert run(whole) == ("answer\nmore", "think")
    # generation stopped at an <|end|> (a checkpoint whose end tokens list it): the final text so far
    assert run("<|channel|>analysis<|message|>think<|end|>") == ("", "think")
    assert run("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>ans<|end|>") \
        == ("ans", "think")
    # cut by max_tokens in the middle of a header or a body
    assert run("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>fin") == ("", "think")
    assert run("<|channel|>analysis<|message|>thi") == ("", "thi")


def test_commentary_and_tool_calls_go_to_neither_field():
    reply = ("<|channel|>analysis<|message|>Need weather.<|end|>"
             "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
             "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
             '<|message|>{"city": "Paris"}<|call|>')
    assert run(reply) == ("", "Need weather.")
    # the recipient in the role part of the header, before <|channel|> (within LEAD_LIMIT tokens)
    assert run(' to=functions.f<|channel|>commentary <|constrain|>json<|message|>{"x": 1}<|call|>') \
        == ("", "")
    # an analysis message to a built-in tool is no reasoning either; a turn of another role is not content
    assert run("<|channel|>analysis to=browser.search<|message|>{}<|call|>") == ("", "")
    assert run("<|channel|>final<|message|>Hi<|end|><|start|>user<|message|>and then?<|end|>") == ("Hi", "")
    for part in run(reply):
        assert "<|" not in part and "commentary" not in part and "functions" not in part


def test_markup_written_as_text_stays_text():
    """Markers are ids: the characters "<|channel|>" spelt out by the model are plain text of the message."""
    ids = TOK.encode("<|channel|>final<|message|>") + [BYTE0 + b for b in b"say <|channel|> literally"] \
        + [TOKENS.return_]
    assert parse(TOKENS, TOK.decode, ids) == ("say <|channel|> literally", "")


def test_stop_strings_end_each_part():
    assert run("<|channel|>analysis<|message|>a STOP b<|end|>", stops=["STOP"]) == ("", "a ")
    assert run("<|channel|>final<|message|>one. two.", stops=[" two"]) == ("one.", "")


STREAMS = [
    "<|channel|>analysis<|message|>Thinking about 東京 — ☀️ naïve<|end|><|start|>assistant<|channel|>final"
    "<|message|>Привет, São Paulo 🌎<|return|>",
    "<|channel|>final<|message|>Only final ✓<|return|>",
    "Plain answer, ümlaut and 🌎 without any markup at all, long enough to pass the lead",
    "Plain<|return|>",
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
    '<|message|>{"k": "é"}<|call|>',
    "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
    "<|start|>assistant<|channel|>final<|message|>done<|return|>",
]


@pytest.mark.parametrize("text", STREAMS)
def test_a_stream_cut_at_every_token_gives_the_whole_result(text):
    ids = TOK.encode(text)
    whole = parse(TOKENS, TOK.decode, ids)
    for feed_size in (1, 2, 3):
        parser = HarmonyParser(TOKENS, TOK.decode)
        streamed = [IncrementalText(), IncrementalText()]
        joined = ["", ""]
        for end in list(range(feed_size, len(ids), feed_size)) + [len(ids)]:
            parser.feed(ids[:end])
            finished = end == len(ids)
            parts = parser.result(TOK.decode(ids[:end]), finished)
            for k in range(2):
                # what a client may be shown so far is a prefix of the whole reply's part
                assert whole[k].startswith(parts[k].rstrip("\ufffd")), (end, parts, whole)
                joined[k] += streamed[k].delta(parts[k], finished)
        assert tuple(joined) == whole
        assert all("\ufffd" not in part for part in whole)


def test_harmony_is_chosen_by_the_flag_or_a_gpt_oss_checkpoint():
    plain_vocab = ByteHarmonyTokenizer(["<|endoftext|>"])
    assert harmony_for(None, ["GptOssForCausalLM"], TOK) == TOKENS
    assert harmony_for(None, ["MistralForCausalLM"], TOK) is None
    assert harmony_for(None, ["GptOssForCausalLM"], plain_vocab) is None
    assert harmony_for("harmony", ["MistralForCausalLM"], TOK) == TOKENS
    with pytest.raises(ValueError, match=r"<\|start\|>.*<\|return\|>"):
        harmony_for("harmony", ["GptOssForCausalLM"], plain_vocab)
    with pytest.raises(ValueError, match="unknown parser"):
        harmony_for("deepseek_r1", ["GptOssForCausalLM"], TOK)
    # gpt-oss's generation_config ends replies at <|return|>, <|endoftext|>, <|call|>: <|end|> is not among them
    assert not end_stops_replies(TOKENS, (TOKENS.return_, TOK.ids["<|endoftext|>"], TOKENS.call))
    assert end_stops_replies(TOKENS, (TOKENS.return_, TOKENS.end))


def test_a_reply_without_reasoning_serializes_as_before():
    assert ChatMessageOut(content="hi").model_dump() == {"role": "assistant", "content": "hi"}
    assert ChatMessageOut(content="hi", reasoning_content="").model_dump() == \
        {"role": "assistant", "content": "hi", "reasoning_content": ""}
