"""A prefill engine and a decode engine moving a prompt's KV over NIXL (UCX, host memory), in one
process: the decode engine's greedy output equals one plain engine's, in 1-D and head-wise mode, with
float32 and int8 pages; only the pages a query can still read move and are held; every page is free
again on both sides afterwards; reads that fail are recomputed or fail with their reason; pages
nobody reads expire; layouts that differ are refused at the handshake.

The oracle is a plain engine on the same weights and flags (the mixed server); the transferred bytes
are also compared page by page with the prefill engine's own.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="KV transfer needs NIXL: pip install -e \".[cpu,pd]\"")

from fastdeploy.engine.args_utils import EngineArgs  # noqa: E402
from fastdeploy.engine.engine import LLMEngine  # noqa: E402
from fastdeploy.engine.request import SamplingParams  # noqa: E402
from fastdeploy.entrypoints.openai.server_process import free_port  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

BLOCK = 16
# Head 0 of every layer slides (window 40, sink 4): a 200-token prompt leaves it 4 of 13 blocks.
HEAD_WISE = '{"sliding_window": 40, "sink_size": 4, "swa_kv_heads": [0]}'
MODES = {"1d": ("0", None), "head_wise": ("1", HEAD_WISE)}
# 161 tokens: the KV sent (160 tokens) ends on a block boundary, the last prompt token starts a new block.
PROMPTS = [list(range(7, 44)), [(5 * i + 3) % 250 + 1 for i in range(200)], [(11 * i) % 240 + 2 for i in range(333)],
           [(7 * i) % 230 + 9 for i in range(161)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@contextmanager
def env(**flags):
    old = {k: os.environ.get(k) for k in flags}
    os.environ.update(flags)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_engine(mode: str, role: str = "mixed", quant: str = "none", block_size: int = BLOCK, **engine) -> LLMEngine:
    """`engine`: more EngineArgs; `transfer=` entries of --kv-transfer-config."""
    head_wise, swa = MODES[mode]
    config = None
    if role != "mixed":
        config = {"kv_connector": "NixlConnector", "side_channel_port": 0, **engine.pop("transfer", {})}
    with env(FD_HEAD_WISE_KV_CACHE=head_wise):
        return LLMEngine.from_engine_args(EngineArgs(
            max_model_len=1024, num_gpu_blocks_override=160, block_size=block_size, head_wise_swa_config=swa,
            kv_cache_quant_type=quant, splitwise_role=role, kv_transfer_config=config, **engine))


def run(engine: LLMEngine, rid: str, prompt, params=GREEDY, kv=None, timeout_s: float = 60):
    engine.add_request(rid, prompt, params, kv)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} did not finish in {timeout_s} s")


def settle(*engines, timeout_s: float = 10) -> None:
    """Step until no transfer or parked page is left to watch (a prefill frees pages on the read's notice)."""
    deadline = time.monotonic() + timeout_s
    while any(e.transfers_pending for e in engines) and time.monotonic() < deadline:
        for e in engines:
            e.step()
        time.sleep(0.002)


def all_free(engine) -> bool:
    pages = engine.scheduler.cache_manager
    engine.scheduler.check_integrity()
    return pages.num_free_pages == pages.num_total_pages


@pytest.fixture(scope="module", params=[("1d", "none"), ("head_wise", "none"), ("1d", "int8"), ("head_wise", "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def trio(request):
    mode, quant = request.param
    engines = (make_engine(mode, "prefill", quant), make_engine(mode, "decode", quant), make_engine(mode, quant=quant))
    yield (mode, quant) + engines
    for e in engines:
        e.close()


def test_decode_through_transferred_pages_equals_one_engine(trio):
    mode, quant, prefill, decode, mixed = trio
    for k, prompt in enumerate(PROMPTS):
        want = run(mixed, f"m{k}", prompt).outputs.token_ids
        handed = run(prefill, f"p{k}", prompt, SamplingParams(temperature=0, max_tokens=1), {"do_remote_decode": True})
        params = handed.kv_transfer_params
        assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == len(prompt) - 1
        assert handed.outputs.token_ids == want[:1]
        got = run(decode, f"d{k}", prompt, kv=params)
        assert got.outputs.token_ids == want, f"{mode}/{quant}, prompt {k}"
    settle(prefill, decode)
    assert all_free(prefill) and all_free(decode)
    stats_p, stats_d = prefill.get_stats(), decode.get_stats()
    assert stats_p["kv_transfer_requests_sent_total"] == stats_d["kv_transfer_requests_received_total"] == len(PROMPTS)
    assert stats_p["kv_transfer_bytes_sent_total"] == stats_d["kv_transfer_bytes_received_total"] > 0
    assert sum(stats_d["kv_transfer_seconds"]["counts"]) == len(PROMPTS)


def test_received_pages_hold_the_prefill_pages_bytes(trio):
    """Byte for byte, every live entry on the decode side equals the prefill side's, in every KV tensor
    (codes and scales for int8 pages); dead entries are neither sent nor held."""
    mode, quant, prefill, decode, _ = trio
    prompt = PROMPTS[2]
    params = run(prefill, "bp", prompt, SamplingParams(temperature=0, max_tokens=1),
                 {"do_remote_decode": True}).kv_transfer_params
    decode.add_request("bd", prompt, GREEDY, params)
    deadline = time.monotonic() + 30
    kv = decode.scheduler.kv_cache_manager
    while time.monotonic() < deadline:
        decode.step()
        request = decode.scheduler.requests["bd"]
        if kv.holds("bd") and not request.kv_loading:
            break
    live = kv.live_pages("bd", len(prompt) - 1)
    unit_p = prefill.connector.regions
    tensors_p, tensors_d = prefill.runner.kv_tensors(), decode.runner.kv_tensors()
    lanes = len(prefill.runner.ranks.attn_backend.lane_keys)
    assert len(tensors_p) == len(tensors_d) == lanes * (4 if quant == "int8" else 2)  # K, V (+ their scales)
    checked = 0
    for row, (entries, theirs) in enumerate(zip(live, params["remote_block_ids"])):
        for i, page in entries:
            for tp, td, (_, unit) in zip(tensors_p, tensors_d, unit_p):
                a = tp.numpy().reshape(-1).view(np.uint8)
                b = td.numpy().reshape(-1).view(np.uint8)
                assert np.array_equal(a[theirs[i] * unit:(theirs[i] + 1) * unit], b[page * unit:(page + 1) * unit])
                checked += 1
    assert checked > 0
    held = sum(len(r) - r.count(-1) for r in kv.table("bd"))
    sent = sum(len(r) - r.count(-1) for r in params["remote_block_ids"])
    assert held == sent + (0 if (len(prompt) - 1) % BLOCK else kv.num_rows)  # + the last token's block
    run_out = None
    while run_out is None:
        for out in decode.step():
            if out.request_id == "bd" and out.finished:
                run_out = out
    settle(prefill, decode)
    assert all_free(prefill) and all_free(decode)


# -- what a decode server holds ----------------------------------------------------------------------
def test_head_wise_decode_takes_only_live_pages_as_the_page_arithmetic_says():
    """Head-wise: a sliding row of the decode table holds its sink and window blocks only, the page-need
    arithmetic's count for the prompt; the same prompt in 1-D mode moves every block of every head."""
    prompt = PROMPTS[2]
    n = len(prompt) - 1
    moved = {}
    for mode in ("1d", "head_wise"):
        prefill, decode = make_engine(mode, "prefill"), make_engine(mode, "decode")
        try:
            params = run(prefill, "lp", prompt, SamplingParams(temperature=0, max_tokens=1),
                         {"do_remote_decode": True}).kv_transfer_params
            run(decode, "ld", prompt, SamplingParams(temperature=0, max_tokens=1), params)
            settle(prefill, decode)
            moved[mode] = decode.get_stats()["kv_transfer_pages_received_total"]
            if mode == "head_wise":  # the scheduler's own page-need arithmetic for tokens [0, n)
                assert moved[mode] == sum(decode.scheduler.layout.pages_per_rank(n, 0))
        finally:
            prefill.close()
            decode.close()
    entries = -(-n // BLOCK)
    assert moved["1d"] == entries * 4  # 4 KV heads (slots) per block
    sliding_live = 1 + (entries - (n - 40 + 1) // BLOCK)  # sink block + the window's blocks
    assert moved["head_wise"] == entries * 3 + sliding_live


# -- lifecycle -----------------------------------------------------------------------------------------
def test_parked_pages_nobody_reads_are_freed_after_the_abort_timeout():
    prefill = make_engine("head_wise", "prefill", transfer={"abort_timeout_s": 0.2})
    try:
        run(prefill, "x", PROMPTS[1], SamplingParams(temperature=0, max_tokens=1), {"do_remote_decode": True})
        assert prefill.get_stats()["kv_transfer_parked_requests"] == 1
        assert not all_free(prefill)
        time.sleep(0.3)
        settle(prefill)
        assert all_free(prefill)
        assert prefill.get_stats()["kv_transfer_expired_total"] == 1
    finally:
        prefill.close()


@pytest.fixture(scope="module")
def pair():
    engines = make_engine("head_wise", "prefill"), make_engine("head_wise", "mixed")
    yield engines
    for e in engines:
        e.close()


def expire_parked(prefill) -> None:
    """Free now the parked pages no decode engine will read (as abort_timeout_s would, later)."""
    prefill.connector._parked = dict.fromkeys(prefill.connector._parked, 0.0)
    settle(prefill)
    assert prefill.get_stats()["kv_transfer_parked_requests"] == 0


def dead_prefill_params(prompt, alive_prefill):
    """Real kv_transfer_params of a prefill whose server then vanished (its side channel port closed)."""
    params = run(alive_prefill, f"gone{len(prompt)}", prompt, SamplingParams(temperature=0, max_tokens=1),
                 {"do_remote_decode": True}).kv_transfer_params
    return {**params, "remote_port": free_port(), "remote_engine_id": "vanished"}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_read_from_a_dead_prefill_server_is_recomputed_or_fails_with_its_reason(pair, policy):
    prefill, mixed = pair
    decode = make_engine("head_wise", "decode", transfer={"kv_load_failure_policy": policy,
                                                          "handshake_timeout_s": 0.5})
    try:
        prompt = PROMPTS[1]
        out = run(decode, "dead", prompt, kv=dead_prefill_params(prompt, prefill))
        if policy == "recompute":
            assert out.error is None
            assert out.outputs.token_ids == run(mixed, "ref", prompt).outputs.token_ids
        else:
            assert "did not answer" in out.error and out.finished
        assert decode.get_stats()["kv_transfer_failed_total"] == 1
        assert all_free(decode)
        # the decode engine goes on serving
        assert run(decode, "next", PROMPTS[0]).outputs.token_ids == run(mixed, "ref0", PROMPTS[0]).outputs.token_ids
    finally:
        decode.close()
        expire_parked(prefill)


def test_a_different_block_size_is_refused_at_the_handshake_by_name(pair):
    prefill, _ = pair
    decode = make_engine("head_wise", "decode", block_size=32, transfer={"kv_load_failure_policy": "fail"})
    try:
        prompt = PROMPTS[1]
        params = run(prefill, "bs", prompt, SamplingParams(temperature=0, max_tokens=1),
                     {"do_remote_decode": True}).kv_transfer_params
        out = run(decode, "bs", prompt, kv=params)
        assert out.error is not None and "block_size: prefill 16, decode 32" in out.error
        assert all_free(decode)
    finally:
        decode.close()
        expire_parked(prefill)


def test_a_prefix_hit_on_the_prefill_server_sends_the_hit_pages_too(pair):
    prefill, mixed = pair
    decode = make_engine("head_wise", "decode")
    try:
        prompt = PROMPTS[2]
        one = SamplingParams(temperature=0, max_tokens=1)
        run(prefill, "warm", prompt, one)  # fills the prefix cache
        handed = run(prefill, "hit", prompt, one, {"do_remote_decode": True})
        assert prefill.scheduler.prefix_cache_hit_tokens_total > 0
        out = run(decode, "hit", prompt, kv=handed.kv_transfer_params)
        assert out.outputs.token_ids == run(mixed, "hitref", prompt).outputs.token_ids
        settle(prefill, decode)
        prefill.scheduler.check_integrity()
        assert prefill.get_stats()["kv_transfer_parked_requests"] == 0 and all_free(decode)
    finally:
        decode.close()


def test_speculative_decoding_and_a_grammar_run_on_the_decode_server(pair):
    from fastdeploy.model_executor.guided_decoding.params import GuidedDecodingParams

    prefill, mixed = pair
    decode = make_engine("head_wise", "decode",
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        prompt = PROMPTS[0] * 3
        params = SamplingParams(temperature=0, max_tokens=16, guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
        for k, sampling in enumerate((GREEDY, params)):
            handed = run(prefill, f"s{k}", prompt, SamplingParams(temperature=0, max_tokens=1),
                         {"do_remote_decode": True})
            got = run(decode, f"s{k}", prompt, sampling, handed.kv_transfer_params)
            assert got.outputs.token_ids == run(mixed, f"sref{k}", prompt, sampling).outputs.token_ids
        assert decode.get_stats()["spec_decode_num_draft_tokens_total"] > 0
        settle(prefill, decode)
        assert all_free(decode)
    finally:
        decode.close()


def test_an_abort_while_the_pages_are_read_frees_them_when_the_read_ends(pair):
    prefill, _ = pair
    decode = make_engine("head_wise", "decode")
    try:
        prompt = PROMPTS[2]
        handed = run(prefill, "ab", prompt, SamplingParams(temperature=0, max_tokens=1), {"do_remote_decode": True})
        decode.add_request("ab", prompt, GREEDY, handed.kv_transfer_params)
        decode.step()  # admitted: its pages are taken and the read starts
        assert decode.scheduler.requests["ab"].kv_loading
        decode.abort_request("ab")
        settle(prefill, decode)
        assert all_free(decode)
    finally:
        decode.close()


@pytest.mark.parametrize("params, message", [
    ({"do_remote_prefill": True}, "remote_engine_id must be a string"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill must be true or false"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, "cannot both be true"),
    ({"do_remote_decode": True}, "role is decode"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
      "remote_port": 1, "remote_block_ids": [[1]], "remote_num_tokens": 5}, "tokenized different prompts"),
])
def test_bad_kv_transfer_params_are_refused_with_the_field_named(pair, params, message):
    _, mixed = pair
    decode = make_engine("head_wise", "decode")
    try:
        with pytest.raises(ValueError, match=message):
            decode.add_request("bad", PROMPTS[0], GREEDY, params)
        assert not decode.has_unfinished_requests()
    finally:
        decode.close()
    with pytest.raises(ValueError, match="moves no KV"):
        mixed.add_request("bad", PROMPTS[0], GREEDY, {"do_remote_decode": True})


def test_a_head_wise_prefill_and_a_1d_decode_are_refused_by_name(pair):
    """Different FD_HEAD_WISE_KV_CACHE on the two servers: the tables differ in rows, refused before any
    page is taken (and a different window, same rows, at the handshake: the layout's slot types)."""
    prefill, _ = pair
    decode = make_engine("1d", "decode")
    try:
        params = run(prefill, "hw", PROMPTS[1], SamplingParams(temperature=0, max_tokens=1),
                     {"do_remote_decode": True}).kv_transfer_params
        with pytest.raises(ValueError, match="KV layouts differ"):
            decode.add_request("hw", PROMPTS[1], GREEDY, params)
        assert all_free(decode)
    finally:
        decode.close()
        expire_parked(prefill)


def test_a_second_read_of_the_same_parked_pages_is_refused_and_recomputed(pair):
    """A retried decode request carries kv_transfer_params whose pages were read and freed already (and
    may hold another request's KV now): it is never read twice; the prompt is computed here instead."""
    prefill, mixed = pair
    decode = make_engine("head_wise", "decode")
    try:
        prompt = PROMPTS[2]
        params = run(prefill, "twice", prompt, SamplingParams(temperature=0, max_tokens=1),
                     {"do_remote_decode": True}).kv_transfer_params
        want = run(mixed, "twice-ref", prompt).outputs.token_ids
        assert run(decode, "first", prompt, kv=params).outputs.token_ids == want
        settle(prefill, decode)
        run(prefill, "other", PROMPTS[1][::-1] * 2, SamplingParams(temperature=0, max_tokens=4))  # reuses the pages
        assert run(decode, "again", prompt, kv=params).outputs.token_ids == want
        assert decode.get_stats()["kv_transfer_failed_total"] == 1
        assert all_free(decode)
    finally:
        decode.close()
