"""Speculative decoding through the real engine and model (tiny presets): outputs are token for token
those of plain decoding, in every memory mode, whatever the drafts, with the scheduler's integrity
checked after every step (docs/scheduler.md, "Speculative decoding").

Drafts are forced with tests/scripted_proposer.py (always right, always wrong, right up to a page
boundary or a window's kill point and wrong after it) or come from the real n-gram proposer on
prompts that repeat themselves. The tiny preset's head 0 slides (window 128, sink 16) and the
prompts run past it, so recycling happens while drafts are written and rejected.
"""

import pytest

from fastdeploy import LLM, SamplingParams
from greedy_run import MODES
from scripted_proposer import ScriptedProposer, always_right, always_wrong, boundary_hugging, oracle_truth

BLOCK = 16
MAX_TOKENS = 32
VOCAB = 256  # the presets' token ids used here stay below it
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


def prompts():
    """Varied ids (past the window of 128), and one that repeats itself so the n-gram proposer drafts."""
    varied = [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in (7, 130, 300)]
    return varied + [[40 + i % 9 for i in range(60)]]


def run(monkeypatch, mode="1d", params=None, proposer=None, spec=SPEC, engine_prompts=None, **engine_args):
    """(outputs, engine): every prompt to the end, check_integrity() after every step."""
    head_wise, recycle = MODES[mode]
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    engine_args = {"block_size": BLOCK, "max_model_len": 1024, "num_gpu_blocks_override": 512, **engine_args}
    llm = LLM(speculative_config=spec, **engine_args)
    engine = llm.engine
    if proposer is not None:
        engine.scheduler.proposer = proposer
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = engine_prompts or prompts()
    for i, p in enumerate(batch):
        engine.add_request(f"r{i}", p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.scheduler.check_integrity()
        for r in engine.scheduler.running:  # nothing a rejected draft was written to is kept
            held = len(engine.scheduler.kv_cache_manager.table(r.request_id)[0])
            assert held == -(-r.num_computed_tokens // BLOCK)
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    return [final[f"r{i}"].outputs for i in range(len(batch))], engine


def tokens(outputs):
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain():
    """Greedy tokens without speculation (1-D tables; every memory mode gives these, test_memory_modes.py)."""
    mp = pytest.MonkeyPatch()
    try:
        outputs, _ = run(mp, spec=None)
    finally:
        mp.undo()
    return {tuple(p): t for p, t in zip(prompts(), tokens(outputs))}


def scripted(oracle, pattern):
    return ScriptedProposer(oracle_truth(oracle), pattern, wrong=lambda t: (t + 1) % VOCAB)


PATTERNS = {"always_right": always_right, "always_wrong": always_wrong, "boundary": boundary_hugging(BLOCK)}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", ["ngram", *PATTERNS])
def test_greedy_outputs_are_those_of_plain_decoding_whatever_the_drafts(monkeypatch, plain, mode, pattern):
    proposer = None if pattern == "ngram" else scripted(plain, PATTERNS[pattern])
    outputs, engine = run(monkeypatch, mode, proposer=proposer)
    assert tokens(outputs) == list(plain.values())
    stats = engine.get_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens_total"], stats["spec_decode_num_accepted_tokens_total"]
    assert drafted > 0
    if pattern == "always_right":
        assert accepted == drafted
    if pattern == "always_wrong":
        assert accepted == 0
    if pattern == "boundary":
        assert 0 < accepted < drafted
    if mode == "head_wise_recycle_on":
        assert stats["swa_pages_recycled_total"] > 0
    # every emitted token is accounted for: plain decode steps plus verification steps
    assert stats["spec_decode_num_emitted_tokens_total"] == accepted + stats["spec_decode_num_drafts_total"]


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_chunked_prefill_and_preemption_keep_the_outputs(monkeypatch, plain, mode):
    """On-demand admission in a cache too small for all four: preempted requests recompute prompt and
    accepted outputs; chunks of 40 tokens share steps with verification pieces."""
    outputs, engine = run(monkeypatch, mode, proposer=scripted(plain, boundary_hugging(BLOCK)),
                          num_gpu_blocks_override=28, max_num_batched_tokens=40, admission_policy="on_demand")
    assert engine.get_stats()["num_preemptions_total"] > 0
    assert tokens(outputs) == list(plain.values())


def test_the_dense_oracle_backend_verifies_pieces_too(monkeypatch, plain):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "NATIVE_ATTN")
    outputs, _ = run(monkeypatch, "1d", proposer=scripted(plain, boundary_hugging(BLOCK)))
    assert tokens(outputs) == list(plain.values())


def test_sliding_layers_on_slots_keep_the_outputs(monkeypatch):
    """tiny-sliding-layers: 5 sliding layers (window 48) to 1 global share one lane of 12 slots; the
    sliding slots recycle while drafts are written and rejected across their window's edge."""
    args = {"model": "tiny-sliding-layers", "max_model_len": 512, "num_gpu_blocks_override": 256}
    batch = [[3 + (i * 41 + n * 13) % 250 for i in range(n)] for n in (30, 130)]
    plain_outputs, _ = run(monkeypatch, "1d", spec=None, engine_prompts=batch, **args)
    oracle = {tuple(p): t for p, t in zip(batch, tokens(plain_outputs))}
    outputs, engine = run(monkeypatch, "head_wise_recycle_on", proposer=scripted(oracle, boundary_hugging(BLOCK, (48,))),
                          engine_prompts=batch, **args)
    assert tokens(outputs) == tokens(plain_outputs)
    assert engine.get_stats()["swa_pages_recycled_total"] > 0


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2, min_tokens=6,
               max_tokens=MAX_TOKENS, ignore_eos=True, seed=1234, logprobs=2)


