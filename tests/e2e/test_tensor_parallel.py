"""Tensor parallelism with real worker processes: TP=2 against TP=1, every memory mode, faults.

Each engine here starts two worker processes that import Paddle, so the count is kept small: one
engine per memory mode, one for the saved checkpoint, one for --balance-swa-heads, one per fault.
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.engine.request import SamplingParams
from fastdeploy.engine.worker_group import WorkerFailure
from scripted_proposer import ScriptedProposer, boundary_hugging, oracle_truth

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

PROMPT_LENGTHS = [1, 7, 16, 130, 300, 520]  # up to ~4x the tiny preset's window of 128
MAX_TOKENS = 16
TOP = 5
# Float tolerance on logprobs: TP sums o_proj/down_proj partials in another order than TP=1.
TOL = 1e-3
QUANT_TOL = 1e-2  # quantized KV pages: a last-bit difference may flip a code (test below)
MODES = {  # FD_HEAD_WISE_KV_CACHE, FD_HEAD_WISE_SWA_RECYCLE, prefix caching
    "1d": ("0", "1", False),
    "head_wise_recycle_off": ("1", "0", False),
    "head_wise_recycle_on": ("1", "1", False),
    "prefix_caching": ("1", "1", True),
}


def prompts():
    return [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def make_engine(mode="head_wise_recycle_on", backend="APPEND_ATTN", **engine_args) -> LLMEngine:
    head_wise, recycle, prefix = MODES[mode]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FD_ATTENTION_BACKEND", backend)
        mp.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
        mp.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
        args = dict(block_size=16, max_model_len=1024, max_num_seqs=8, num_gpu_blocks_override=256,
                    max_num_batched_tokens=64, enable_prefix_caching=prefix)
        args.update(engine_args)
        return LLMEngine.from_engine_args(EngineArgs(**args))


def run(engine: LLMEngine, batch: list) -> list:
    """Greedy (tokens, top logprobs) per prompt; the scheduler's per-rank integrity after every step."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    ids = [f"r{next_id()}" for _ in batch]
    for rid, prompt in zip(ids, batch):
        engine.add_request(rid, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        final.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_integrity()
    return [(final[r].outputs.token_ids, final[r].outputs.logprobs) for r in ids]


_counter = iter(range(10 ** 6))


def next_id() -> int:
    return next(_counter)


def assert_same_within_tolerance(reference: list, other: list, tol: float = TOL) -> None:
    """Logprobs within `tol`; tokens identical wherever the reference's top-2 gap exceeds it (a closer
    race may flip, and the continuation then legitimately differs)."""
    for (ref_tokens, ref_lp), (tokens, lp) in zip(reference, other):
        for step, (a, b) in enumerate(zip(ref_tokens, tokens)):
            top2 = sorted(ref_lp[step].values(), reverse=True)[:2]
            if a != b:
                assert top2[0] - top2[1] <= tol, f"token {step} differs with a top-2 gap of {top2[0] - top2[1]}"
                break
            shared = set(ref_lp[step]) & set(lp[step])
            assert max(abs(ref_lp[step][t] - lp[step][t]) for t in shared) < tol


def worker_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # reaped by nobody yet counts as gone: it no longer runs


def our_workers() -> list:
    """Live worker processes whose parent is this test process."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == os.getpid() and b"fastdeploy.worker.worker_process" in cmdline and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def reference():
    """TP=1, in-process, head-wise recycle on: what every TP=2 run must reproduce."""
    engine = make_engine("head_wise_recycle_on")
    try:
        return run(engine, prompts())
    finally:
        engine.close()


@pytest.mark.parametrize("mode", MODES)
def test_two_worker_ranks_match_one_rank_in_every_memory_mode(reference, mode):
    engine = make_engine(mode, tensor_parallel_size=2)
    pids = engine.runner.worker_pids
    try:
        assert len(pids) == 2 and sorted(our_workers()) == sorted(pids)
        # Each rank holds half the KV heads in its own cache: [blocks, H/2, block_size, head_dim].
        info = engine.runner.ranks.rank_info
        assert [i["kv_heads"] for i in info] == [[0, 1], [2, 3]]
        assert all(i["cache_shape"] == [256, 2, 16, 32] for i in info)
        batch = prompts() * (2 if MODES[mode][2] else 1)  # a second round hits the prefix cache
        results = run(engine, batch)
        assert_same_within_tolerance(reference, results[:len(reference)])
        assert_same_within_tolerance(reference, results[len(reference):])
        stats = engine.get_stats()
        assert stats["kv_pages_free_per_rank"] == stats["kv_pages_total_per_rank"] == [512, 512]
        if mode == "head_wise_recycle_on":
            assert stats["swa_pages_recycled_total"] > 0
        if mode == "prefix_caching":
            assert stats["prefix_cache_hit_tokens_total"] > 0
    finally:
        engine.close()
    assert all(worker_gone(p) for p in pids) and our_workers() == []


def test_two_ranks_verify_drafts_like_one_rank(reference):
    """Speculation under TP=2: each rank writes its heads' K/V for the drafts, and both ranks free
    the pages of rejected ones (per-rank integrity after every step); the outputs stay TP=1's."""
    engine = make_engine(tensor_parallel_size=2, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None})
    oracle = {tuple(p): tokens for p, (tokens, _) in zip(prompts(), reference)}
    engine.scheduler.proposer = ScriptedProposer(oracle_truth(oracle), boundary_hugging(16),
                                                 wrong=lambda t: (t + 1) % 256)
    try:
        assert_same_within_tolerance(reference, run(engine, prompts()))
        stats = engine.get_stats()
        assert 0 < stats["spec_decode_num_accepted_tokens_total"] < stats["spec_decode_num_draft_tokens_total"]
        assert stats["kv_pages_free_per_rank"] == [512, 512]
    finally:
        engine.close()


