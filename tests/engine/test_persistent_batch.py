"""The persistent batch (engine/persistent_batch.py): the block table the worker keeps between steps
equals the KV cache manager's tables at every step, though a step sends only the entries that changed,
through growth, recycling, prefix hits, aborts, preemption and finished requests; rows given back read -1;
and no step re-sends or rebuilds a table."""

import numpy as np
import pytest

from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import SamplingParams

SWA = {"sliding_window": 24, "sink_size": 4, "swa_kv_heads": [0, 1]}


def prompts(seed):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 250, 48).tolist()
    return [shared + rng.integers(3, 250, int(n)).tolist() if i % 2 else rng.integers(3, 250, int(n)).tolist()
            for i, n in enumerate(rng.integers(5, 90, 10))]


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_the_workers_table_is_the_managers_at_every_step(make_config, mode):
    blocks = {"1d": 40, "head_wise_recycle_on": 24}[mode]  # too few for every request at once: preemptions
    engine = LLMEngine(make_config(mode, reserve=False, block_size=8, num_gpu_blocks_override=blocks, max_num_seqs=4,
                                   max_num_batched_tokens=32, max_model_len=256, head_wise_swa_config=SWA))
    kv, batch = engine.scheduler.kv_cache_manager, engine.runner.batch
    host = engine.runner.ranks.buffers.host
    sent, scheduled = [], []
    execute, schedule = engine.runner.ranks.execute_model, engine.scheduler.schedule

    def recording(step):  # the entries a step sends for the persistent table
        sent.append(sum(u.ids.size if u.ids is not None else 1 for u in step.table_updates))
        return execute(step)

    def scheduling():
        out = schedule()
        scheduled[:] = [s.request.request_id for s in out.requests]
        return out

    engine.runner.ranks.execute_model, engine.scheduler.schedule = recording, scheduling
    for i, p in enumerate(prompts(0)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True))
    steps = aborted = compared = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for rid in scheduled:  # ran this step: the worker's row is the manager's table (unless it finished)
            if not kv.holds(rid):
                continue
            table, row = kv.table(rid), batch.row(rid)
            np.testing.assert_array_equal(host.table[row, :, :len(table[0])], np.asarray(table),
                                          err_msg=f"{rid} at step {steps}")
            assert (host.table[row, :, len(table[0]):] == -1).all()
            compared += 1
        if steps == 9:
            engine.abort_request(engine.scheduler.running[0].request_id)
            aborted += 1
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["prefix_cache_hit_tokens_total"] > 0 and aborted
    assert compared > 100
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    # Every row was given back: the next step's resets make the whole table -1 again.
    engine.add_request("last", [5] * 3, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    row = 0  # "last" took the lowest row; every other row is -1
    assert (np.delete(host.table, row, axis=0) == -1).all()
    # A decode step sends only what changed: far fewer entries than the tables hold.
    whole = host.table.shape[1] * host.table.shape[2]
    assert np.median(sent) < whole / 10, (np.median(sent), whole)
    if mode != "1d":
        assert stats["swa_pages_recycled_total"] > 0
