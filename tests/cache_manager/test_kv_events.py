"""KV-cache events: a consumer that replays them rebuilds, at every step, exactly the set of blocks at which
this replica's own prefix lookup would serve a hit (driven through the real scheduler, a multi-session
chat that overflows the cache, head-wise with and without recycling and 1-D), and the hashes it reads are
vLLM's chained block hashes of the tokens it was sent."""

import numpy as np
import pytest

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.cache_manager.kv_events import HitEndEvents, chain_hashes
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 20, "sink_size": 5, "swa_kv_heads": [0, 2]}
BS = 8


class Consumer:
    """What a KV-aware router keeps of one replica: hash -> (parent hash, tokens), and the stored set."""

    def __init__(self):
        self.blocks, self.stored = {}, set()

    def apply(self, events: list) -> None:
        for e in events:
            if e["type"] == "BlockStored":
                parent = e["parent_block_hash"]
                assert parent is None or parent in self.blocks, "a store names a parent never announced"
                tokens = e["token_ids"]
                assert len(tokens) == e["block_size"] * len(e["block_hashes"])
                for i, h in enumerate(e["block_hashes"]):
                    self.blocks[h] = (parent, tokens[i * BS:(i + 1) * BS])
                    self.stored.add(h)
                    parent = h
            elif e["type"] == "BlockRemoved":
                assert set(e["block_hashes"]) <= self.blocks.keys()
                self.stored -= set(e["block_hashes"])
            else:
                assert e == {"type": "AllBlocksCleared"}
                self.blocks, self.stored = {}, set()

    def tokens(self, h) -> list:
        out = []
        while h is not None:
            parent, tokens = self.blocks[h]
            out[:0] = tokens
            h = parent
        return out


def hit_ends_by_lookup(cache, paths: bool = False) -> set:
    """The event hash of every cached block at which the engine's own lookup serves a hit ending there
    (`paths`: and of every block on the way to one); with a host tier, a hit may end on its pages."""
    ends, stack = set(), [(child, []) for child in cache.root.children.values()]
    while stack:
        node, keys = stack.pop()
        keys = keys + [node.key]
        if len(cache.match(keys, tiers=True)) == len(keys):
            hashes = chain_hashes([t for k in keys for t in k], BS)
            ends.update(hashes if paths else hashes[-1:])
        stack += [(child, keys) for child in node.children.values()]
    return ends


@pytest.mark.parametrize("host_tier", [False, True])
@pytest.mark.parametrize("stored_blocks", ["hit_ends", "hit_paths"])
@pytest.mark.parametrize("mode", ["head_wise_recycle_on", "head_wise_recycle_off", "1d"])
def test_replayed_events_are_exactly_the_blocks_a_hit_may_end_at_or_pass(make_config, mode, stored_blocks, host_tier):
    rm = ResourceManagerV1(make_config(mode, block_size=BS, max_num_batched_tokens=32, head_wise_swa_config=SWA,
                                       num_gpu_blocks_override=40))
    cache = rm.kv_cache_manager.pages.prefix_cache
    tier = None
    if host_tier:  # a tier too small for the overflow: pages go down, come back, and are let go
        kv = rm.kv_cache_manager
        pool = np.zeros((kv.pages_per_rank // kv.pages_per_entry, 1), np.int64)
        tier = HostTier(12 * kv.layout.num_slots // kv.pages_per_entry, [pool.view(np.uint8)])
        rm.cache_manager.attach_host_tier(tier)
    events, consumer = HitEndEvents(cache, stored_blocks), Consumer()
    paths = stored_blocks == "hit_paths"
    system = [3 + (i * 5) % 97 for i in range(37)]
    history = {s: [] for s in range(8)}
    checked = removed = wider = 0
    for turn in range(4):
        for s in history:
            history[s] += [100 + s * 10 + turn] * (3 + s)
            rm.add_request(Request(f"s{s}t{turn}", system + history[s], SamplingParams(max_tokens=10, ignore_eos=True),
                                   eos_token_id=2))
        while rm.has_unfinished_requests():
            batch = rm.schedule()
            rm.update_from_output(batch, [9 if r.samples else None for r in batch.requests])
            batch_events = events.collect()
            removed += sum(len(e["block_hashes"]) for e in batch_events if e["type"] == "BlockRemoved")
            consumer.apply(batch_events)
            assert consumer.stored == hit_ends_by_lookup(cache, paths), (turn, checked)
            wider += consumer.stored != hit_ends_by_lookup(cache)
            checked += 1
        for s in history:
            history[s] += [9] * 10
    assert checked > 30 and removed > 0  # the cache overflowed: hit ends were withdrawn
    if tier is not None:  # ... and with the tier, pages went down, came back and were let go
        assert tier.stored_total > 0 and tier.loaded_total > 0 and tier.evicted_total > 0
    # Only recycling makes valid ends other than a run from the first block, where the two modes differ.
    assert (wider > 0) == (paths and mode == "head_wise_recycle_on")
    for h in consumer.stored:  # what the consumer reads is vLLM's chain hash of the tokens it rebuilt
        assert chain_hashes(consumer.tokens(h), BS)[-1] == h


def test_a_step_that_changes_one_block_judges_only_what_lies_below_it(make_config):
    """Validity is re-judged under the changed nodes only, so a step's cost does not grow with the cache."""
    from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager

    cm = PrefixCacheManager(make_config("head_wise_recycle_on", block_size=BS, head_wise_swa_config=SWA,
                                        num_gpu_blocks_override=64, enable_prefix_caching=True))
    events = HitEndEvents(cm.prefix_cache)

    def write(rid, keys):
        rows, parent = cm.allocate(len(keys), rid), cm.prefix_root
        for i, key in enumerate(keys):
            parent = cm.register_block(parent, key, [row[i] for row in rows], rid)
        return parent

    chains = [[(s, i) * (BS // 2) for i in range(5)] for s in range(8)]
    for s, keys in enumerate(chains):
        write(f"c{s}", keys)
    first = events.collect()
    assert sum(1 for e in first if e["type"] == "BlockStored") == 40
    judged = []
    judge = events._judge
    events._judge = lambda tops, state: judged.append(judge(tops, state)[1]) or judge(tops, state)
    leaf = write("x", chains[3] + [(99,) * BS])
    batch = events.collect()
    assert judged == [{leaf}]
    assert [e["type"] for e in batch] == ["BlockStored"] and leaf in events.stored
    assert events.collect() == []  # nothing changed: nothing judged, nothing sent
    assert judged == [{leaf}]
    assert set(events.stored) == set(events.valid_ends())
