"""Random workloads through the real scheduler, checked against a shadow KV memory kept here.

Hypothesis draws the geometry (block size 1..16, window incl. W = 1 and W = 1 mod bs, sink incl.
S > bs, which KV heads slide, TP 1 or 2), prompts built from a few shared prefixes over a 3-token
alphabet (so the prefix tree branches and prefix hits happen), EOS at a random output position
before max_tokens, and aborts. It runs derandomized (the same examples on every run; a failure
prints its example), and each test asserts at the end that preemption, eviction, prefix hits and
SWA recycling actually happened over its examples. The quantized rows size the cache from the
bytes of the float32 one (--kv-cache-memory with int8 pages: ~3.6x the pages at head_dim 32), so the
pool, the tables and the page-need arithmetic run on the quantized page count.

The check does not use the cache manager's own bookkeeping: every step, each scheduled token's KV
is "written" into a shadow memory at the page its table names (the content is the token prefix it
depends on), and then every key the step's queries may see (docs/retention_rule.md) is "read" through the
tables: it must sit in a page and hold exactly this request's prefix. A page reused while still
referenced, a wrong prefix hit, a -1 where a key is visible, or a missing block all fail here.
"""

import collections
import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.spec_decode.verify import accept_drafts
from scripted_proposer import ScriptedProposer, boundary_hugging

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

EOS, FILLER = 2, 9
HEADS = 4
ALPHABET = (3, 4, 5)


@st.composite
def geometries(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.one_of(st.just(1), st.just(bs + 1), st.integers(1, 3 * bs + 2)))
    sink = draw(st.one_of(st.just(0), st.integers(0, 2 * bs + 1)))
    swa = draw(st.lists(st.integers(0, HEADS - 1), min_size=1, max_size=HEADS, unique=True))
    tp = draw(st.sampled_from([1, 2]))
    return bs, window, sink, sorted(swa), tp


@st.composite
def workloads(draw):
    prefixes = draw(st.lists(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=24), min_size=1, max_size=3))
    jobs = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.sampled_from(ALPHABET), max_size=12))
        max_tokens = draw(st.integers(1, 32))
        eos_at = draw(st.one_of(st.none(), st.integers(0, max_tokens - 1)))  # output index sampling EOS
        arrive = draw(st.integers(0, 8))
        abort_after = draw(st.one_of(st.none(), st.integers(0, 6)))
        jobs.append((prefix + suffix, max_tokens, eos_at, arrive, abort_after))
    return jobs


def visible_keys(start, end, window, sink, swa):
    """Keys some query of positions [start, end) may see (docs/retention_rule.md): j < end and, for a SWA head,
    j < S or j > start - W (a key in (start - W, end) is seen by the query at its own position)."""
    if not swa:
        return range(end)
    return itertools.chain(range(min(sink, end)), range(max(sink, start - window + 1, 0), end))