@pytest.mark.parametrize("pattern", ["always_right", "boundary"])
def test_seeded_sampling_gives_the_tokens_and_logprobs_of_plain_decoding(monkeypatch, pattern):
    """Each row is sampled as plain decoding samples that position (spec_decode/verify.py), so a
    seeded request's tokens and logprobs do not depend on its drafts."""
    params = SamplingParams(**SAMPLED)
    plain_outputs, _ = run(monkeypatch, "head_wise_recycle_on", params=params, spec=None)
    oracle = {tuple(p): t for p, t in zip(prompts(), tokens(plain_outputs))}
    outputs, engine = run(monkeypatch, "head_wise_recycle_on", params=params,
                          proposer=scripted(oracle, PATTERNS[pattern]))
    assert tokens(outputs) == tokens(plain_outputs)
    assert [o.logprobs for o in outputs] == [o.logprobs for o in plain_outputs]
    assert engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0


def test_a_stop_token_inside_a_run_of_accepted_drafts_ends_the_output_there(monkeypatch, plain):
    """The request ends at the first stop token even when the drafts after it were accepted too."""
    first = list(plain.values())[1]
    stop = first[10]  # the 11th token (or an earlier occurrence of the same id) ends the output
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    plain_outputs, _ = run(monkeypatch, params=params, spec=None)
    outputs, engine = run(monkeypatch, params=params, proposer=scripted(plain, always_right))
    assert tokens(outputs) == tokens(plain_outputs)
    assert len(outputs[1].token_ids) <= 11 and outputs[1].finish_reason == "stop"
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain_outputs]


def test_max_tokens_is_never_passed(monkeypatch, plain):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    outputs, _ = run(monkeypatch, params=params, proposer=scripted(plain, always_right))
    assert tokens(outputs) == [t[:7] for t in plain.values()]
    assert all(o.finish_reason == "length" for o in outputs)


def test_no_drafts_above_the_batch_size_threshold(monkeypatch, plain):
    """All four requests run from the first step to the last: a threshold of 3 keeps every step plain."""
    for threshold, drafts in ((3, False), (4, True)):
        outputs, engine = run(monkeypatch, proposer=scripted(plain, always_right),
                              spec={**SPEC, "disable_by_batch_size": threshold})
        assert tokens(outputs) == list(plain.values())
        assert (engine.get_stats()["spec_decode_num_draft_tokens_total"] > 0) == drafts
