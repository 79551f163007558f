"""bench_recycling.py, the one tool for what recycling buys, through its real command line on each engine
(tiny models; the numbers checked by hand where the page arithmetic gives them)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "benchmarks", "bench_recycling.py")


def run(*args, timeout=300, returncode=0, **env_flags):
    env = dict(os.environ, FD_LOG_INTERVAL="0", **env_flags)
    proc = subprocess.run([sys.executable, TOOL, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == returncode, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


# -- dry: the scheduler alone ---------------------------------------------------------------------
def test_dry_slots_admit_more_requests_than_1d_tables_at_equal_memory(tmp_path):
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    run("--engine", "dry", "--model", "tiny-sliding-layers", "--num-gpu-blocks", "96", "--block-size", "16",
        "--input-len", "300", "--output-len", "40", "--num-prompts", "24", "--max-num-batched-tokens", "128",
        "--json", str(out), "--plot", str(plot))
    result = json.loads(out.read_text())
    assert result["peak_running_on"] > result["peak_running_off"] >= 1 and result["steps_on"] < result["steps_off"]
    assert result["ceiling"] > 1 and result["swa_pages_recycled_on"] > 0 == result["swa_pages_recycled_off"]
    # One request alone: slots + recycling hold fewer pages at the prefill peak and fewer still decoding.
    assert 0 < result["decode_peak_share"] < result["prefill_peak_share"] < 1
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_dry_quantized_pages_compound_with_slots_at_equal_kv_memory(tmp_path):
    """int8 pages hold ~3.6x the pages of float32 (head_dim 32), int4 pages 6.4x (4 * 32 / (16 + 4)), so more
    requests run in each arm, and slots + recycling add to that."""
    out = tmp_path / "r.json"
    run("--engine", "dry", "--model", "tiny-sliding-layers", "--kv-cache-memory", str(3 << 20), "--block-size", "16",
        "--input-len", "300", "--output-len", "40", "--num-prompts", "64", "--max-num-batched-tokens", "128",
        "--kv-cache-quant-types", "none", "int8", "block_wise_int4", "--json", str(out))
    formats = json.loads(out.read_text())["formats"]
    none, int8, int4 = formats["none"], formats["int8"], formats["block_wise_int4"]
    assert int8["off"]["pages"] > 3.5 * none["off"]["pages"] and int4["off"]["pages"] > 6 * none["off"]["pages"]
    assert int4["off"]["peak_running"] > int8["off"]["peak_running"] > none["off"]["peak_running"] >= 1
    assert int8["on"]["peak_running"] > int8["off"]["peak_running"]


def test_dry_one_request_counts_its_pages_with_the_flag_off_and_on(tmp_path):
    out, plot = tmp_path / "pages.json", tmp_path / "pages.png"
    run("--engine", "dry", "--one-request", "--model", "tiny-sliding-layers", "--input-len", "96", "--output-len",
        "24", "--block-size", "16", "--max-num-batched-tokens", "32", "--json", str(out), "--plot", str(plot))
    off, on = json.loads(out.read_text())["models"]["tiny-sliding-layers"].values()
    # Prefill in chunks of 32, then one token a step; the last step computes position 118.
    assert off["tokens"][:4] == on["tokens"][:4] == [0, 32, 64, 96] and off["tokens"][-1] == 119
    # By hand (12 slots, 10 sliding with W 48): 1-D keeps ceil(119 / 16) = 8 blocks of every slot; the flag
    # keeps 8 blocks of the 2 full slots and the 4 blocks of each sliding slot its window reaches.
    assert (off["end"], on["end"]) == (96, 56)
    # The last prefill chunk (tokens 64..95): 1-D holds 6 blocks of every slot; the sliding slots have
    # recycled block 0 (keys 0..15 are out of every query's window from position 64 on).
    assert (off["prefill_peak"], on["prefill_peak"]) == (72, 2 * 6 + 10 * 5)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_dry_one_request_recycles_each_window_with_its_own_rule(tmp_path):
    """Per-head windows: layer 0's head 0 slides with W 16, layer 1's with W 48 (one lane, 8 slots: 6 full
    and one of each window). The tool checks every step against the page-need function itself."""
    out = tmp_path / "pages.json"
    spec = {"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [[0], [0]], "head_windows": [[16], [48]]}
    run("--engine", "dry", "--one-request", "--model", "ernie-4.5-tiny-swa", "--input-len", "96", "--output-len",
        "24", "--block-size", "16", "--max-num-batched-tokens", "32", "--head-wise-swa-config", json.dumps(spec),
        "--json", str(out))
    off, on = json.loads(out.read_text())["models"]["ernie-4.5-tiny-swa"].values()
    assert (off["end"], on["end"]) == (8 * 8, 6 * 8 + 2 + 4)  # W 16 keeps blocks 6..7, W 48 blocks 4..7
    assert (off["prefill_peak"], on["prefill_peak"]) == (8 * 6, 6 * 6 + 3 + 5)


def test_dry_tp_placements_show_the_fullest_rank_capping_the_ceiling():
    table = run("--engine", "dry", "--tp-placements", "--tensor-parallel-sizes", "1", "2").stdout
    # Two SWA heads in load order sit on rank 0 of 2: rank 1 recycles nothing, the engine's ceiling is 1.
    assert "| 2 | 2/4 | load order | [2, 0] | 39→39 | 1.00 |" in table
    assert "| 2 | 2/4 | balanced | [1, 1] | 39→60 | 1.54 |" in table


# -- offline: the real engine ---------------------------------------------------------------------
def test_offline_runs_both_arms_with_identical_tokens(tmp_path):
    out = tmp_path / "ab.json"
    run("--engine", "offline", "--num-prompts", "6", "--input-len", "48", "--output-len", "24", "--window", "16",
        "--sink", "0", "--concurrency-off", "2", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["identical_tokens"] is True and result["admission_policy"] == "projected"  # the default
    assert result["peak_running_on"] / result["peak_running_off"] == pytest.approx(result["ceiling"])
    for arm in ("off", "on"):  # per-arm memory use and recompute cost, for the admission policy in use
        assert 0 < result[f"avg_pages_{arm}"] <= result[f"peak_pages_{arm}"] <= result[f"pages_total_{arm}"]
        assert result[f"preemptions_{arm}"] == 0 and result[f"recomputed_tokens_{arm}"] == 0


def test_offline_swa_config_json_replaces_the_window_flags_on_the_moe_miniature(tmp_path):
    out = tmp_path / "json_cfg.json"
    # --window 4096 alone would make the ceiling 1 (nothing leaves the window); the JSON spec wins.
    run("--engine", "offline", "--model", "tiny-moe", "--num-prompts", "6", "--input-len", "48", "--output-len", "24",
        "--window", "4096", "--head-wise-swa-config", '{"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [0, 1]}',
        "--concurrency-off", "4", "--json", str(out))
    result = json.loads(out.read_text())
    # By hand: 71 cached tokens are 5 blocks per head; 4 x 4 x 5 = 80 pages. OFF: 20 pages -> 4 running;
    # ON: the two SWA heads (W 16) hold 2 blocks each, 2 x 5 + 2 x 2 = 14 pages -> 5 running.
    assert result["ceiling"] == pytest.approx(5 / 4) and result["identical_tokens"] is True
    assert result["args"]["model"] == ["tiny-moe"]


def test_offline_on_a_model_with_sliding_layers_runs_1d_against_slots(tmp_path):
    out, plot = tmp_path / "sliding.json", tmp_path / "sliding.png"
    run("--engine", "offline", "--model", "tiny-sliding-layers", "--num-prompts", "6", "--input-len", "96",
        "--output-len", "24", "--concurrency-off", "2", "--max-num-batched-tokens", "32", "--json", str(out),
        "--plot", str(plot))
    assert plot.read_bytes().startswith(b"\x89PNG")
    result = json.loads(out.read_text())
    # No head-wise section is added: the model's own layers slide (5 of 6, W 48, 2 KV heads -> one lane of
    # 12 slots, 10 sliding), OFF is the 1-D cache.
    assert result["off_arm"] == "1-D" and result["identical_tokens"] is True
    assert result["slot_layout"].startswith("1 lane(s) of 6 layer(s), 12 slot(s)")
    # By hand, once decoding (positions 96..118, block 16): OFF keeps ceil(119 / 16) = 8 blocks of all 12
    # slots; ON keeps 8 blocks of the 2 full slots and, of each sliding slot, the 4 blocks of its window.
    assert (result["peak_pages_per_decoding_request_off"], result["peak_pages_per_decoding_request_on"]) == (96, 56)
    assert result["peak_running_on"] > result["peak_running_off"] == 2 and result["steps_on"] < result["steps_off"]


def test_a_bad_swa_config_is_refused_without_a_traceback():
    proc = run("--engine", "offline", "--head-wise-swa-config", "{sliding_window: 16", returncode=2, timeout=60)
    assert "--head-wise-swa-config is not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


# -- server: the real api_server ------------------------------------------------------------------
def test_server_runs_both_servers_and_splits_the_gain(tmp_path):
    out, plot = tmp_path / "ab.json", tmp_path / "ab.png"
    # 12 requests: three waves of 4 with recycling OFF, two of 6 with it ON. Reserve admission keeps
    # the waves exact whatever the arrival timing (projected admission may let a staggered one in).
    stdout = run("--engine", "server", "--num-prompts", "12", "--input-len", "32", "--output-len", "48",
                 "--max-model-len", "96", "--num-gpu-blocks-override", "24", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "128",
                 "--head-wise-swa-config", '{"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [0, 1]}',
                 "--json", str(out), "--plot", str(plot), "--log-dir", str(tmp_path),
                 FD_ADMISSION_POLICY="reserve").stdout
    result = json.loads(out.read_text())
    assert result["failed_off"] == result["failed_on"] == 0
    # By hand: 32 + 48 tokens compute positions 0..78, 5 blocks per head at the peak. 24 blocks x 4
    # heads = 96 pages. OFF: 4 x 5 = 20 pages -> 4 running. ON: the SWA heads (W 16) hold 2 blocks
    # each, 2 x 5 + 2 x 2 = 14 pages -> 6 running.
    assert (result["predicted_running_off"], result["predicted_running_on"], result["ceiling"]) == (4, 6, 1.5)
    assert result["peak_running_off"] <= 4 and result["peak_running_on"] <= 6
    assert result["total_output_tokens_off"] == result["total_output_tokens_on"] == 12 * 48
    # One token per running request per step: at least 12 x 48 / 4 steps OFF and / 6 ON. Fewer than
    # 144 steps ON proves ON ran more than 4 at once (the sampled peak can miss a short one on a loaded
    # machine, so the exact step counters carry this assertion).
    assert result["steps_off"] >= 144 and 96 <= result["steps_on"] < 144
    assert "steps" in stdout and plot.stat().st_size > 0
