"""ResourceManagerV1.check_integrity names each broken invariant: one corruption at a time."""

import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

# Head 0 slides with W = 17 and no sink: with 40 tokens processed its block 0 is dead.
SWA = {"sliding_window": 17, "sink_size": 0, "swa_kv_heads": [0]}


def request(rid, prompt_len, max_tokens):
    return Request(rid, [3 + (i * 7 + len(rid)) % 200 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def step(rm):
    fake_step(rm, check=True)


def broken(rm):
    with pytest.raises(AssertionError) as info:
        rm.check_integrity()
    return str(info.value)


@pytest.fixture
def running(make_config):
    """Request r (prompt 40) after two steps: 41 tokens processed, SWA block 0 recycled."""
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", num_gpu_blocks_override=32, head_wise_swa_config=SWA,
                                       enable_prefix_caching=False))
    rm.add_request(request("r", 40, 20))
    step(rm)
    step(rm)
    r = rm.requests["r"]
    assert r.num_computed_tokens == 41 and rm.kv_cache_manager.recycled_upto("r") == [1]
    assert [row[0] == -1 for row in rm.kv_cache_manager.table("r")] == [True, False, False, False]
    return rm, r


def table_of(rm, rid):
    """The KV cache manager's own table object of a request, to corrupt on purpose."""
    return rm.kv_cache_manager._tables[rid]


def test_table_corruptions_are_named(running):
    rm, r = running
    table = table_of(rm, "r")
    table.recycled_upto = [2]
    assert broken(rm) == "r: recycled up to block 2, but only blocks below 1 are dead"
    table.recycled_upto = [1]
    page = table.rows[1][0]
    table.rows[1][0] = -1
    assert broken(rm) == "r: head 1 entry 0 is -1, dead=False"
    table.rows[1][0] = page
    r.num_computed_tokens = table.num_computed = 64  # 4 blocks' worth, the table has 3 entries
    assert broken(rm) == "r: 64 tokens cached but only 3 entries"
    r.num_computed_tokens = 41
    assert broken(rm) == "r: the table records 64 computed tokens, the request 41"
    table.num_computed = 41
    rm.check_integrity()


def test_page_reference_corruptions_are_named(running):
    rm, r = running
    row = table_of(rm, "r").rows[2]
    row.append(row[0])  # one page twice in r's own table
    assert broken(rm) == f"page {row[0]} appears twice in the tables of 'r'"
    row.pop()
    taken = rm.cache_manager.allocate_gpu_blocks_head_wise([0, 0, 1, 0], "ghost")[2][0]
    row.append(taken)  # a page the cache manager records for another request
    assert broken(rm) == (f"rank 0 page {taken}: the cache manager records references {{'ghost'}}, "
                          f"block tables hold it for {{'r'}}")
    row.pop()
    rm.cache_manager.recycle_gpu_blocks_head_wise([[], [], [taken], []], "ghost")
    rm.check_integrity()


def test_a_page_shared_by_two_tables_and_repeated_in_one_is_named(make_config):
    rm = ResourceManagerV1(make_config("1d", num_gpu_blocks_override=16, head_wise_swa_config=SWA,
                                       enable_prefix_caching=False))
    rm.add_request(request("a", 8, 5))
    rm.add_request(request("b", 8, 5))
    step(rm)
    a, b = table_of(rm, "a"), table_of(rm, "b")
    b.rows[0][:] = [a.rows[0][0], a.rows[0][0]]
    assert broken(rm) == f"page {a.rows[0][0]} appears twice in the tables of 'b'"


def test_a_waiting_request_holding_head_wise_pages_is_named(running):
    rm, _ = running
    rm.add_request(request("w", 8, 1))
    rm.kv_cache_manager.start("w")  # a table, as no waiting request may have
    assert broken(rm) == "w: waiting but holds pages"


def test_a_table_nobody_runs_is_named(running):
    rm, _ = running
    rm.kv_cache_manager.start("ghost")
    assert broken(rm) == "ghost: holds a page table but is neither running nor parked"


def test_reservation_corruptions_are_named(running):
    rm, r = running
    policy = rm.admission
    held = list(policy.reserved_per_rank)
    policy.reserved_per_rank = [held[0] + 1]
    assert broken(rm) == f"reservations [{held[0] + 1}] != sum {held} or over capacity"
    # Consistent sums, but more than the cache holds.
    over = rm.pages_per_rank + 1
    policy.reserved_per_rank, policy.reserved["r"] = [over], [over]
    assert broken(rm) == f"reservations [{over}] != sum [{over}] or over capacity"


def test_page_curves_that_overflow_the_cache_are_named(make_config, monkeypatch):
    monkeypatch.setenv("FD_ADMISSION_POLICY", "projected")
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", num_gpu_blocks_override=32, head_wise_swa_config=SWA,
                                       enable_prefix_caching=False))
    rm.add_request(request("a", 40, 20))
    rm.add_request(request("b", 8, 20))
    step(rm)
    step(rm)
    assert [r.request_id for r in rm.running] == ["a", "b"]
    # 10,000 more tokens: a's full heads alone would need 3 x 628 pages of the cache's 4 x 32.
    rm.requests["a"].sampling_params.max_tokens = 10_000
    message = "projected admission: the running requests' page curves overflow the cache at some future step"
    assert broken(rm) == message
    rm.abort_request("b")
    assert broken(rm) == message  # a lone request's curve is checked too
    rm.requests["a"].sampling_params.max_tokens = 20
    rm.check_integrity()
