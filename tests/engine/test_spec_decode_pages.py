"""Pages of speculative decoding, step by step through the real scheduler and cache manager
(docs/scheduler.md, "Speculative decoding"): a rejected draft's page goes back in the same step, a sliding head's window moves
with accepted tokens only, and projected admission lets a request draft only while the running
requests' page curves still fit with it moved ahead. The test plays the model."""

import pytest

from fastdeploy.cache_manager.head_wise import dead_block_range
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from scripted_proposer import ScriptedProposer, always_right, always_wrong

FILLER, WRONG = 9, 3
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


def scheduler(make_config, mode, pattern, **args):
    cfg = make_config(mode, speculative_config=SPEC, **args)
    return ResourceManagerV1(cfg, proposer=ScriptedProposer(lambda r, i: FILLER, pattern, lambda t: WRONG))


def step(rm, accept=None):
    """One step where the model samples FILLER: `accept` drafts are accepted (None: as many as are right)."""
    batch = rm.schedule()
    sampled = []
    for s in batch.requests:
        if not s.samples:
            sampled.append(None)
        elif not s.draft_token_ids:
            sampled.append(FILLER)
        else:
            n = len(s.draft_token_ids) if accept is None else accept
            sampled.append(list(s.draft_token_ids[:n]) + [WRONG if n < len(s.draft_token_ids) else FILLER])
    rm.update_from_output(batch, sampled)
    rm.check_integrity()
    return batch


def held(rm, request):
    return len(rm.kv_cache_manager.table(request.request_id)[0])


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
@pytest.mark.parametrize("accepted,blocks_after", [(0, 2), (1, 3), (4, 3)])
def test_a_page_written_only_by_rejected_drafts_goes_back_in_the_same_step(make_config, mode, accepted,
                                                                           blocks_after):
    rm = scheduler(make_config, mode, always_right, block_size=4, num_gpu_blocks_override=32)
    rm.add_request(Request("r", [5] * 7, SamplingParams(max_tokens=20), eos_token_id=2))
    step(rm)  # prefill: 7 tokens in 2 blocks, the first output sampled
    request = rm.running[0]
    free = rm.cache_manager.num_free_pages
    batch = rm.schedule()  # position 7 plus 4 drafts at 8..11: a third block
    assert batch.requests[0].draft_token_ids == (FILLER,) * 4 and held(rm, request) == 3
    tokens = [FILLER] * accepted + [WRONG if accepted < 4 else FILLER]
    rm.update_from_output(batch, [tokens])
    rm.check_integrity()
    assert request.num_computed_tokens == 8 + accepted
    assert held(rm, request) == blocks_after  # accepted 0: positions 8..11 were all rejected
    per_block = rm.layout.slots_per_rank
    assert rm.cache_manager.num_free_pages == free - (blocks_after - 2) * per_block


def test_a_sliding_heads_window_moves_with_accepted_tokens_only(make_config):
    """Window 6, block 2: drafts reach past the point where a block would die, and are rejected; the
    block stays until accepted tokens get there."""
    swa = {"sliding_window": 6, "sink_size": 0, "swa_kv_heads": [0]}
    rm = scheduler(make_config, "head_wise_recycle_on", always_right, block_size=2, num_gpu_blocks_override=64,
                   head_wise_swa_config=swa)
    rm.add_request(Request("r", [5] * 5, SamplingParams(max_tokens=30), eos_token_id=2))
    step(rm)
    request = rm.running[0]
    for _ in range(6):
        step(rm, accept=0)  # 4 drafts written each step, all rejected: one token of progress per step
        limit = dead_block_range(request.num_computed_tokens, 6, 0, 2).stop
        assert rm.kv_cache_manager.recycled_upto("r") <= [limit]
    assert request.num_computed_tokens == 11
    # the last recycle pass ran with 10 tokens processed (the 11th was accepted after it)
    assert rm.kv_cache_manager.swa_pages_recycled_total == dead_block_range(10, 6, 0, 2).stop
    assert rm.spec_decode_num_draft_tokens_total == 24 and rm.spec_decode_num_accepted_tokens_total == 0


def test_projected_admission_lets_a_request_draft_only_while_the_curves_fit(make_config):
    """A tight cache (7 blocks of 4): the second request is admitted against the first's one-token
    curve. Drafting the first as far as its drafts could take it would overflow a future step, so the
    scheduler trims its drafts; the curves fit after every step (check_integrity) and nobody is
    preempted."""
    rm = scheduler(make_config, "1d", always_right, reserve=False, block_size=4, num_gpu_blocks_override=7,
                   max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, admission_policy="projected",
                   enable_prefix_caching=False)
    rm.add_request(Request("a", [5] * 3, SamplingParams(max_tokens=20), eos_token_id=2))
    for t in range(60):
        if t == 2:
            rm.add_request(Request("b", [5] * 3, SamplingParams(max_tokens=6), eos_token_id=2))
        step(rm)
        if not rm.has_unfinished_requests():
            break
    assert rm.num_preemptions_total == 0
    assert rm.spec_decode_num_accepted_tokens_total > 0


def test_drafts_never_run_past_max_tokens(make_config):
    rm = scheduler(make_config, "1d", always_right, block_size=4, num_gpu_blocks_override=32)
    rm.add_request(Request("r", [5] * 3, SamplingParams(max_tokens=4), eos_token_id=2))
    step(rm)
    batch = step(rm)
    assert batch.requests[0].draft_token_ids == (FILLER,) * 2  # 3 tokens left: 2 drafts + the bonus
    assert rm.requests == {} and rm.cache_manager.num_free_pages == rm.cache_manager.num_total_pages


def test_no_drafts_where_none_are_proposed_or_needed(make_config):
    rm = scheduler(make_config, "1d", always_wrong, block_size=4, num_gpu_blocks_override=32)
    rm.add_request(Request("r", [5] * 3, SamplingParams(max_tokens=1), eos_token_id=2))
    batch = step(rm)  # the prefill samples the only token
    assert batch.requests[0].draft_token_ids == () and rm.requests == {}


def test_verified_tokens_that_do_not_start_with_the_drafts_are_refused(make_config):
    rm = scheduler(make_config, "1d", always_right, block_size=4, num_gpu_blocks_override=32)
    rm.add_request(Request("r", [5] * 3, SamplingParams(max_tokens=10), eos_token_id=2))
    step(rm)
    batch = rm.schedule()
    with pytest.raises(ValueError, match="do not start with the accepted drafts"):
        rm.update_from_output(batch, [[WRONG, FILLER]])
    with pytest.raises(ValueError, match="not the list of its verified tokens"):
        rm.update_from_output(batch, [FILLER])
