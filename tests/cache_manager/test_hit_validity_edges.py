"""Head-wise hit validity at the edge of the window: the oldest block a query can still see.

A finished 300-token request leaves 18 full blocks cached; a repeat may hit all 18 (a query at 288
tokens). One SWA page is then evicted and the hit length checked against values worked out by hand
from docs/retention_rule.md (block i of a SWA head is dead for n processed tokens iff i >= ceil(S / bs) and
(i + 1) * bs <= n - W + 1), independent of head_wise.py. Block 16, SWA head 0.
"""

import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

BS = 16
PROMPT = [3 + (i * 37 + (i * i) % 23) % 250 for i in range(300)]


def run(rm, r):
    rm.add_request(r)
    start = None
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        for s in batch.requests:
            start = s.start if start is None else start
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        rm.check_integrity()
    return start


def request(rid, max_tokens=1):
    return Request(rid, list(PROMPT), SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


@pytest.fixture
def cached(make_config):
    def make(window, sink):
        swa = {"sliding_window": window, "sink_size": sink, "swa_kv_heads": [0]}
        rm = ResourceManagerV1(make_config("head_wise_recycle_on", num_gpu_blocks_override=128,
                                           max_num_batched_tokens=512, head_wise_swa_config=swa))
        run(rm, request("a"))
        path = rm.kv_cache_manager.match_prefix(request("probe"))
        assert len(path) == 18
        return rm, path

    return make


def evict_swa_page(rm, node):
    cache = rm.cache_manager.prefix_cache
    cache._evict_page(cache.slot_rank[0], node.pages[0], node, 0)


# (window, sink, evicted SWA block, expected hit in blocks)
CASES = [
    # W = 128, S = 16 (the preset): at 288 tokens blocks 1..9 are dead, block 10 is the oldest visible.
    (128, 16, 9, 18),
    (128, 16, 10, 10),  # every hit of 11..18 blocks still sees block 10
    (128, 16, 17, 17),
    # W = 17 = 1 mod bs, no sink: at 16n tokens only block n - 1 is visible.
    (17, 0, 16, 18),
    (17, 0, 17, 17),
    (17, 0, 0, 18),
    # W = 1: a query sees only its own key, so no cached SWA page is ever needed.
    (1, 0, 17, 18),
    (1, 0, 0, 18),
    # W = 40, S = 20 > bs: sink blocks 0 and 1 (block 1 half sink); at 288 blocks 2..14 are dead.
    (40, 20, 14, 18),
    (40, 20, 15, 15),
    (40, 20, 1, 1),     # the partial sink block is seen by every later query
    (40, 20, 2, 18),
]


@pytest.mark.parametrize("window,sink,evicted,hit", CASES)
def test_hit_length_when_one_swa_page_at_the_window_edge_is_gone(cached, window, sink, evicted, hit):
    rm, path = cached(window, sink)
    evict_swa_page(rm, path[evicted])
    rm.check_integrity()
    assert len(rm.kv_cache_manager.match_prefix(request("probe"))) == hit
    # The repeat really starts where the hit ends (the last block is computed again if all hit).
    assert run(rm, request("b")) == hit * BS
