"""Guided decoding offline (LLM + SamplingParams.guided_decoding) on the random-weight tiny preset:
clear ValueErrors for what cannot compile, one compile per grammar text, and n-gram speculation
under a grammar: drafts the grammar forbids end the draft, accepted ones advance the matcher, and
the output is token for token the output without speculation."""

import re

import pytest

from fastdeploy import LLM, GuidedDecodingParams, SamplingParams
from scripted_proposer import ScriptedProposer, always_right, oracle_truth

ENGINE = dict(block_size=16, max_model_len=256, num_gpu_blocks_override=64)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
DIGITS = r"[0-9]{4}-[0-9]{4}-[0-9]{4}"
LETTER_X = ord("x") + 3  # the byte tokenizer's id of "x": never a digit or "-"
PROMPTS = ["card number:", [5, 6, 7, 8, 9]]


def _truth(plain):
    """The oracle's token at each output index (an end token past its end, never reached)."""
    oracle = oracle_truth(plain)
    return lambda request, i: oracle(request, i) if i < len(plain[tuple(request.prompt_token_ids)]) else 2


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=DIGITS), **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def plain(llm):
    """Greedy outputs without speculation: the oracle."""
    return {tuple(o.prompt_token_ids): o.outputs.token_ids
            for o in llm.generate(PROMPTS, _params(), use_tqdm=False)}


@pytest.mark.parametrize("guided,named", [
    (GuidedDecodingParams(regex="[0-9"), "guided_regex"),
    (GuidedDecodingParams(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "guided_json"),
    (GuidedDecodingParams(grammar="start: missing_rule"), "guided_grammar"),
    (GuidedDecodingParams(regex="a", choice=["a"]), "exactly one"),
    (GuidedDecodingParams(structural_tag="{}"), "structural_tag"),
])
def test_a_constraint_that_cannot_compile_raises_a_clear_value_error(llm, guided, named):
    with pytest.raises(ValueError, match=named):
        llm.generate(["x"], SamplingParams(max_tokens=4, guided_decoding=guided), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_is_compiled_once_and_each_request_gets_its_own_matcher(llm):
    backend = llm.engine.guided
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, guided_decoding=GuidedDecodingParams(json=schema))
    misses, hits = backend.cache_misses, backend.cache_hits
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert (backend.cache_misses - misses, backend.cache_hits - hits) == (1, 2)
    assert all(re.fullmatch(r'\{"n":[0-9]\}', o.outputs.text) for o in outs), [o.outputs.text for o in outs]


def test_drafts_the_grammar_forbids_end_the_draft_and_the_output_is_unchanged(plain):
    llm = LLM(speculative_config=SPEC, **ENGINE)
    scripted = ScriptedProposer(_truth(plain), lambda r, k: 0, lambda t: LETTER_X)  # every draft wrong
    llm.engine.scheduler.proposer = scripted  # the scheduler cuts its drafts at the grammar
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.outputs.token_ids for o in outs] == [plain[tuple(o.prompt_token_ids)] for o in outs]
    assert scripted.proposed > 0
    assert llm.engine.scheduler.spec_decode_num_draft_tokens_total == 0  # none reached the model


def test_accepted_drafts_advance_the_matcher_and_the_output_is_unchanged(plain):
    llm = LLM(speculative_config=SPEC, **ENGINE)
    # Right drafts, then (where k allows) a wrong one the grammar permits: "0" is a digit.
    right_then_digit = ScriptedProposer(_truth(plain), lambda r, k: max(0, k - 1),
                                        lambda t: ord("0") + 3 if t != ord("0") + 3 else ord("1") + 3)
    llm.engine.scheduler.proposer = right_then_digit
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.outputs.token_ids for o in outs] == [plain[tuple(o.prompt_token_ids)] for o in outs]
    scheduler = llm.engine.scheduler
    assert scheduler.spec_decode_num_accepted_tokens_total > 0
    assert scheduler.spec_decode_num_draft_tokens_total > scheduler.spec_decode_num_accepted_tokens_total


def test_all_right_drafts_under_a_grammar_match_plain_decoding(plain):
    llm = LLM(speculative_config=SPEC, **ENGINE)
    llm.engine.scheduler.proposer = ScriptedProposer(_truth(plain), always_right, lambda t: t)
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert [o.outputs.token_ids for o in outs] == [plain[tuple(o.prompt_token_ids)] for o in outs]
    assert all(re.fullmatch(DIGITS, o.outputs.text) for o in outs)


def test_backend_off_rejects_constrained_requests_and_xgrammar_is_named():
    llm = LLM(guided_decoding_backend="off", **ENGINE)
    with pytest.raises(ValueError, match="guided decoding is off"):
        llm.generate(["x"], _params(), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs.token_ids
    with pytest.raises(ValueError, match="torch"):
        LLM(guided_decoding_backend="xgrammar", **ENGINE)


def test_when_the_masks_cannot_be_computed_only_the_constrained_requests_fail(llm, monkeypatch):
    """llguidance failing in the background thread (here: made to raise) ends that step's constrained
    requests alone; a free request in the same batch keeps its tokens, and the next constrained request
    is served once the masks work again."""
    from fastdeploy.model_executor.guided_decoding import masks

    free = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(["free prompt"], free, use_tqdm=False)[0].outputs.token_ids

    def broken(executor, work):
        raise RuntimeError("planted mask failure")

    monkeypatch.setattr(masks, "_compute", broken)
    constrained, mate = llm.generate(["card number:", "free prompt"], [_params(), free], use_tqdm=False)
    assert mate.outputs.token_ids == alone
    assert not re.fullmatch(DIGITS, constrained.outputs.text)  # ended at once, with no token
    assert len(constrained.outputs.token_ids) == 0 and constrained.outputs.finish_reason == "abort"
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    again = llm.generate(["card number:"], _params(), use_tqdm=False)[0]
    assert re.fullmatch(DIGITS, again.outputs.text)
