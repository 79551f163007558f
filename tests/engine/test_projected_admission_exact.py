"""Projected admission, exactly: the curve of a request, its claim, and the admission and chunk
decisions at the slack boundary, each checked against numbers worked out by hand (in the comments).

Every scenario uses block size 4 and 4 KV heads on one rank, so "units" below are pages x 4 (the
slack and the claims are kept in pages x block_size). A head that recycles (window W, sink 0) holds
at most `live` pages in any one-token step: 3 for W = 8, 2 for W = 5 (the dead blocks at n are
max(0, n - W + 1) // 4; e.g. W = 8: m = 12 needs ceil(13/4) - 5 // 4 = 3; W = 5: m = 8 needs 3 - 1 = 2).
"""

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.envs import override

BS = 4


def manager(blocks, swa_heads=(0, 1, 2, 3), window=8, head_wise="1", **kwargs):
    swa = {"sliding_window": window, "sink_size": 0, "swa_kv_heads": list(swa_heads)}
    with override(FD_HEAD_WISE_KV_CACHE=head_wise, FD_HEAD_WISE_SWA_RECYCLE="1", FD_ADMISSION_POLICY="projected",
                  FD_RESERVE_OUTPUT_PAGES="1"):
        config = EngineArgs(block_size=BS, num_gpu_blocks_override=blocks, max_model_len=64,
                            head_wise_swa_config=swa, **kwargs).create_engine_config()
    rm = ResourceManagerV1(config)
    assert rm.layout.slots_per_rank == 4 and rm.layout.tensor_parallel_size == 1  # what the arithmetic assumes
    return rm


