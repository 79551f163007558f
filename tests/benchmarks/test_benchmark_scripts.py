"""The benchmark scripts users run still run: each one, tiny, through its real command line."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(script, *args, timeout=240, **env_flags):
    env = dict(os.environ, FD_LOG_INTERVAL="0", **env_flags)
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_scheduler_prints_both_arms(tmp_path):
    out = tmp_path / "sched.json"
    run("bench_scheduler.py", "--running", "1", "8", "--context", "512", "--decode-steps", "5", "--kv-heads", "4",
        "--max-num-batched-tokens", "512", "--window", "128", "--gemma3", "--json", str(out))
    one, row, _, gemma3 = json.loads(out.read_text())
    assert (one["running"], row["running"]) == (1, 8) and row["slots"] == 4
    for arm in ("one_d_ms", "head_wise_ms"):  # the host step is its parts
        parts = row[arm]
        assert parts["host step"] > 0 and parts["schedule"] > 0 and parts["step input"] > 0 and parts["update"] > 0
    assert (gemma3["lanes"], gemma3["slots"]) == (3, 6) and gemma3["pages_recycled"] > 0


def test_bench_prefix_caching_hits_and_keeps_tokens(tmp_path):
    out = tmp_path / "pc.json"
    run("bench_prefix_caching.py", "--prefixes", "2", "--prefix-len", "64", "--requests", "4", "--chats", "2",
        "--turns", "2", "--json", str(out))
    results = json.loads(out.read_text())["results"]
    assert {r["workload"] for r in results} >= {"shared-prefix", "multi-turn"}
    assert all(r["identical_tokens"] for r in results)
    assert any(r["on"]["hit_rate"] > 0 for r in results)


def test_bench_append_attention_cpu_times_every_arm_and_page_format(tmp_path):
    out = tmp_path / "attn.json"
    run("bench_append_attention_cpu.py", "--contexts", "256", "--batch", "2", "--num-heads", "4", "--kv-heads", "2",
        "--head-dim", "32", "--block-size", "16", "--window", "64", "--sink", "16", "--reps", "2", "--prefill-lens",
        "128", "--page-formats", "float32", "int8", "k8v4", "--json", str(out))
    result = json.loads(out.read_text())
    assert [r["arm"] for r in result["steps"]] == ["full", "1 SWA 1d-mask", "1 SWA headwise", "2 SWA 1d-mask",
                                                   "2 SWA headwise"]
    formats = result["page_formats"]
    assert [r["page_format"] for r in formats] == ["float32", "int8", "k8v4"]
    assert formats[0]["kv_mb"] > formats[1]["kv_mb"] > formats[2]["kv_mb"]  # k8v4: int4 values beside int8 keys
    assert [r["arm"] for r in result["prefill"]] == ["full", "2 SWA"] and len(result["threads"]) == 2


def test_bench_append_attention_cpu_times_the_sink_and_soft_cap_terms(tmp_path):
    out = tmp_path / "mods.json"
    run("bench_append_attention_cpu.py", "--contexts", "128", "--batch", "2", "--num-heads", "4", "--kv-heads", "2",
        "--head-dim", "32", "--block-size", "16", "--reps", "2", "--prefill-lens", "64", "--score-mods", "--skip-arms",
        "--json", str(out))
    result = json.loads(out.read_text())
    assert [r["mods"] for r in result["score_mods"]] == ["none", "sinks", "softcap", "sinks+softcap"]
    assert result["score_mods"][0]["vs_none"] == 1.0 and all(r["ms"] > 0 for r in result["score_mods"])
    assert [r["arm"] for r in result["prefill_score_mods"]] == ["none", "sinks", "softcap", "sinks+softcap"]


def test_bench_linear_cpu_prints_every_gemm_next_to_the_peak(tmp_path):
    out = tmp_path / "gemm.json"
    text = run("bench_linear_cpu.py", "--rows", "1", "3", "--shapes", "qkv fused", "--seconds", "0.01",
               "--json", str(out))
    result = json.loads(out.read_text())
    assert result["peak_gflops"] > 0 and "GEMM peak" in text
    assert [c["m"] for c in result["cells"]] == [1, 3]
    assert all(c[k] > 0 for c in result["cells"] for k in ("paddle", "packed", "unpacked", "numpy"))


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


def test_bench_decode_cpu_step_breakdown_splits_a_step_into_ops_and_host_parts(tmp_path):
    """The flag that replaced bench_decode_step_breakdown.py (--steps, --clock as before)."""
    out = tmp_path / "breakdown.json"
    stdout = run("bench_decode_cpu.py", "--step-breakdown", "--model", "tiny-moe", "--input-len", "8", "--steps", "3",
                 "--clock", "cpu", "--json", str(out))
    result = json.loads(out.read_text())
    assert result["steps"] == 3 and result["ms"]["step"] > 0 and result["ops_ms"]
    assert result["host_parts_ms"]["schedule"] > 0 and "ops per step" in stdout


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


def test_bench_disaggregation_moves_fewer_bytes_with_the_flag_on(tmp_path):
    import pytest

    pytest.importorskip("nixl_cu12", reason="pip install -e \".[cpu,pd]\"")
    out = tmp_path / "pd.json"
    run("bench_disaggregation.py", "bytes", "--models", "smollm2-135m-instruct", "--lengths", "1500",
        "--json", str(out))
    off, on = json.loads(out.read_text())
    assert (off["head_wise"], on["head_wise"]) == (0, 1)
    for row in (off, on):  # the bytes a read moved are the page-need arithmetic's, exactly
        assert row["bytes_moved"] == row["arithmetic_bytes"] > 0 and row["read_gbps"] > 0
    assert on["ratio_to_flag_off"] < 1


def test_bench_prefix_tiers_runs_every_arm_and_keeps_tokens(tmp_path):
    """A pool too small for two sessions' histories: the host arm serves hits from its tier, tokens equal."""
    out = tmp_path / "tiers.json"
    run("bench_prefix_tiers.py", "--sessions", "3", "--turns", "2", "--system-tokens", "200", "--max-tokens", "4",
        "--head-wise", "1", "--concurrency", "1", "--kv-cache-memory", str(24 << 20), "--swap-space", "0.1",
        "--copy-mib", "16", "--json", str(out), timeout=600)
    result = json.loads(out.read_text())
    assert {r["arm"] for r in result["rows"]} == {"none", "host", "host-wait", "ceiling"}
    assert all(c["differ"] == 0 for c in result["identical_tokens"])
    host = next(r for r in result["rows"] if r["arm"] == "host")
    none = next(r for r in result["rows"] if r["arm"] == "none")
    assert host["hit_rate"] > none["hit_rate"]