def test_two_ranks_with_int8_pages_match_one_rank_with_int8_pages():
    """Quantized pages on rank-local lanes: each rank writes and reads the codes and scales of its own
    KV heads in its own cache, so TP=2 reproduces TP=1. The all-reduce order's last-bit differences
    can move a K/V value across a rounding edge of its int8 code (a whole step, ~1/254 of the row's
    absmax), so the tolerance is QUANT_TOL, not TOL (measured: 1.3e-3 at most)."""
    one = make_engine("prefix_caching", kv_cache_quant_type="int8")
    try:
        want = run(one, prompts())
    finally:
        one.close()
    engine = make_engine("prefix_caching", tensor_parallel_size=2, kv_cache_quant_type="int8")
    try:
        results = run(engine, prompts() * 2)  # the second round reads cached pages and their scales
        assert_same_within_tolerance(want, results[:len(want)], QUANT_TOL)
        assert_same_within_tolerance(want, results[len(want):], QUANT_TOL)
        stats = engine.get_stats()
        assert stats["prefix_cache_hit_tokens_total"] > 0 and stats["swa_pages_recycled_total"] > 0
    finally:
        engine.close()


def test_two_ranks_match_one_on_a_saved_checkpoint_with_tied_embeddings(tmp_path):
    """A checkpoint on disk (tied embeddings, an odd vocabulary padded across ranks, 2 KV heads)."""
    from safetensors.numpy import save_file

    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.models.decoder import random_checkpoint
    from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG

    raw = dict(TINY_PRESET_CONFIG, vocab_size=301, num_key_value_heads=2, tie_word_embeddings=True, seed=7,
               fastdeploy_byte_tokenizer=True,
               head_wise_swa={"sliding_window": 48, "sink_size": 4, "swa_kv_heads": [1]})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(random_checkpoint(ModelConfig.create(str(tmp_path), 1024, None)), str(tmp_path / "model.safetensors"))
    results = []
    for tp in (1, 2):
        engine = make_engine(model=str(tmp_path), tensor_parallel_size=tp)
        try:
            results.append(run(engine, prompts()[:4]))
        finally:
            engine.close()
    assert_same_within_tolerance(*results)


