"""Stop strings and incremental detokenization through the real engine, against text computed here.

The tiny preset's random weights cannot be asked for a particular text, so most tests replace the
sampler with a script (the model still runs every step; only the token choice is fixed). The preset
uses the byte-level tokenizer (token = byte + 3), so one token is one UTF-8 byte and multi-byte
characters arrive split across steps. Expected outputs come from `bytes.decode` and `str.find`, not
from the engine's stop_strings.py or tokenizer code.
"""

import pytest

import fastdeploy.engine.step_runner as step_runner
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import SamplingParams
from fastdeploy.engine.stop_strings import find_stop
from scripted_proposer import ScriptedProposer, always_right


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_engine_args(EngineArgs(block_size=16, num_gpu_blocks_override=64, max_model_len=256))


FILLER = "~"  # what a script samples once its text is used up


def byte_tokens(text):
    return [b + 3 for b in text.encode("utf-8")]


@pytest.fixture
def script(monkeypatch):
    """script(request_id, text): that request samples the bytes of `text`, one per step, then FILLER."""
    scripts = {}

    def scripted_sample(logits, request, eos_token_id, banned=None):
        tokens, n = scripts[request.request_id], len(request.output_token_ids)
        return (tokens[n] if n < len(tokens) else byte_tokens(FILLER)[0]), None

    monkeypatch.setattr(step_runner, "sample_one", scripted_sample)
    return lambda rid, text: scripts.__setitem__(rid, byte_tokens(text))


def generate(engine, rid, max_tokens, **params):
    """Run one request; (final output, every text a client was shown before it)."""
    # temperature 1 sends every token through sample_one (greedy ones take a batched shortcut).
    engine.add_request(rid, [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                                                      **params))
    shown, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
            else:
                shown.append(out.outputs.text)
    return final, shown


def expected(text, stops, max_tokens):
    """(text, finish_reason, tokens generated): the earliest stop string whose last byte is within
    the first max_tokens bytes ends the output before it; else the output is cut at max_tokens bytes."""
    data = text.encode("utf-8")
    best = None
    for s in stops:
        i = text.find(s)
        while i >= 0:
            end = len(text[:i + len(s)].encode("utf-8"))
            if end <= max_tokens:
                if best is None or i < best[0]:
                    best = (i, end)
                break
            i = -1
    if best is not None:
        return text[:best[0]], "stop", best[1]
    return data[:max_tokens].decode("utf-8", errors="replace"), "length", max_tokens


def assert_run(engine, script, rid, text, stops, max_tokens):
    script(rid, text)
    out, shown = generate(engine, rid, max_tokens, stop=stops)
    want_text, want_reason, want_tokens = expected(text + FILLER * max_tokens, stops, max_tokens)
    assert (out.outputs.text, out.outputs.finish_reason) == (want_text, want_reason)
    assert len(out.outputs.token_ids) == want_tokens
    for seen in shown:
        # What was shown is never taken back (a half character, U+FFFD, may be completed later).
        assert want_text.startswith(seen.rstrip("\ufffd")), (seen, want_text)
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    return out, shown


def test_a_length_finished_output_keeps_its_tail_that_looks_like_a_stop_string(engine, script):
    # 'c' * 9 could grow into 'cx' at every step; once the request ends nothing more can come.
    out, _ = assert_run(engine, script, "len", "b" + "c" * 20, ["cx"], max_tokens=10)
    assert out.outputs.text == "bccccccccc"


def test_a_length_finished_output_keeps_its_tail_with_the_real_model(engine):
    # No script: a +100 logit bias makes the model emit 'c' every step.
    engine.add_request("real", [5, 6, 7], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                                         logit_bias={3 + ord("c"): 100.0}, stop=["cd"]))
    final = None
    while engine.has_unfinished_requests():
        final = [o for o in engine.step() if o.finished] or final
    assert final[0].outputs.text == "c" * 7 and final[0].outputs.finish_reason == "length"


def test_a_stop_string_completed_by_the_last_allowed_token_wins_over_length(engine, script):
    out, _ = assert_run(engine, script, "last", "abcd", ["cd"], max_tokens=4)
    assert (out.outputs.text, out.outputs.finish_reason) == ("ab", "stop")