def test_bench_tier_restart_hits_after_the_restart_with_the_tokens_of_a_cold_start(tmp_path):
    """Two sessions, one turn before a clean shutdown into the disk tier: the turn after the restart hits, the
    cold start does not, and both give the same greedy tokens."""
    out = tmp_path / "restart.json"
    run("bench_tier_restart.py", "--sessions", "2", "--turns", "2", "--system-tokens", "200", "--max-tokens", "4",
        "--head-wise", "1", "--concurrency", "2", "--swap-space", "0.01", "--json", str(out), timeout=600)
    result = json.loads(out.read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert rows["cold"]["hit_rate"] == 0 and rows["disk"]["hit_rate"] > 0.5
    assert rows["disk"]["disk_loaded_pages"] > 0 and rows["disk"]["files"] > 0
    assert all(c["differ"] == 0 for c in result["identical_tokens"])


def test_page_arithmetic_counts_the_pages_the_retention_rule_keeps_per_published_config(tmp_path):
    out = tmp_path / "pages.json"
    run("page_arithmetic.py", "--tokens", "4096", "--json", str(out))
    rows = {r["model"]: r for r in json.loads(out.read_text())["rows"]}
    # gpt-oss-20b by hand: 256 blocks; 12 full layers x 8 KV heads keep all, 12 sliding layers keep the blocks
    # from (4096 - 128 + 1) // 16 = 248 on: 8 each
    assert rows["gpt-oss-20b"]["pages_off"] == 24 * 8 * 256
    assert rows["gpt-oss-20b"]["pages_on"] == 12 * 8 * 256 + 12 * 8 * 8
    # a window as long as the request recycles nothing
    assert rows["Mistral-7B-v0.1"]["pages_on"] == rows["Mistral-7B-v0.1"]["pages_off"] == 32 * 8 * 256