def test_balanced_swa_heads_spread_over_the_ranks_and_leave_outputs_unchanged():
    swa = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [0, 1]}  # both on rank 0 unless balanced
    one = make_engine(head_wise_swa_config=swa)
    try:
        unbalanced = run(one, prompts())
    finally:
        one.close()
    engine = make_engine(head_wise_swa_config=swa, tensor_parallel_size=2, balance_swa_heads=True)
    try:
        model = engine.model_config
        assert model.kv_head_order == (0, 2, 1, 3) and model.head_wise_swa.swa_kv_heads == (0, 2)
        assert engine.scheduler.layout.rank_head_counts() == [(1, 1), (1, 1)]
        assert_same_within_tolerance(unbalanced, run(engine, prompts()))
        assert engine.get_stats()["swa_pages_recycled_total"] > 0
    finally:
        engine.close()


def unpermuted_oracle(**engine_args) -> list:
    """TP=1 NATIVE_ATTN: the checkpoint as stored, SWA masked per (layer, head)."""
    engine = make_engine(backend="NATIVE_ATTN", **engine_args)
    try:
        assert engine.model_config.kv_head_orders is None
        return run(engine, prompts()[:4])
    finally:
        engine.close()


def test_per_layer_swa_heads_on_two_balanced_ranks_match_the_unpermuted_oracle():
    """Per-layer placement (layer 1's heads 2, 3 into slots 0, 1) composed with balancing (slots 1 and 2
    swapped in every layer): each rank holds one SWA head of every layer."""
    swa = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [[0, 1], [2, 3]]}
    expected = unpermuted_oracle(head_wise_swa_config=swa)
    engine = make_engine(head_wise_swa_config=swa, tensor_parallel_size=2, balance_swa_heads=True)
    try:
        model = engine.model_config
        assert model.kv_head_orders == ((0, 2, 1, 3), (2, 0, 3, 1)) and model.swa_kv_heads == (0, 2)
        assert engine.scheduler.layout.rank_head_counts() == [(1, 1), (1, 1)]
        assert_same_within_tolerance(expected, run(engine, prompts()[:4]))
        assert engine.get_stats()["swa_pages_recycled_total"] > 0
    finally:
        engine.close()


