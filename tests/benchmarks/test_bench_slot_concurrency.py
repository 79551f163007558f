"""bench_slot_concurrency on the sliding-layer preset: the real scheduler admits more requests with slots +
recycling than with 1-D tables at the same KV memory, and the JSON carries both arms."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_slots_admit_more_requests_than_1d_tables_at_equal_memory(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_slot_concurrency.py"),
                           "--model", "tiny-sliding-layers", "--num-gpu-blocks", "96", "--block-size", "16",
                           "--prompt-len", "300", "--output-len", "40", "--num-requests", "24",
                           "--max-num-batched-tokens", "128", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["peak_running_on"] > result["peak_running_off"] >= 1
    assert result["steps_on"] < result["steps_off"]
    assert result["ceiling"] > 1 and result["arms"]["on"]["recycled"] > 0
    # One request alone: slots + recycling hold fewer pages at the prefill peak and fewer still decoding.
    assert 0 < result["decode_peak_share"] < result["prefill_peak_share"] < 1


def test_quantized_pages_compound_with_slots_at_equal_kv_memory(tmp_path):
    """--kv-cache-memory with --kv-cache-quant-types none int8 block_wise_int4: int8 pages hold ~3.6x the
    pages of float32 (head_dim 32), int4 pages 6.4x (4 * 32 / (16 + 4)), so more requests run in each arm,
    and slots + recycling add to that."""
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_slot_concurrency.py"),
                           "--model", "tiny-sliding-layers", "--kv-cache-memory", str(3 << 20), "--block-size", "16",
                           "--prompt-len", "300", "--output-len", "40", "--num-requests", "64",
                           "--max-num-batched-tokens", "128", "--kv-cache-quant-types", "none", "int8", "block_wise_int4",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    formats = json.loads(out.read_text())["formats"]
    none, int8 = formats["none"], formats["int8"]
    assert int8["off"]["pages"] > 3.5 * none["off"]["pages"]
    assert int8["off"]["peak_running"] > none["off"]["peak_running"] >= 1
    assert int8["on"]["peak_running"] > int8["off"]["peak_running"]
    int4 = formats["block_wise_int4"]
    assert int4["off"]["pages"] > 6 * none["off"]["pages"]
    assert int4["off"]["peak_running"] > int8["off"]["peak_running"]