class ShadowMemory:
    """What each page holds, written and read through the request tables only. A recycling row is read
    with its own sliding type's window and sink (several types recycle side by side); every other row,
    a sliding one whose pages are all kept included, must hold every key."""

    def __init__(self, rm):
        self.rm, self.bs = rm, rm.block_size
        self.row_type = {h: (kind.window, kind.sink) for kind, slots in rm.layout.recycling_groups for h in slots}
        self.head_wise = rm.fd_config.head_wise_kv_cache
        self.heads_per_rank = rm.layout.slots_per_rank
        self.rows = rm.layout.num_slots  # table rows: KV heads, or the slots of a slot layout
        self.cells: dict = {}

    def page(self, request, head, block):
        """Address of a head's page for a block: (rank, page id), or None where the table has none."""
        rows = self.rm.kv_cache_manager.table(request.request_id)
        if self.head_wise:
            row = rows[head]
            p = row[block] if block < len(row) else -1
            return None if p < 0 else (head // self.heads_per_rank, p)
        table, = rows
        return None if block >= len(table) or table[block] < 0 else ("1d", table[block], head)

    def step(self, scheduled):
        tokens_of = {}
        for s in scheduled:
            r = s.request
            tokens = tokens_of[r.request_id] = r.token_ids(0, s.start) + s.token_ids()  # drafts included
            for h in range(self.rows):
                for pos in range(s.start, s.start + s.num_tokens):
                    addr = self.page(r, h, pos // self.bs)
                    assert addr is not None, f"{r.request_id} head {h}: no page for position {pos}"
                    self.cells[addr, pos % self.bs] = hash(tuple(tokens[:pos + 1]))
        for s in scheduled:  # reads after every write of the step, as attention runs after append
            r, end = s.request, s.start + s.num_tokens
            tokens = tokens_of[r.request_id]
            for h in range(self.rows):
                window, sink = self.row_type.get(h, (0, 0))
                for j in visible_keys(s.start, end, window, sink, h in self.row_type):
                    addr = self.page(r, h, j // self.bs)
                    assert addr is not None, f"{r.request_id} head {h}: key {j} is visible but its entry is -1"
                    held = self.cells.get((addr, j % self.bs))
                    assert held == hash(tuple(tokens[:j + 1])), \
                        f"{r.request_id} head {h}: key {j} at {addr} holds another request's KV"


def in_quantized_pages(make_config, quant):
    """make_config, where num_gpu_blocks_override=n becomes the bytes of n float32 blocks held in `quant`
    pages (--kv-cache-memory): the quantized sizing feeds the pool, the tables and the page-need arithmetic."""
    if quant == "none":
        return make_config

    def make(mode, reserve=True, num_gpu_blocks_override=None, **kwargs):
        as_float = make_config(mode, reserve=reserve, num_gpu_blocks_override=num_gpu_blocks_override, **kwargs)
        block_bytes = as_float.cache_config.block_bytes(as_float.model_config,
                                                        as_float.parallel_config.tensor_parallel_size)
        cfg = make_config(mode, reserve=reserve, kv_cache_memory=num_gpu_blocks_override * block_bytes,
                          kv_cache_quant_type=quant, **kwargs)
        assert cfg.cache_config.num_gpu_blocks > 3.5 * num_gpu_blocks_override - 1  # 32 / 9 = 3.56x, floored
        return cfg

    return make


def run_workload(make_config, mode, reserve, geometry, jobs, blocks, seen, speculate=False, **model_args):
    """`speculate`: every decoding request gets up to 3 drafts, right up to the next page boundary or
    window kill point and wrong after it (tests/scripted_proposer.py); the test plays the model."""
    bs, window, sink, swa, tp = geometry
    if mode == "1d":
        tp = 1
    swa_config = {"sliding_window": window, "sink_size": sink, "swa_kv_heads": swa} if swa else None
    if speculate:
        model_args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                            "disable_by_batch_size": None}
    cfg = make_config(mode, reserve=reserve, block_size=bs, num_gpu_blocks_override=blocks, tensor_parallel_size=tp,
                      max_num_batched_tokens=max(8, 2 * bs), max_num_seqs=4, max_model_len=64,
                      enable_prefix_caching=True, head_wise_swa_config=swa_config, **model_args)
    eos_at = {}

    def truth(request, i):  # the token "the model" samples at output index i
        return EOS if i == eos_at[request.request_id] else FILLER

    proposer = ScriptedProposer(truth, boundary_hugging(bs, (window,) if swa else ()), wrong=lambda t: ALPHABET[0]) \
        if speculate else None
    rm = ResourceManagerV1(cfg, proposer=proposer)
    shadow = ShadowMemory(rm)
    pending = list(enumerate(jobs))
    for t in itertools.count():
        for i, (prompt, max_tokens, eos, arrive, _) in list(pending):
            if arrive <= t:
                pending.remove((i, jobs[i]))
                try:
                    rm.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=EOS))
                    eos_at[f"r{i}"] = eos
                    seen["requests"] += 1
                except ValueError:
                    seen["rejected"] += 1
                    continue  # too big for this cache: rejected up front
        for i, (_, _, _, arrive, abort_after) in enumerate(jobs):
            if abort_after is not None and t == arrive + abort_after:
                rm.abort_request(f"r{i}")
        batch = rm.schedule()
        seen["steps"] += 1
        shadow.step(batch.requests)
        assert_pages_held_are_the_page_need(rm, batch)
        sampled = [None if not s.samples else truth(s.request, len(s.request.output_token_ids))
                   if not s.draft_token_ids else verified(s, truth) for s in batch.requests]
        for s, token in zip(batch.requests, sampled):
            seen["eos_finishes"] += EOS in token if isinstance(token, list) else token == EOS
            if s.draft_token_ids:
                seen["drafts"] += len(s.draft_token_ids)
                seen["rejected_drafts"] += len(s.draft_token_ids) + 1 - len(token)
        rm.update_from_output(batch, sampled)
        rm.check_integrity()
        for r in rm.running:  # nothing a rejected draft was written to is kept
            held = len(rm.kv_cache_manager.table(r.request_id)[0])
            assert held == -(-r.num_computed_tokens // bs), f"{r}: {held} table entries"
        if not pending and not rm.has_unfinished_requests():
            break
        assert t < 3000, "no progress"
    cm = rm.cache_manager
    assert cm.num_free_pages == cm.num_total_pages == cfg.cache_config.num_gpu_blocks * rm.layout.num_slots
    if reserve:
        assert rm.num_preemptions_total == 0  # reservation admission never preempts
    seen["examples"] += 1
    seen["preemptions"] += rm.num_preemptions_total
    seen["prefix_hit_tokens"] += rm.prefix_cache_hit_tokens_total
    seen["evictions"] += cm.prefix_cache_stats()["prefix_cache_evictions_total"]
    seen["swa_recycled"] += rm.kv_cache_manager.swa_pages_recycled_total
    return rm


def assert_pages_held_are_the_page_need(rm, batch):
    """After schedule() (recycle step, then table growth) every scheduled request holds, per rank, exactly
    the pages the one page-need function gives for its step: admission and the recycle step agree."""
    if not rm.fd_config.head_wise_kv_cache:
        return
    hpr = rm.layout.slots_per_rank
    for s in batch.requests:
        held = [0] * rm.layout.tensor_parallel_size
        for h, row in enumerate(rm.kv_cache_manager.table(s.request.request_id)):
            held[h // hpr] += sum(p != -1 for p in row)
        assert held == rm.layout.pages_per_rank(s.start, s.num_tokens), \
            f"{s.request.request_id} at {s.start} + {s.num_tokens}: holds {held}"


def verified(scheduled, truth) -> list:
    """The tokens a verification step yields when the model samples `truth` (spec_decode/verify.py)."""
    n = len(scheduled.request.output_token_ids)
    return accept_drafts(scheduled.draft_token_ids, lambda j, accepted: (truth(scheduled.request, n + j), None))[0]


# Every geometry edge at least once, whatever the draws: bs 1, W = 1 mod bs, W = 1, S > bs.
EDGES = [((1, 2, 0, [0], 1),), ((16, 17, 0, [0, 1, 2, 3], 1),), ((4, 1, 0, [1, 3], 2),), ((4, 6, 9, [0, 2], 2),)]
EDGE_JOBS = [([3, 4, 5] * 6, 12, None, 0, None), ([3, 4, 5] * 6 + [4], 12, 5, 0, None),
             ([3, 4, 5] * 4, 8, None, 1, None), ([5] * 20, 10, 0, 2, 3)]


@pytest.mark.parametrize("mode,reserve,expected,quant", [
    ("1d", False, {"preemptions", "prefix_hit_tokens", "evictions", "eos_finishes"}, "none"),
    ("1d", True, {"prefix_hit_tokens", "evictions", "eos_finishes"}, "none"),
    ("head_wise_recycle_off", False, {"preemptions", "prefix_hit_tokens", "evictions", "eos_finishes"}, "none"),
    ("head_wise_recycle_on", False, {"preemptions", "prefix_hit_tokens", "evictions", "swa_recycled",
                                     "eos_finishes"}, "none"),
    ("head_wise_recycle_on", True, {"prefix_hit_tokens", "evictions", "swa_recycled", "eos_finishes"}, "none"),
    ("1d", False, {"prefix_hit_tokens", "eos_finishes"}, "int8"),
    ("head_wise_recycle_on", False, {"prefix_hit_tokens", "swa_recycled", "eos_finishes"}, "block_wise_fp8"),
])
def test_random_workloads_read_back_exactly_what_they_wrote(make_config, mode, reserve, expected, quant):
    seen = collections.Counter()
    make_config = in_quantized_pages(make_config, quant)

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(geometry=geometries(), jobs=workloads(), capacity=st.integers(32, 96))
    @example(geometry=EDGES[0][0], jobs=EDGE_JOBS, capacity=40)
    @example(geometry=EDGES[1][0], jobs=EDGE_JOBS, capacity=64)
    @example(geometry=EDGES[2][0], jobs=EDGE_JOBS, capacity=32)
    @example(geometry=EDGES[3][0], jobs=EDGE_JOBS, capacity=48)
    def run(geometry, jobs, capacity):
        # A cache of `capacity` tokens per head, whatever the block size: tight for several requests.
        bs = geometry[0]
        run_workload(make_config, mode, reserve, geometry, jobs, -(-capacity // bs), seen)

    run()
    print(f"\n{mode} reserve={reserve} {quant}: {dict(seen)}")
    missing = {k for k in expected if seen[k] == 0}
    assert not missing, f"never exercised: {missing} ({dict(seen)})"


@pytest.mark.parametrize("mode,policy,expected", [
    ("1d", "projected", {"prefix_hit_tokens", "eos_finishes", "drafts", "rejected_drafts"}),
    ("head_wise_recycle_on", "on_demand", {"preemptions", "prefix_hit_tokens", "swa_recycled", "eos_finishes",
                                           "drafts", "rejected_drafts"}),
    ("head_wise_recycle_on", "reserve", {"prefix_hit_tokens", "swa_recycled", "drafts", "rejected_drafts"}),
    ("head_wise_recycle_on", "projected", {"prefix_hit_tokens", "swa_recycled", "drafts", "rejected_drafts"}),
])
def test_random_workloads_with_speculation_read_back_exactly_what_they_wrote(make_config, mode, policy, expected):
    """The speculation contract (docs/scheduler.md, "Speculative decoding") under random workloads: drafts are written, then rejected right past a page
    boundary or a window's kill point; every key a later query sees must still hold the accepted
    tokens' KV (the window follows accepted tokens only), a rejected draft's pages go back at once,
    and prefix hits never find a block holding a rejected draft."""
    seen = collections.Counter()

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(geometry=geometries(), jobs=workloads(), capacity=st.integers(32, 96))
    @example(geometry=EDGES[1][0], jobs=EDGE_JOBS, capacity=64)
    @example(geometry=EDGES[3][0], jobs=EDGE_JOBS, capacity=48)
    def run(geometry, jobs, capacity):
        run_workload(make_config, mode, policy == "reserve", geometry, jobs, -(-capacity // geometry[0]), seen,
                     speculate=True, admission_policy=policy)

    run()
    print(f"\nspeculation {mode} {policy}: {dict(seen)}")
    missing = {k for k in expected if seen[k] == 0}
    assert not missing, f"never exercised: {missing} ({dict(seen)})"


# -- slot layouts: sliding layers, head-wise SWA heads, or both ---------------------------------------
SLOT_PRESET = "tiny-sliding-layers"


@st.composite
def slot_geometries(draw):
    """A model of 2..6 layers and 2 KV heads: some layers slide (window W, sink 0), and head-wise SWA
    of the same type may slide some heads of the other layers; at least one pair slides."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    window = draw(st.one_of(st.just(1), st.just(bs + 1), st.integers(1, 3 * bs + 2)))
    layers = draw(st.integers(2, 6))
    sliding = draw(st.lists(st.booleans(), min_size=layers, max_size=layers))
    swa = draw(st.lists(st.integers(0, 1), max_size=2, unique=True))
    if not any(sliding) and not swa:
        sliding[0] = True
    if all(sliding):
        swa = []  # head-wise SWA applies to global layers only: there are none
    tp = draw(st.sampled_from([1, 2]))
    return (bs, window, 0, sorted(swa), tp), [window if s else None for s in sliding]


@pytest.mark.parametrize("mode,reserve,expected,quant", [
    ("1d", False, {"preemptions", "prefix_hit_tokens", "evictions", "layers_sharing_a_lane"}, "none"),
    ("head_wise_recycle_off", False, {"preemptions", "prefix_hit_tokens", "evictions", "layers_sharing_a_lane"},
     "none"),
    ("head_wise_recycle_on", False, {"preemptions", "prefix_hit_tokens", "evictions", "swa_recycled",
                                     "layers_sharing_a_lane", "lane_per_layer"}, "none"),
    ("head_wise_recycle_on", True, {"prefix_hit_tokens", "evictions", "swa_recycled", "layers_sharing_a_lane"},
     "none"),
    ("head_wise_recycle_on", False, {"prefix_hit_tokens", "swa_recycled", "layers_sharing_a_lane"}, "int8"),
])
def test_random_workloads_on_slot_layouts_read_back_exactly_what_they_wrote(make_config, monkeypatch, mode,
                                                                            reserve, expected, quant):
    """The same shadow-memory check, one table row per slot: a slot's pages serve every (layer, KV
    head) pair of the slot, so reading each slot with its own type covers every pair."""
    from fastdeploy.model_executor.models import tiny_preset

    seen = collections.Counter()
    make_config = in_quantized_pages(make_config, quant)
    base = tiny_preset.PRESETS[SLOT_PRESET]

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(drawn=slot_geometries(), jobs=workloads(), capacity=st.integers(32, 96))
    @example(drawn=((4, 6, 0, [], 1), [6, 6, None]), jobs=EDGE_JOBS, capacity=40)
    @example(drawn=((2, 3, 0, [1], 2), [3, None, 3, None]), jobs=EDGE_JOBS, capacity=48)
    def run(drawn, jobs, capacity):
        geometry, windows = drawn
        monkeypatch.setitem(tiny_preset.PRESETS, SLOT_PRESET,
                            {**base, "num_hidden_layers": len(windows), "layer_sliding_window": windows})
        rm = run_workload(make_config, mode, reserve, geometry, jobs, -(-capacity // geometry[0]), seen,
                          model=SLOT_PRESET)
        lanes = rm.fd_config.slot_layout
        seen["layers_sharing_a_lane"] += lanes.num_lanes < lanes.num_layers
        seen["lane_per_layer"] += lanes.num_lanes == lanes.num_layers

    run()
    print(f"\nslots {mode} reserve={reserve} {quant}: {dict(seen)}")
    missing = {k for k in expected if seen[k] == 0}
    assert not missing, f"never exercised: {missing} ({dict(seen)})"


# -- several sliding types (per-head windows, design §17) ------------------------------------------------
@st.composite
def per_head_window_geometries(draw):
    """Per layer of the 2-layer, 4-KV-head preset: the heads that slide, each with its own window and sink
    from a small menu (so one layer may mix types, and different layers hold different ones)."""
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    menu = draw(st.lists(st.tuples(st.integers(1, 3 * bs + 2), st.integers(0, 2 * bs + 1)), min_size=2, max_size=3,
                         unique=True))
    layers = []
    for _ in range(2):
        heads = draw(st.lists(st.integers(0, HEADS - 1), max_size=HEADS, unique=True))
        layers.append([(h, draw(st.sampled_from(menu))) for h in sorted(heads)])
    if not any(layers):
        layers[0] = [(0, menu[0])]
    tp = draw(st.sampled_from([1, 2]))
    return bs, layers, tp


def per_head_window_spec(layers) -> dict:
    return {"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [[h for h, _ in row] for row in layers],
            "head_windows": [[t[0] for _, t in row] for row in layers],
            "head_sinks": [[t[1] for _, t in row] for row in layers]}


@pytest.mark.parametrize("mode,reserve,expected", [
    ("head_wise_recycle_on", False, {"preemptions", "prefix_hit_tokens", "evictions", "swa_recycled",
                                     "several_types_recycling"}),
    ("head_wise_recycle_on", True, {"prefix_hit_tokens", "evictions", "swa_recycled", "several_types_recycling"}),
    ("head_wise_recycle_off", False, {"preemptions", "prefix_hit_tokens", "several_types_kept"}),
])
def test_random_workloads_with_several_sliding_types_read_back_exactly_what_they_wrote(make_config, mode, reserve,
                                                                                     expected):
    """Every sliding type recycles with its own window and sink: each recycling row is read with its
    type's visibility, so a page freed early (or kept too long) by any type fails here, and the pages a
    request holds after every recycle step are the page-need function's."""
    seen = collections.Counter()

    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(drawn=per_head_window_geometries(), jobs=workloads(), capacity=st.integers(32, 96))
    @example(drawn=(4, [[(0, (2, 0)), (1, (9, 5))], [(1, (6, 1)), (3, (2, 0))]], 2), jobs=EDGE_JOBS, capacity=48)
    def run(drawn, jobs, capacity):
        bs, layers, tp = drawn
        cfg_swa = per_head_window_spec(layers)

        def with_windows(mode, reserve=True, head_wise_swa_config=None, **kwargs):
            return make_config(mode, reserve=reserve, head_wise_swa_config=cfg_swa, **kwargs)

        rm = run_workload(with_windows, mode, reserve, (bs, 8, 0, [0], tp), jobs, -(-capacity // bs), seen)
        several = len(rm.fd_config.slot_layout.sliding_types) > 1
        seen["several_types_recycling"] += several and len(rm.layout.recycling_groups) > 1
        seen["several_types_kept"] += several and not rm.layout.recycling_groups

    run()
    print(f"\nper-head windows {mode} reserve={reserve}: {dict(seen)}")
    missing = {k for k in expected if seen[k] == 0}
    assert not missing, f"never exercised: {missing} ({dict(seen)})"