@pytest.mark.parametrize("text,stops", [
    ("aé b", ["é"]),               # 2-byte stop string: its first byte alone decodes to U+FFFD
    ("xx日本語yy", ["本"]),          # 3-byte stop string inside 3-byte neighbours
    ("ab日本語", ["日本"]),           # a stop string of two 3-byte characters
    ("ok🙂 done", ["🙂 d"]),         # 4-byte character then ASCII
    ("éé!", ["é!"]),               # the stop string begins with the second of two equal characters
    ("naïve café", ["fé", "zz"]),   # several stop strings, only one present
])
def test_multi_byte_stop_strings_end_the_output_where_they_begin(engine, script, text, stops):
    out, _ = assert_run(engine, script, "mb", text, stops, max_tokens=len(text.encode()) + 3)
    assert out.outputs.finish_reason == "stop"


def test_multi_byte_output_without_stop_strings_decodes_like_bytes(engine, script):
    text = "über 日本 🙂!"
    script("plain", text)
    out, shown = generate(engine, "plain", max_tokens=len(text.encode()))
    assert out.outputs.text == text and out.outputs.finish_reason == "length"
    n = len(shown) + 1
    assert n == len(text.encode())
    # Each intermediate text is exactly the bytes so far, decoded (a partial character as U+FFFD).
    data = text.encode()
    assert shown == [data[:k].decode("utf-8", errors="replace") for k in range(1, n)]


def test_a_multi_byte_character_cut_by_max_tokens_ends_as_a_replacement_character(engine, script):
    out, _ = assert_run(engine, script, "cut", "ab日", ["zz"], max_tokens=4)
    assert out.outputs.text == "ab\ufffd"


def test_the_earliest_occurrence_wins_when_one_step_brings_a_stop_string_twice():
    # A subword token can carry several characters: "abab" arriving at once holds "ab" twice.
    assert find_stop("xabab", ["ab"], checked=1) == 1
    assert find_stop("xabab", ["ab", "b"], checked=1) == 1


def test_a_stop_string_completed_before_min_tokens_is_shown_at_once(engine, script):
    # "ab" ends at the 3rd token, before min_tokens = 6: it does not stop the request and, as it can
    # never stop it later, nothing is held back for it.
    script("early", "xab" + "y" * 10)
    out, shown = generate(engine, "early", max_tokens=8, stop=["ab"], min_tokens=6)
    assert (out.outputs.text, out.outputs.finish_reason) == ("xab" + "y" * 5, "length")
    assert shown == ["x", "x", "xab", "xaby", "xabyy", "xabyyy", "xabyyyy"]


# -- with speculation: whole stop strings arrive inside one step's run of accepted drafts -----------------

@pytest.fixture(scope="module")
def speculating_engine():
    return LLMEngine.from_engine_args(EngineArgs(block_size=16, num_gpu_blocks_override=64, max_model_len=256,
                                                 speculative_config={"method": "ngram", "num_speculative_tokens": 5}))


@pytest.mark.parametrize("text,stops,max_tokens", [
    ("hello world, bye", ["world"], 20),   # a stop string wholly inside one step's accepted run
    ("aé b", ["é"], 8),                    # multi-byte: cut where the character begins
    ("ab日本語", ["日本"], 12),
    ("abcd", ["cd"], 4),                   # completed by the last allowed token: stop wins over length
    ("b" + "c" * 20, ["cx"], 10),          # never completed: the length finish keeps the tail
])
def test_stop_strings_inside_accepted_drafts_end_the_output_where_plain_decoding_does(
        speculating_engine, script, text, stops, max_tokens):
    truth = byte_tokens(text + FILLER * max_tokens)
    speculating_engine.scheduler.proposer = ScriptedProposer(lambda r, i: truth[i], always_right,
                                                             wrong=lambda t: t + 1)
    assert_run(speculating_engine, script, f"spec-{text}", text, stops, max_tokens)
    assert speculating_engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_a_stop_string_inside_accepted_drafts_before_min_tokens_does_not_stop(speculating_engine, script):
    text = "xab" + "y" * 10
    truth = byte_tokens(text)
    speculating_engine.scheduler.proposer = ScriptedProposer(lambda r, i: truth[i], always_right,
                                                             wrong=lambda t: t + 1)
    script("spec-early", text)
    out, _ = generate(speculating_engine, "spec-early", max_tokens=8, stop=["ab"], min_tokens=6)
    assert (out.outputs.text, out.outputs.finish_reason) == ("xab" + "y" * 5, "length")
