"""Fixed step buffers (upstream's share_inputs): sized once from the config, refilled in place every step,
never reallocated; the block table is persistent (only the entries a step changes are written); idle rows
are inert for the attention op."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.worker.device import cuda_device_count
from fastdeploy.worker.step_buffers import HostStepBuffer, StepBufferLayout, StepBuffers
from fastdeploy.worker.step_input import StepInput, TableUpdate

KV_HEADS = 4


def layout(rows=KV_HEADS, seqs=8, tokens=64, blocks=16):
    return StepBufferLayout(max_num_seqs=seqs, max_num_tokens=tokens, max_blocks_per_seq=blocks, table_rows=rows)


def random_updates(rng, lay: StepBufferLayout, bsz: int, rows: int) -> list:
    """New ids for every row, -1 over some rows (a recycle), a whole batch row reset (a release)."""
    out = []
    for _ in range(int(rng.integers(1, 6))):
        row, col = int(rng.integers(0, bsz)), int(rng.integers(0, lay.max_blocks_per_seq))
        width = int(rng.integers(1, lay.max_blocks_per_seq - col + 1))
        kind = rng.integers(0, 3)
        if kind == 0:
            out.append(TableUpdate(row, None, col, width, rng.integers(0, 500, (rows, width)).astype(np.int32)))
        elif kind == 1:
            slots = np.sort(rng.choice(rows, int(rng.integers(1, rows + 1)), replace=False))
            out.append(TableUpdate(row, slots, col, width, None))
        else:
            out.append(TableUpdate(row, None, 0, None))
    return out


def random_step(rng, lay: StepBufferLayout, rows: int = None) -> StepInput:
    """A well-formed step: some requests prefill a chunk, others decode one token; some rows idle."""
    bsz = int(rng.integers(1, lay.max_num_seqs + 1))
    lengths = np.minimum(rng.integers(0, 9, bsz), 1 + (rng.random(bsz) < 0.3) * 8).astype(np.int32)
    lengths[-1] = max(1, lengths[-1])  # the highest row is scheduled
    while lengths.sum() > lay.max_num_tokens:
        lengths[np.argmax(lengths)] -= 1
    starts = np.where(lengths > 0, rng.integers(0, 100, bsz), 0).astype(np.int32)
    cu = np.zeros(bsz + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    rows = lay.table_rows if rows is None else rows
    live = [int(i) for i in np.flatnonzero(lengths)]
    return StepInput(input_ids=rng.integers(0, 1000, int(cu[-1])).astype(np.int64),
                     seq_lens_encoder=np.where(lengths > 1, lengths, 0).astype(np.int32), seq_lens_decoder=starts,
                     seq_lens_this_time=lengths, cu_seqlens_q=cu,
                     table_updates=random_updates(rng, lay, bsz, rows),
                     sample_rows=(cu[1:][lengths > 0] - 1).astype(np.int64), greedy=np.ones(len(live), bool),
                     slot_ids=live)


def applied(table: np.ndarray, updates: list) -> np.ndarray:
    """The table after the updates, by the definition of TableUpdate (one entry at a time)."""
    table = table.copy()
    for u in updates:
        end = table.shape[2] if u.width is None else u.col + u.width
        slots = range(table.shape[1]) if u.slots is None else list(u.slots)
        for k, s in enumerate(slots):
            for j, c in enumerate(range(u.col, end)):
                table[u.row, s, c] = -1 if u.ids is None else u.ids[k, j]
    return table


def test_layout_is_sized_from_the_config(make_config):
    fd = make_config("head_wise_recycle_on", max_num_seqs=6, max_num_batched_tokens=96, max_model_len=1000,
                     block_size=16)
    lay = StepBufferLayout.from_config(fd, fd.table_rows_per_rank)
    assert lay.table_shape == (6, 4, 63)  # ceil(1000 / 16) columns
    # seq lens, cu_seqlens, sampled rows (one per token: every row of a piece verifying drafts),
    # token ids, table
    assert lay.total == 6 * 3 + 7 + 96 + 96 + 6 * 4 * 63
    one_d = make_config("1d", max_num_seqs=6, max_model_len=1000, block_size=16)
    assert StepBufferLayout.from_config(one_d, one_d.table_rows_per_rank).table_shape == (6, 1, 63)


@pytest.mark.parametrize("rows", [KV_HEADS, 1])
def test_the_table_keeps_what_earlier_steps_wrote_and_idle_rows_are_inert(rows):
    lay = layout(rows)
    bufs = StepBuffers(lay)
    rng = np.random.default_rng(1)
    table = np.full(lay.table_shape, -1, np.int32)
    big = random_step(rng, lay)
    bufs.fill(big)
    table = applied(table, big.table_updates)
    for _ in range(20):
        step = random_step(rng, lay)
        t = bufs.fill(step)
        table = applied(table, step.table_updates)
        np.testing.assert_array_equal(t["block_tables"].numpy(), table)  # only what the updates say changed
        bsz = len(step.seq_lens_this_time)
        np.testing.assert_array_equal(t["input_ids"].numpy(), step.input_ids)
        np.testing.assert_array_equal(t["sample_rows"].numpy(), step.sample_rows)
        lens = t["seq_lens_this_time"].numpy()
        np.testing.assert_array_equal(lens[:bsz], step.seq_lens_this_time)
        assert (lens[bsz:] == 0).all() and (t["seq_lens_decoder"].numpy()[bsz:] == 0).all()
        cu = t["cu_seqlens_q"].numpy()
        np.testing.assert_array_equal(cu[:bsz + 1], step.cu_seqlens_q)
        assert (cu[bsz:] == len(step.input_ids)).all()  # idle rows past the batch: empty ranges


def test_tensor_parallel_rank_applies_its_slots_updates():
    lay = layout(rows=2, seqs=4, tokens=32, blocks=8)
    host = HostStepBuffer(lay)
    rng = np.random.default_rng(2)
    whole = np.full((4, 4, 8), -1, np.int32)
    for _ in range(10):
        step = random_step(rng, layout(rows=4, seqs=4, tokens=32, blocks=8))
        with pytest.raises(ValueError, match=r"this rank's table has 2 row\(s\)"):
            HostStepBuffer(lay).pack(StepInput(**{**step.__dict__, "table_updates": [
                TableUpdate(0, None, 0, 1, np.zeros((4, 1), np.int32))]}))  # every row's ids: not this rank's
        host.pack(step.for_rank(1, 2, 4))
        whole = applied(whole, step.table_updates)
        np.testing.assert_array_equal(host.table, whole[:, 2:4])
    one_d = random_step(rng, layout(rows=1, seqs=4, tokens=32, blocks=8))
    assert one_d.for_rank(1, 2, 1) is one_d  # a 1-D table's row is every rank's


def test_a_step_larger_than_the_buffers_is_refused_with_the_limits():
    lay = layout(seqs=2)
    rng = np.random.default_rng(3)
    step = random_step(rng, layout(seqs=8))
    while len(step.seq_lens_this_time) <= 2:
        step = random_step(rng, layout(seqs=8))
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        HostStepBuffer(lay).pack(step)
    bad = TableUpdate(0, None, 14, 4, np.zeros((KV_HEADS, 4), np.int32))
    with pytest.raises(ValueError, match=r"columns \[14, 18\) is outside the step buffers"):
        HostStepBuffer(layout()).apply(bad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    cuda_device_count() == 0, reason="needs Paddle with CUDA and a GPU"))])
def test_thousand_steps_reuse_the_same_memory_without_growth(device):
    import paddle

    previous = paddle.get_device()
    paddle.set_device(device)
    try:
        bufs = StepBuffers(layout())
    finally:
        paddle.set_device(previous)
    assert bufs.device.place.is_gpu_place() == (device == "gpu")
    lay = bufs.host.layout
    rng = np.random.default_rng(4)
    steps = [random_step(rng, lay) for _ in range(50)]
    for s in steps:  # warm up Paddle's own caches
        bufs.fill(s)
    ptrs, host_ptr = bufs.data_ptrs(), bufs.host.array.ctypes.data
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i in range(1000):
        t = bufs.fill(steps[i % len(steps)])
    del t
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(d.size_diff for d in after.compare_to(before, "filename"))
    assert bufs.data_ptrs() == ptrs and bufs.host.array.ctypes.data == host_ptr
    assert growth < 16 * 1024, f"{growth} bytes of Python allocations grew over 1000 steps"


def test_the_engine_steps_through_one_set_of_buffers(monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    llm = LLM(block_size=16, max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=128)
    runner = llm.engine.runner.ranks
    ptrs = runner.buffers.data_ptrs()
    assert runner.buffers.host.layout.table_shape == (4, 4, 32)
    assert runner.buffers.device.data_ptr() == runner.buffers.host.array.ctypes.data  # the CPU reads the host array
    outs = llm.generate([[5] * 40, [9] * 3, [7] * 100], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs.token_ids) for o in outs] == [6, 6, 6]
    assert runner.buffers.data_ptrs() == ptrs