def request(rid, tokens, max_tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def step(rm):
    batch = fake_step(rm, check=True)
    assert all(type(s.num_tokens) is int for s in batch.requests)  # token counts index tables and tensors
    return [(s.request.request_id, s.start, s.num_tokens) for s in batch.requests]


# -- the curve and its claim -----------------------------------------------------------------------
# Head 0 recycles (W = 8, live 3), heads 1-3 keep every page: (f, r) = (3, 1). A request with a
# 10-token prompt and 7 output tokens: positions 0..15 are ever cached (the 7th sampled token is not),
# so its last one-token step computes position 15 with a table of ceil(16/4) = 4 blocks: peak 16.
# The linear decode bound n + 4 is 19 there, 3 above: rounding 3. A recycling head's bound y is
# 4 * min(4 blocks, live 3) = 12.

def test_a_prefilling_curve_has_one_step_per_token_left_and_the_last_steps_table_flat():
    rm = manager(16, swa_heads=[0])
    r = request("a", range(3, 13), 7)
    assert rm.admission.curves.curve(r, 0) == (16, 16, 12, False, 0)  # 16 one-token steps: positions 0..15
    assert rm.admission.curves.curve(r, 5) == (11, 16, 12, False, 0)  # positions 5..15
    assert rm.admission.curves.curve(r, 8) == (8, 16, 12, False, 0)   # positions 8..15 (n = 9 would be decoding)
    assert rm.admission.curves.claim(rm.admission.curves.curve(r, 5)) == [3 * 16 + 12]
    # One output more: the last step computes position 16, a table of ceil(17/4) = 5 blocks: peak 20.
    longer = request("b", range(3, 13), 8)
    assert rm.admission.curves.curve(longer, 0) == (17, 20, 12, False, 0)


def test_a_decoding_curve_starts_at_n_plus_a_block_and_is_capped_at_the_last_steps_table():
    rm = manager(16, swa_heads=[0])
    r = request("a", range(3, 13), 7)
    # o outputs so far: decoding at n = 9 + o, 7 - o steps left (positions n..15), x = n + 4.
    # Claim U(0) = 3 * min(x, 16) + 12: capped once the steps left (7 - o) are at most the rounding 3.
    expected = {0: ((7, 13, 12, True, 3), 3 * 13 + 12),
                2: ((5, 15, 12, True, 3), 3 * 15 + 12),
                3: ((4, 16, 12, True, 3), 3 * 16 + 12),   # steps = rounding + 1: x itself, not capped
                4: ((3, 17, 12, True, 3), 3 * 16 + 12),   # steps = rounding: capped at 16, not 17
                6: ((1, 19, 12, True, 3), 3 * 16 + 12)}
    for o in range(7):
        curve = rm.admission.curves.curve(r, r.num_tokens - 1)
        if o in expected:
            assert (curve, rm.admission.curves.claim(curve)) == (expected[o][0], [expected[o][1]]), o
        r.append_output(9)


def test_the_curve_counts_exactly_the_steps_left_at_one_token_per_step():
    """Brute force: with one token of budget per step, the request finishes after exactly `steps`
    more steps from every state, and its pages at each of them stay within U(t)."""
    rm = manager(16, swa_heads=[0], max_num_batched_tokens=1)
    r = request("a", range(3, 13), 7)
    rm.add_request(r)
    seen = []
    while rm.has_unfinished_requests():
        curve = rm.admission.curves.curve(r, r.num_computed_tokens)
        step(rm)
        held = rm.kv_cache_manager.held_pages_per_slot("a") if not r.is_finished else None
        seen.append((curve, held))
    assert len(seen) == 16
    for i, (curve, held) in enumerate(seen):
        steps, x, y, decoding, rounding = curve
        assert steps == 16 - i
        if held is not None:
            assert 3 * BS * max(held[1:]) + BS * held[0] <= rm.admission.curves.claim(curve)[0]


def test_the_fit_check_sees_the_peak_just_before_the_longest_curves_end_though_a_short_one_follows():
    """Full heads only (1-D cache), block 4. Three requests decoding at n = 20 with 12 steps left
    (prompt 21, 12 outputs: last position 31, a 32-token table, rounding 24 + 11 - 32 = 3) each need
    U(t) = 4 * min(24 + t, 32); a request prefilling at n = 9 with 3 steps left (prompt 11, 2 outputs:
    last position 11, a 12-token table) needs 4 * 12. Summed by hand: 4 * (3 * (24 + t) + 12) for
    t < 3 (at most 360), then 4 * 3 * min(24 + t, 32), 384 from t = 8 to 11. So 384 units fit and
    383 do not, though at the short curve's end the sum is only 360."""
    rm = manager(16, head_wise="0")
    decoding = rm.admission.curves.curve(request("d", range(3, 24), 12), 20)
    prefilling = rm.admission.curves.curve(request("p", range(3, 14), 2), 9)
    assert (decoding, prefilling) == ((12, 24, 0, True, 3), (3, 12, 0, False, 0))
    curves = [decoding] * 3 + [prefilling]
    assert rm.admission.curves.fit(curves, [384]) and not rm.admission.curves.fit(curves, [383])


# -- admission at the slack boundary ---------------------------------------------------------------
# Every head recycles with W = 8, live 3: (f, r) = (0, 4), so a claim is 4 * y and curves are flat.
# r1 (prompt 2, 20 outputs) runs first; one step later it decodes at n = 2 and claims
# 4 * 4 * min(ceil(21/4), 3) = 48 units. Newcomers with prompts of 8 or 16 (10 outputs) claim 48
# too; their whole first chunk needs, at n = 0, 4 heads x ceil(len/4) pages: 32 units for 8 tokens,
# 64 for 16. A 1-token request (1 output) claims 4 * 4 * 1 = 16 and its chunk needs 16.
# Where a newcomer waits on pages and chunks cut to the window (8 tokens) would admit it, the step's
# chunks are cut (the chunk rule, PageLayout.chunk_for); otherwise a 16-token prompt runs whole.

def run_two_newcomers(blocks, prompt_len):
    rm = manager(blocks, enable_prefix_caching=False)
    rm.add_request(request("r1", [3, 4], 20))
    assert step(rm) == [("r1", 0, 2)]
    rm.add_request(request("n", range(10, 10 + prompt_len), 10))
    rm.add_request(request("n2", [50], 1))
    return rm, step(rm)


def test_chunks_are_cut_to_the_window_when_that_admits_the_second_newcomer_too():
    # 7 blocks = 112 units; slack 112 - 48 = 64. Uncapped, n's 16-token chunk would need all 64 and
    # n2 would wait; capped at W = 8 it needs 32 <= its claim 48 and borrows nothing, leaving
    # 112 - 48 - 48 = 16: exactly n2's claim and chunk (16 > 16 is false), so both are admitted.
    rm, batch = run_two_newcomers(7, 16)
    assert rm.max_chunk == 8
    assert batch == [("r1", 2, 1), ("n", 0, 8), ("n2", 0, 1)]
    assert rm.admission.curves.slack == [0]
    assert not rm.waiting


def test_a_newcomer_whose_whole_prompt_would_not_fit_the_slack_is_admitted_with_a_window_sized_chunk():
    # 6 blocks = 96 units; slack 96 - 48 = 48: n's claim 48 fits and so does its capped first chunk
    # (32), where the whole 16-token chunk (64 > 48) kept it waiting. n2 (claim 16) finds 0 left.
    rm, batch = run_two_newcomers(6, 16)
    assert batch == [("r1", 2, 1), ("n", 0, 8)]
    assert rm.admission.curves.slack == [0]
    assert [r.request_id for r in rm.waiting] == ["n2"]
    # Next step no block of n is dead yet ((8 - 8 + 1) // 4 = 0): 8 more tokens would need 4 x 4 pages =
    # 64 units beyond its claim 48 with no slack, so the chunk shrinks to 4 tokens (4 x 3 pages = 48).
    assert step(rm) == [("r1", 3, 1), ("n", 8, 4)]


def test_a_chunk_within_its_own_claim_takes_no_slack_so_the_next_newcomer_fits_exactly():
    # 7 blocks: n's 8-token chunk needs 32 <= its claim 48, so it borrows nothing: slack
    # 112 - 48 - 48 = 16, exactly n2's claim and chunk, which is admitted (16 > 16 is false): 0 left.
    rm, batch = run_two_newcomers(7, 8)
    assert batch == [("r1", 2, 1), ("n", 0, 8), ("n2", 0, 1)]
    assert rm.admission.curves.slack == [0]
    assert not rm.waiting


def test_a_running_chunk_shrinks_to_one_token_when_two_would_need_a_page_nobody_left():
    """W = 5 (live 2), every head recycles, 3 blocks = 48 units, chunk budget 8. b (prompt 1,
    3 outputs) claims 4 * 4 * 1 = 16; a (prompt 9, 2 outputs) claims 4 * 4 * min(3, 2) = 32, and its
    first chunk, 7 tokens (8 - b's 1), needs 2 blocks per head = 32: admitted with slack 0 left.
    Next step a is at n = 7 with 2 tokens left: [7, 9) needs ceil(9/4) = 3 blocks per head (nothing
    is dead before n = 8), 48 units > its claim 32 + slack 0; one token, [7, 8), needs 2 blocks = 32:
    the chunk is 1 token and b keeps running (growing a to 3 blocks would have preempted b)."""
    rm = manager(3, window=5, enable_prefix_caching=False, max_num_batched_tokens=8)
    rm.add_request(request("b", [3], 3))
    rm.add_request(request("a", range(10, 19), 2))
    assert step(rm) == [("b", 0, 1), ("a", 0, 7)]
    assert rm.admission.curves.slack == [0]
    assert step(rm) == [("b", 1, 1), ("a", 7, 1)]
    assert rm.admission.curves.slack == [0] and rm.num_preemptions_total == 0


def test_a_prefill_whose_claim_is_the_window_advances_to_the_next_block_boundary_each_step():
    """W = 5 (live 2), every head recycles, 4 blocks = 64 units, chunk budget 8. b (prompt 1, 8
    outputs) and a (prompt 16, 2 outputs) each claim 4 * 4 * 2 = 32: together the whole cache, so a's
    chunks get no slack and must fit its 2 pages per head. a's first chunk, 7 tokens, needs 2 blocks.
    At n = 7 nothing is dead yet (first window block (7 - 4) // 4 = 0): 2 blocks reach position 8,
    1 token. At n = 8 block 0 is dead: blocks 1-2 reach 12, 4 tokens; at n = 12 block 1 too: blocks 2-3 reach 16,
    the last 4 prompt tokens; then a decodes its second token and finishes."""
    rm = manager(4, window=5, enable_prefix_caching=False, max_num_batched_tokens=8)
    rm.add_request(request("b", [3], 8))
    rm.add_request(request("a", range(10, 26), 2))
    chunks = [[s for s in step(rm) if s[0] == "a"] for _ in range(5)]
    assert chunks == [[("a", 0, 7)], [("a", 7, 1)], [("a", 8, 4)], [("a", 12, 4)], [("a", 16, 1)]]
    assert rm.num_preemptions_total == 0 and "a" not in rm.requests


def test_a_cached_prefix_counts_only_the_tokens_after_it_in_the_first_chunk():
    """Full heads only (1-D cache), 6 blocks = 96 units, prefix caching on. p (12 tokens, 1 output)
    leaves 3 cached blocks. r1 (prompt 2, 10 outputs) then decodes at n = 2: positions 2..10 are
    left (9 steps), x = 6, its last table ceil(11/4) = 3 blocks: U(t) = 4 * min(6 + t, 12), claim 24.
    n shares p's first 8 tokens (2 blocks; a hit stops at (12 - 1) // 4 = 2) and adds 4: it starts at
    8 and its 4-token first chunk reaches 3 blocks, 48 units, equal to its flat claim 4 * 12
    (positions 8..11). Slack 96 - 24 = 72 >= 48 and the curves' sum peaks at 48 + 48 = 96: admitted
    with its prefix. (Had the chunk counted the cached 8 tokens too, 20 tokens from position 8
    would need 7 blocks: refused.)"""
    rm = manager(6, head_wise="0", enable_prefix_caching=True)
    rm.add_request(request("p", range(100, 112), 1))
    assert step(rm) == [("p", 0, 12)]
    rm.add_request(request("r1", [3, 4], 10))
    assert step(rm) == [("r1", 0, 2)]
    rm.add_request(request("n", list(range(100, 108)) + [200, 201, 202, 203], 1))
    assert step(rm) == [("r1", 2, 1), ("n", 8, 4)]
    assert rm.admission.curves.slack == [96 - 24 - 48]
