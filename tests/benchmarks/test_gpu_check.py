"""benchmarks/gpu_check.py on the CPU: the Paddle-free A/B step loop with the real scheduler (every
packed step checked against the kernel's precondition), the C-ABI arguments it builds, and the JSON
it writes where no GPU exists (parts skipped with reasons, nothing measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The repository root, so `benchmarks` is the repo's folder (pytest puts tests/ first, whose
# benchmarks/ would shadow it) when the project is pip-installed rather than on PYTHONPATH.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import gpu_check  # noqa: E402  (puts tests/custom_ops on sys.path)
import gpu_harness  # noqa: E402
from fastdeploy.worker.step_buffers import HostStepBuffer, StepBufferLayout

ROOT = Path(__file__).resolve().parents[2]
SMALL = gpu_check.ABConfig("small", swa_heads=1, num_layers=2, num_prompts=10, input_len=300, output_len=12,
                           window=64, sink=16, block_size=16, num_gpu_blocks=60, max_num_seqs=8,
                           max_num_batched_tokens=64)  # short chunks: the SWA peak is the window


def needed_entries_present(host: HostStepBuffer, head_windows: list, block_size: int) -> None:
    """The kernel's precondition on the packed tables (docs/retention_rule.md): every block a step reads (its
    heads' visible keys, each head with its own window and sink of head_windows [2, kv_heads]) or writes (the
    new tokens) has a page. Raises naming request/head/block."""
    v, table = host.views, host.table
    for r in range(host.layout.max_num_seqs):
        c, n = int(v["seq_lens_this_time"][r]), int(v["seq_lens_decoder"][r])
        if c == 0:
            continue
        last = (n + c - 1) // block_size
        for h, (window, sink) in enumerate(zip(*head_windows)):
            row = table[r, h if host.layout.table_rows > 1 else 0]
            if window > 0:  # keys j < sink, or j > t - window for some query t in [n, n + c)
                first_live = max(0, n - window + 1) // block_size
                blocks = set(range(first_live, last + 1)) | set(range(-(-min(sink, n + c) // block_size)))
            else:
                blocks = set(range(last + 1))
            for b in sorted(blocks):
                if b >= len(row) or row[b] < 0:
                    raise AssertionError(f"request row {r}, kv head {h}: block {b} is needed but has no page")


class DryExecutor:
    """gpu_check's executor without a device: checks each packed step against the kernel's precondition."""

    def prepare(self, fd_config, layout: StepBufferLayout) -> None:
        # Every layer's windows (layers that look alike checked once).
        self.layer_windows = list({json.dumps(w): w for w in gpu_check.layer_head_windows(fd_config)}.values())
        self.block_size = fd_config.cache_config.block_size

    def step(self, host: HostStepBuffer) -> None:
        for head_windows in self.layer_windows:
            needed_entries_present(host, head_windows, self.block_size)


@pytest.mark.parametrize("swa_heads", [1, 4])
def test_step_loop_runs_every_request_through_the_real_scheduler_with_kernel_valid_tables(swa_heads):
    cfg = gpu_check.ABConfig(**{**SMALL.__dict__, "swa_heads": swa_heads})
    off = gpu_check.run_arm(cfg, False, DryExecutor())
    on = gpu_check.run_arm(cfg, True, DryExecutor())
    for arm in (off, on):
        assert arm["output_tokens"] == cfg.num_prompts * cfg.output_len and not arm["timed_out"]
    assert off["swa_pages_recycled"] == 0 < on["swa_pages_recycled"]
    assert on["peak_running"] >= off["peak_running"]
    if swa_heads == 4:
        assert on["peak_running"] > off["peak_running"] and on["steps"] < off["steps"]


def test_the_precondition_check_catches_a_missing_page():
    class Breaking(DryExecutor):
        def step(self, host):
            host.table[0, 1, 0] = -1  # a full head's first block: always needed
            super().step(host)

    with pytest.raises(AssertionError, match="kv head 1: block 0 is needed"):
        gpu_check.run_arm(SMALL, True, Breaking())


def test_kernel_params_and_addresses_follow_the_c_abi():
    fd = gpu_check.make_fd_config(gpu_check.engine_settings(SMALL), True)
    layout = StepBufferLayout.from_config(fd, fd.table_rows_per_rank)
    params = gpu_check.kernel_params(fd, layout, 37, gpu_harness.BF16)
    assert tuple(params) == gpu_harness.PARAM_FIELDS  # every field, in the struct's order
    assert params["bsz"] == SMALL.max_num_seqs and params["token_num"] == 37
    assert params["max_blocks_per_seq"] == -(-(SMALL.input_len + SMALL.output_len) // SMALL.block_size)
    assert params["head_wise_table"] == 1
    # head_windows [2, kv_heads] per layer: SMALL's one SWA head slides with (64, 16), the others are full
    windows = gpu_check.layer_head_windows(fd)
    assert len(windows) == fd.model_config.num_hidden_layers
    kvh = fd.model_config.num_key_value_heads
    assert all(sorted(zip(*w)) == [(0, 0)] * (kvh - 1) + [(64, 16)] for w in windows), windows
    gpu_harness._Params(**params)  # accepted by the ctypes struct
    addr = gpu_check.buffer_addresses(1 << 20, layout)
    assert addr["seq_lens_encoder"] == 1 << 20
    assert addr["block_tables"] - addr["input_ids"] == 4 * layout.max_num_tokens


def test_the_ab_part_and_its_prediction_import_without_paddle():
    code = ("import sys; sys.modules['paddle'] = None\n"
            "from benchmarks import gpu_check as g\n"
            "cfg = g.ABConfig(**{**g.DEFAULT_AB[0].__dict__, 'num_prompts': 4, 'output_len': 4, 'num_layers': 2})\n"
            "class NoDevice:\n    prepare = step = lambda *args: None\n"
            "print(g.run_arm(cfg, True, NoDevice())['output_tokens'], "
            "round(g.predicted_arm(cfg, True)['output_throughput']) > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["16", "True"]


@pytest.mark.skipif(gpu_harness.driver_gpu_count() > 0, reason="a GPU is visible: the script would measure")
def test_without_a_gpu_the_script_writes_its_json_with_every_part_skipped(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--json", str(out), "--skip", "engine"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing is measured" in proc.stderr
    report = json.loads(out.read_text())
    assert report["schema_version"] == gpu_check.SCHEMA_VERSION
    assert set(gpu_check.PARTS) <= set(report)
    assert report["engine"] == {"skipped": "--skip"}
    for part in ("kernel_tests", "kernel_bench", "ab"):
        assert "no GPU" in report[part]["skipped"]
    assert report["environment"]["gpus_visible"] == 0


def test_engine_comparison_counts_equal_prompts_and_bounds_first_token_logprobs():
    cpu = {"tokens": [[1, 2], [3, 4]], "first_logprobs": [{1: -0.5, 7: -2.0}, {3: -1.0}]}
    gpu = {"tokens": [[1, 2], [3, 5]], "first_logprobs": [{1: -0.52, 7: -2.05}, {3: -1.3}]}
    result = gpu_check.compare_engine_runs(gpu, cpu)
    assert result["greedy_prompts_equal"] == "1/2"
    assert result["first_token_logprob_max_abs_diff"] == pytest.approx(0.3)
    assert result["within_bf16_tolerance"] is False
    gpu["first_logprobs"][1] = {3: -1.05}
    assert gpu_check.compare_engine_runs(gpu, cpu)["within_bf16_tolerance"] is True


def test_one_config_report_carries_both_arms_measured_and_predicted_with_the_design_keys():
    cfg = gpu_check.ABConfig(**{**SMALL.__dict__, "swa_heads": 4})
    report = gpu_check.ab_config_report(cfg, DryExecutor(), float("inf"), "H200")
    for key in ("throughput_off", "throughput_on", "gain", "ceiling", "predicted_gain", "peak_running_off",
                "peak_running_on"):
        assert report[key] is not None, key
    for arm in ("off", "on"):
        assert set(report[arm]) == {"measured", "predicted"}
        # the simulator drives the same scheduler: same steps and concurrency as the measured loop
        assert report[arm]["predicted"]["steps"] == report[arm]["measured"]["steps"]
        assert report[arm]["predicted"]["peak_running"] == report[arm]["measured"]["peak_running"]
    assert report["predicted_gain"] > 1 and report["ceiling"] > 1
    json.dumps(report)  # serialisable as is