def test_per_layer_swa_heads_on_three_ranks_of_a_three_kv_head_model_match_the_unpermuted_oracle(tmp_path):
    """TP 3, one KV head per rank: layer 1's SWA heads 1, 2 move to slots 0, 1 (order (1, 2, 0))."""
    from safetensors.numpy import save_file

    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.models.decoder import random_checkpoint
    from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG

    raw = dict(TINY_PRESET_CONFIG, num_attention_heads=6, num_key_value_heads=3, intermediate_size=384, seed=11,
               fastdeploy_byte_tokenizer=True,
               head_wise_swa={"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [[0, 1], [1, 2]]})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(random_checkpoint(ModelConfig.create(str(tmp_path), 1024, None)), str(tmp_path / "model.safetensors"))
    expected = unpermuted_oracle(model=str(tmp_path))
    engine = make_engine(model=str(tmp_path), tensor_parallel_size=3, balance_swa_heads=True)
    try:
        assert engine.model_config.kv_head_orders == ((0, 1, 2), (1, 2, 0))
        assert [i["kv_heads"] for i in engine.runner.ranks.rank_info] == [[0], [1], [2]]
        assert_same_within_tolerance(expected, run(engine, prompts()[:4]))
    finally:
        engine.close()


def test_a_killed_worker_fails_the_step_with_a_clear_error_and_stops_the_other_rank():
    engine = make_engine(tensor_parallel_size=2)
    pids = engine.runner.worker_pids
    try:
        engine.add_request("victim", prompts()[4], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        engine.step()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerFailure, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            for _ in range(100):
                engine.step()
        assert all(worker_gone(p) for p in pids) and our_workers() == []
        with pytest.raises(WorkerFailure, match="rank 1"):  # later steps keep failing the same way
            engine.step()
    finally:
        engine.close()


def test_a_hung_worker_fails_the_step_after_the_timeout_and_every_rank_is_stopped(monkeypatch):
    monkeypatch.setenv("FD_TP_STEP_TIMEOUT", "2")
    engine = make_engine(tensor_parallel_size=2)
    pids = engine.runner.worker_pids
    try:
        engine.add_request("victim", prompts()[3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        os.kill(pids[1], signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(WorkerFailure, match="hung"):
            engine.step()
        assert time.monotonic() - started < 60  # bounded, not a hang (the bound is generous on purpose)
        assert all(worker_gone(p) for p in pids) and our_workers() == []
    finally:
        engine.close()


def _three_free_ports() -> int:
    import socket

    for base in range(29500, 31500, 7):
        socks = []
        try:
            for port in range(base, base + 3):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no three consecutive free ports")


def test_ranks_started_by_paddle_distributed_launch_serve_an_engine_that_waits_for_them(monkeypatch, tmp_path,
                                                                                        reference):
    """The multi-machine recipe of docs/tensor_parallel.md on one machine: the engine binds fixed ports and waits
    (FD_TP_LAUNCH_WORKERS=0); paddle.distributed.launch starts the ranks; closing the engine ends them."""
    import subprocess
    import sys

    port = _three_free_ports()
    monkeypatch.setenv("FD_TP_LAUNCH_WORKERS", "0")
    monkeypatch.setenv("FD_TP_ENGINE_PORT", str(port))
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PADDLE_DISTRI_BACKEND="gloo",
               PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
         str(tmp_path / "log"), "fastdeploy/worker/worker_process.py", "--engine-address", f"127.0.0.1:{port}"],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        engine = make_engine(tensor_parallel_size=2)
        try:
            assert our_workers() == []  # the ranks are the launcher's children, not ours
            assert len(engine.runner.worker_pids) == 2
            assert_same_within_tolerance(reference, run(engine, prompts()[:3]))
        finally:
            engine.close()
        assert launcher.wait(60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_moe_experts_are_sharded_and_two_ranks_match_one():
    """tiny-moe (ERNIE-4.5-21B-A3B's shape): every expert's gate/up/down split like the dense MLP,
    the router replicated; with --balance-swa-heads on top, tokens and logprobs equal TP=1."""
    swa = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [0, 1]}
    args = dict(model="tiny-moe", max_model_len=512, num_gpu_blocks_override=128, head_wise_swa_config=swa)
    one = make_engine(**args)
    try:
        expected = run(one, prompts()[:4])
        full_bytes = one.runner.model.weight_bytes()
    finally:
        one.close()
    engine = make_engine(tensor_parallel_size=2, balance_swa_heads=True, **args)
    try:
        for info in engine.runner.ranks.rank_info:
            # Only norms and the router are replicated: each rank holds a bit over half the weights.
            assert 0.5 * full_bytes < info["weight_bytes"] < 0.55 * full_bytes
        assert_same_within_tolerance(expected, run(engine, prompts()[:4]))
    finally:
        engine.close()


def test_a_rank_that_cannot_load_fails_start_up_with_its_error_and_no_worker_is_left(tmp_path):
    from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(dict(TINY_PRESET_CONFIG, fastdeploy_byte_tokenizer=True)))
    with pytest.raises(WorkerFailure, match=r"rank \d failed: ValueError: .*safetensors"):
        make_engine(model=str(tmp_path), tensor_parallel_size=2)
    assert our_workers() == []


def test_workers_die_with_an_engine_process_that_is_killed(tmp_path):
    """SIGKILL gives the engine no chance to stop its ranks: they go by PR_SET_PDEATHSIG."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    code = ("from fastdeploy import LLM; import sys, time;"
            "llm = LLM(tensor_parallel_size=2, block_size=16, num_gpu_blocks_override=32);"
            "print(*llm.engine.runner.worker_pids, flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and not any(worker_gone(p) for p in pids)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        while not all(worker_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(worker_gone(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
