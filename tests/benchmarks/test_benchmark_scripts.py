"""The benchmark scripts users run still run: each one, tiny, through its real command line."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script, *args, timeout=240, **env_flags):
    env = dict(os.environ, FD_LOG_INTERVAL="0", **env_flags)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_offline_runs_both_arms_with_identical_tokens(tmp_path):
    out = tmp_path / "ab.json"
    run("bench_offline.py", "--num-prompts", "6", "--input-len", "48", "--output-len", "24", "--window", "16",
        "--sink", "0", "--concurrency-off", "2", "--json", str(out))
    result = json.loads(out.read_text())
    for key in ("throughput_off", "throughput_on", "gain", "ceiling", "peak_running_off", "peak_running_on"):
        assert key in result
    assert result["identical_tokens"] is True
    assert result["peak_running_on"] / result["peak_running_off"] == pytest.approx(result["ceiling"])
    for arm in ("off", "on"):  # per-arm memory use and recompute cost, for the admission policy in use
        assert 0 < result[f"avg_pages_{arm}"] <= result[f"peak_pages_{arm}"] <= result["pages_total"]
        assert result[f"preemptions_{arm}"] == 0 and result[f"recomputed_tokens_{arm}"] == 0
    assert result["admission_policy"] == "projected"  # the default
    # The full step's median cost per arm, next to the mean of all steps.
    assert result["median_full_step_s_off"] > 0 and result["median_full_step_s_on"] > 0
    assert result["median_full_step_ratio"] == pytest.approx(
        result["median_full_step_s_on"] / result["median_full_step_s_off"])


def test_bench_offline_runs_the_moe_miniature(tmp_path):
    out = tmp_path / "moe.json"
    run("bench_offline.py", "--model", "tiny-moe", "--num-prompts", "4", "--input-len", "40", "--output-len", "16",
        "--window", "16", "--sink", "0", "--concurrency-off", "2", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["args"]["model"] == "tiny-moe" and result["identical_tokens"] is True


def test_bench_offline_swa_config_json_replaces_the_window_flags(tmp_path):
    out = tmp_path / "json_cfg.json"
    # --window 4096 alone would make the ceiling 1 (nothing leaves the window); the JSON spec wins.
    run("bench_offline.py", "--num-prompts", "6", "--input-len", "48", "--output-len", "24", "--window", "4096",
        "--head-wise-swa-config", '{"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [0, 1]}',
        "--concurrency-off", "4", "--json", str(out))
    result = json.loads(out.read_text())
    # By hand: 71 cached tokens are 5 blocks per head; 4 x 4 x 5 = 80 pages. OFF: 20 pages -> 4 running;
    # ON: the two SWA heads (W 16) hold 2 blocks each, 2 x 5 + 2 x 2 = 14 pages -> 5 running.
    assert result["ceiling"] == pytest.approx(5 / 4) and result["identical_tokens"] is True
    assert result["peak_running_on"] / result["peak_running_off"] == pytest.approx(result["ceiling"])
    assert "gain_share_of_steps_gain" in result


def test_bench_offline_on_a_model_with_sliding_layers_runs_1d_against_slots(tmp_path):
    out, plot = tmp_path / "sliding.json", tmp_path / "sliding.png"
    run("bench_offline.py", "--model", "tiny-sliding-layers", "--num-prompts", "6", "--input-len", "96",
        "--output-len", "24", "--concurrency-off", "2", "--max-num-batched-tokens", "32", "--json", str(out),
        "--plot", str(plot))
    assert plot.read_bytes().startswith(b"\x89PNG")
    result = json.loads(out.read_text())
    # No head-wise section is added: the model's own layers slide (5 of 6, W 48, 2 KV heads -> one lane of
    # 12 slots, 10 sliding), OFF is the 1-D cache.
    assert result["off_arm"] == "1-D" and result["identical_tokens"] is True
    assert result["slot_layout"].startswith("1 lane(s) of 6 layer(s), 12 slot(s)")
    # By hand, once decoding (positions 96..118, block 16): OFF keeps ceil(119 / 16) = 8 blocks of all 12
    # slots; ON keeps 8 blocks of the 2 full slots and, of each sliding slot, the 4 blocks a 48-token window
    # reaches back into (position 112: blocks 4..7).
    assert (result["peak_pages_per_decoding_request_off"], result["peak_pages_per_decoding_request_on"]) == (96, 56)
    assert result["peak_running_on"] > result["peak_running_off"] == 2
    assert result["steps_on"] < result["steps_off"]


def test_bench_request_pages_counts_one_request_with_the_flag_off_and_on(tmp_path):
    out, plot = tmp_path / "pages.json", tmp_path / "pages.png"
    run("bench_request_pages.py", "--models", "tiny-sliding-layers", "--prompt-len", "96", "--output-len", "24",
        "--block-size", "16", "--max-num-batched-tokens", "32", "--json", str(out), "--plot", str(plot))
    off, on = json.loads(out.read_text())["models"]["tiny-sliding-layers"].values()
    # Prefill in chunks of 32, then one token a step; the last step computes position 118.
    assert off["tokens"][:4] == on["tokens"][:4] == [0, 32, 64, 96] and off["tokens"][-1] == 119
    # By hand (12 slots, 10 sliding with W 48): 1-D keeps ceil(119 / 16) = 8 blocks of every slot; the flag
    # keeps 8 blocks of the 2 full slots and the 4 blocks of each sliding slot its window reaches (as
    # bench_offline's count of the same layout).
    assert (off["end"], on["end"]) == (96, 56)
    # The last prefill chunk (tokens 64..95): 1-D holds 6 blocks of every slot; the sliding slots have
    # recycled block 0 (keys 0..15 are out of every query's window from position 64 on).
    assert (off["prefill_peak"], on["prefill_peak"]) == (72, 2 * 6 + 10 * 5)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_bench_request_pages_recycles_each_window_with_its_own_rule(tmp_path):
    """Per-head windows: layer 0's head 0 slides with W 16, layer 1's with W 48 (one lane, 8 slots: 6 full
    and one of each window). The script checks every step against the page-need function itself."""
    out = tmp_path / "pages.json"
    spec = {"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [[0], [0]], "head_windows": [[16], [48]]}
    run("bench_request_pages.py", "--models", "ernie-4.5-tiny-swa", "--prompt-len", "96", "--output-len", "24",
        "--block-size", "16", "--max-num-batched-tokens", "32", "--head-wise-swa-config", json.dumps(spec),
        "--json", str(out))
    off, on = json.loads(out.read_text())["models"]["ernie-4.5-tiny-swa"].values()
    # The last step (118 processed): 8 blocks per full slot; W 16 keeps blocks 6..7, W 48 blocks 4..7.
    assert (off["end"], on["end"]) == (8 * 8, 6 * 8 + 2 + 4)
    # The last prefill chunk starts at 64: W 16 has blocks 0..2 dead, W 48 block 0.
    assert (off["prefill_peak"], on["prefill_peak"]) == (8 * 6, 6 * 6 + 3 + 5)


def test_bench_offline_rejects_a_bad_swa_config_without_a_traceback():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_offline.py"),
                           "--head-wise-swa-config", "{sliding_window: 16"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert "--head-wise-swa-config is not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_weight_rss_holds_each_weight_once(tmp_path):
    out = tmp_path / "rss.json"
    run("bench_weight_rss.py", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["weight_bytes"] > 300 * 2 ** 20  # large enough that allocator noise is small next to it
    assert result["ratio"] <= 1.3


def test_bench_scheduler_prints_both_arms(tmp_path):
    out = tmp_path / "sched.json"
    run("bench_scheduler.py", "--running", "8", "--context", "512", "--decode-steps", "5", "--kv-heads", "4",
        "--max-num-batched-tokens", "512", "--window", "128", "--gemma3", "--json", str(out))
    row, gemma3 = json.loads(out.read_text())
    assert row["one_d_ms"] > 0 and row["head_wise_ms"] > 0 and row["slots"] == 4
    assert (gemma3["lanes"], gemma3["slots"]) == (3, 6) and gemma3["pages_recycled"] > 0


def test_bench_prefix_caching_hits_and_keeps_tokens(tmp_path):
    out = tmp_path / "pc.json"
    run("bench_prefix_caching.py", "--prefixes", "2", "--prefix-len", "64", "--requests", "4", "--chats", "2",
        "--turns", "2", "--json", str(out))
    results = json.loads(out.read_text())["results"]
    assert {r["workload"] for r in results} >= {"shared-prefix", "multi-turn"}
    assert all(r["identical_tokens"] for r in results)
    assert any(r["on"]["hit_rate"] > 0 for r in results)


def test_bench_head_wise_swa_runs_both_servers_and_splits_the_gain(tmp_path):
    out, plot = tmp_path / "ab.json", tmp_path / "ab.png"
    # 12 requests: three waves of 4 with recycling OFF, two of 6 with it ON. Reserve admission keeps
    # the waves exact whatever the arrival timing (projected admission may let a staggered one in).
    stdout = run("bench_head_wise_swa.py", "--num-prompts", "12", "--input-len", "32", "--output-len", "48",
                 "--max-model-len", "96", "--num-gpu-blocks-override", "24", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "128",
                 "--head-wise-swa-config", '{"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [0, 1]}',
                 "--json", str(out), "--plot", str(plot), "--log-dir", str(tmp_path),
                 FD_ADMISSION_POLICY="reserve")
    result = json.loads(out.read_text())
    assert result["failed_off"] == result["failed_on"] == 0
    assert result["engine_steps_off"] > result["engine_steps_on"] > 0
    # By hand: 32 + 48 tokens compute positions 0..78, 5 blocks per head at the peak. 24 blocks x 4
    # heads = 96 pages. OFF: 4 x 5 = 20 pages -> 4 running. ON: the SWA heads (W 16) hold 2 blocks
    # each, 2 x 5 + 2 x 2 = 14 pages -> 6 running.
    assert (result["predicted_running_off"], result["predicted_running_on"], result["ceiling"]) == (4, 6, 1.5)
    assert result["peak_running_off"] <= 4 and result["peak_running_on"] <= 6
    assert result["total_output_tokens_off"] == result["total_output_tokens_on"] == 12 * 48
    # One token per running request per step: at least 12 x 48 / 4 steps OFF and / 6 ON. Fewer than
    # 144 steps ON proves ON ran more than 4 at once (the sampled peak_running can miss a short peak
    # on a loaded machine, so the exact step counters carry this assertion).
    assert result["engine_steps_off"] >= 144 and 96 <= result["engine_steps_on"] < 144
    assert "Engine steps" in stdout and plot.stat().st_size > 0


def test_bench_linear_cpu_prints_every_gemm_next_to_the_peak(tmp_path):
    out = tmp_path / "gemm.json"
    text = run("bench_linear_cpu.py", "--rows", "1", "3", "--shapes", "qkv fused", "--seconds", "0.01",
               "--json", str(out))
    result = json.loads(out.read_text())
    assert result["peak_gflops"] > 0 and "GEMM peak" in text
    assert [c["m"] for c in result["cells"]] == [1, 3]
    assert all(c[k] > 0 for c in result["cells"] for k in ("paddle", "packed", "sgemm", "numpy"))


def test_bench_decode_cpu_reports_tokens_per_second(tmp_path):
    out = tmp_path / "decode.json"
    run("bench_decode_cpu.py", "--model", "tiny-moe", "--concurrency", "1", "2", "--input-len", "8",
        "--output-len", "4", "--json", str(out))
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result] == [1, 2]
    assert [r["output_tokens"] for r in result] == [4, 8] and all(r["tok_per_s"] > 0 for r in result)


def test_bench_decode_cpu_head_wise_ab_times_both_flags_interleaved_with_host_parts(tmp_path):
    out = tmp_path / "flag.json"
    stdout = run("bench_decode_cpu.py", "--model", "tiny-moe", "--head-wise-ab", "--concurrency", "1", "2",
                 "--input-lens", "8", "--decode-steps", "3", "--repeats", "2", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [(r["concurrency"], r["head_wise_kv_cache"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(r["weights"].endswith(" MB") and r["decode_tok_per_s"] > 0 for r in rows)
    assert all(set(r["parts_ms"]) >= {"schedule", "step_input", "buffers", "attention", "host"} for r in rows)
    assert "repeated on one batch" in stdout


def test_bench_speculative_runs_both_arms_interleaved_with_identical_tokens(tmp_path):
    out = tmp_path / "spec.json"
    stdout = run("bench_speculative.py", "--model", "tiny-moe", "--rounds", "2", "--max-tokens", "8",
                 "--batch-sizes", "3", "--kv-cache-memory", str(64 << 20), "--json", str(out))
    result = json.loads(out.read_text())
    assert result["identical_tokens"] is True and "identical tokens with and without speculation: True" in stdout
    for group in ("copy", "chat"):
        row = result["single_stream"][group]
        assert row["tok_s_off"] > 0 and row["tok_s_on"] > 0 and len(row["ratios"]) == 2
        assert 0 <= row["acceptance_rate"] <= 1
    assert set(result["batched"]) == {"N=3"}


def test_bench_structured_outputs_runs_both_arms_and_times_the_compile(tmp_path):
    out = tmp_path / "structured.json"
    run("bench_structured_outputs.py", "--model", "None", "--rounds", "1", "--max-tokens", "8", "--concurrency", "2",
        "--kv-cache-memory", str(64 << 20), "--json", str(out))
    result = json.loads(out.read_text())
    assert set(result["decode_tok_s"]) == {"free", "json_schema"} and all(v > 0 for v in result["decode_tok_s"].values())
    assert len(result["ratio_per_round"]) == 1 and result["compile"]
