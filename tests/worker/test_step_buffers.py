"""Fixed step buffers (upstream's share_inputs): sized once from the config, refilled in place by one
copy per step, never reallocated; idle rows are inert for the attention op."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.worker.device import cuda_device_count
from fastdeploy.worker.step_buffers import HostStepBuffer, StepBufferLayout, StepBuffers
from fastdeploy.worker.step_input import StepInput

KV_HEADS = 4


def layout(head_wise=True, seqs=8, tokens=64, blocks=16):
    return StepBufferLayout(max_num_seqs=seqs, max_num_tokens=tokens, max_blocks_per_seq=blocks,
                            num_kv_heads=KV_HEADS, head_wise=head_wise)


def random_step(rng, lay: StepBufferLayout) -> StepInput:
    """A well-formed step: some requests prefill a chunk, others decode one token."""
    bsz = int(rng.integers(1, lay.max_num_seqs + 1))
    lengths = np.minimum(rng.integers(1, 9, bsz), 1 + (rng.random(bsz) < 0.3) * 8).astype(np.int32)
    while lengths.sum() > lay.max_num_tokens:
        lengths[np.argmax(lengths)] -= 1
    starts = rng.integers(0, 100, bsz).astype(np.int32)
    cu = np.zeros(bsz + 1, np.int32)
    np.cumsum(lengths, out=cu[1:])
    width = int(rng.integers(1, lay.max_blocks_per_seq + 1))
    shape = (bsz, KV_HEADS, width) if lay.head_wise else (bsz, width)
    table = rng.integers(-1, 500, shape).astype(np.int32)
    return StepInput(input_ids=rng.integers(0, 1000, int(cu[-1])).astype(np.int64),
                     seq_lens_encoder=np.where(lengths > 1, lengths, 0).astype(np.int32), seq_lens_decoder=starts,
                     seq_lens_this_time=lengths, cu_seqlens_q=cu,
                     block_tables=None if lay.head_wise else table,
                     block_tables_head_wise=table if lay.head_wise else None,
                     sample_rows=(cu[1:] - 1).astype(np.int64), greedy=np.ones(bsz, bool), slot_ids=list(range(bsz)))


def test_layout_is_sized_from_the_config(make_config):
    fd = make_config("head_wise_recycle_on", max_num_seqs=6, max_num_batched_tokens=96, max_model_len=1000,
                     block_size=16)
    lay = StepBufferLayout.from_config(fd, num_kv_heads=4)
    assert lay.table_shape == (6, 4, 63)  # ceil(1000 / 16) columns
    # seq lens, cu_seqlens, sampled rows (one per token: every row of a piece verifying drafts),
    # token ids, table
    assert lay.total == 6 * 3 + 7 + 96 + 96 + 6 * 4 * 63
    assert StepBufferLayout.from_config(make_config("1d", max_num_seqs=6), 4).table_shape[0:1] == (6,)


@pytest.mark.parametrize("head_wise", [True, False])
def test_views_hold_the_step_and_idle_rows_are_inert(head_wise):
    lay = layout(head_wise)
    bufs = StepBuffers(lay)
    rng = np.random.default_rng(1)
    big = random_step(rng, lay)
    bufs.fill(big)
    step = random_step(rng, lay)
    while len(step.seq_lens_this_time) >= len(big.seq_lens_this_time):  # a smaller batch after a bigger one
        step = random_step(rng, lay)
    t = bufs.fill(step)
    expected = step.block_tables_head_wise if head_wise else step.block_tables
    bsz, width = len(step.seq_lens_this_time), expected.shape[-1]
    np.testing.assert_array_equal(t["input_ids"].numpy(), step.input_ids)
    np.testing.assert_array_equal(t["sample_rows"].numpy(), step.sample_rows)
    lens = t["seq_lens_this_time"].numpy()
    np.testing.assert_array_equal(lens[:bsz], step.seq_lens_this_time)
    assert (lens[bsz:] == 0).all() and (t["seq_lens_decoder"].numpy()[bsz:] == 0).all()
    cu = t["cu_seqlens_q"].numpy()
    np.testing.assert_array_equal(cu[:bsz + 1], step.cu_seqlens_q)
    assert (cu[bsz:] == len(step.input_ids)).all()  # idle rows: empty ranges
    table = t["block_tables"].numpy()
    assert table.shape == lay.table_shape
    np.testing.assert_array_equal(table[:bsz, ..., :width], expected)
    assert (table[bsz:] == -1).all() and (table[:bsz, ..., width:] == -1).all()  # the bigger step's rows are gone


def test_tensor_parallel_rank_packs_its_heads_rows():
    lay = StepBufferLayout(max_num_seqs=4, max_num_tokens=32, max_blocks_per_seq=8, num_kv_heads=2, head_wise=True)
    host = HostStepBuffer(lay)
    step = random_step(np.random.default_rng(2), layout(True, seqs=4, tokens=32, blocks=8))
    with pytest.raises(ValueError, match="4 KV heads, the buffers hold 2"):
        host.pack(step)  # the whole table: not this rank's
    host.pack(step.for_rank(1, 2))
    width = step.block_tables_head_wise.shape[-1]
    np.testing.assert_array_equal(host.table[:len(step.seq_lens_this_time), :, :width],
                                  step.block_tables_head_wise[:, 2:4])


def test_a_step_larger_than_the_buffers_is_refused_with_the_limits():
    lay = layout(True, seqs=2)
    step = random_step(np.random.default_rng(3), layout(True, seqs=8))
    while len(step.seq_lens_this_time) <= 2:
        step = random_step(np.random.default_rng(len(step.input_ids)), layout(True, seqs=8))
    with pytest.raises(ValueError, match="max_num_seqs=2"):
        HostStepBuffer(lay).pack(step)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    cuda_device_count() == 0, reason="needs Paddle with CUDA and a GPU"))])
def test_thousand_steps_reuse_the_same_memory_without_growth(device):
    import paddle

    previous = paddle.get_device()
    paddle.set_device(device)
    try:
        bufs = StepBuffers(layout(True))
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
    outs = llm.generate([[5] * 40, [9] * 3, [7] * 100], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [len(o.outputs.token_ids) for o in outs] == [6, 6, 6]
    assert runner.buffers.data_ptrs() == ptrs
