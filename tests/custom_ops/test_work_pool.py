"""The CPU ops' work pool (custom_ops/cpu_ops/work_pool.h): one helper thread serves the attention
op and the dense layers, though they are two compiled libraries (the pool is a function-local static
of an inline function, one GNU unique symbol per process). Two pools would mean two helpers on a
2-core machine, and one still polling after its op (FD_CPU_POOL_SPIN_US) would hold the core the
other's helper needs. The polling time only moves when a helper starts, never a bit of a result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_cpu_ops

HERE = Path(__file__).resolve().parent

# Runs in a fresh process: thread counts of this one depend on which tests ran before.
PROBE = r"""
import hashlib, json, os, sys
import numpy as np, paddle
sys.path.insert(0, sys.argv[1])
from test_append_attention_cpu import Case, build_inputs, run_op
from fastdeploy.model_executor.layers import blas_gemm

def threads():
    return len(os.listdir("/proc/self/task"))

rng = np.random.default_rng(0)
w = blas_gemm.pack(paddle.to_tensor(rng.standard_normal((3072, 576)).astype(np.float32)))
x = paddle.to_tensor(rng.standard_normal((48, 576)).astype(np.float32))
gemm = blas_gemm.linear_packed()
case = Case(14, [(1500, 1)] * 4 + [(0, 48)], block_size=64, kv_heads=2, group=4, head_dim=128,
            window=256, sink=16, swa_heads=(0,))
arrays = build_inputs(case)
before = threads()
run_op(case, arrays)
after_attention = threads()
y = gemm(x, w, 3072)
after_gemm = threads()
digest = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
print(json.dumps({"before": before, "after_attention": after_attention, "after_gemm": after_gemm,
                  "gemm": digest(y.numpy()), "attention": digest(run_op(case, arrays)[0])}))
"""


def _probe(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(HERE)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the pool runs serially on one CPU")
def test_the_attention_op_and_the_dense_layers_share_one_helper_thread():
    load_cpu_ops()  # built once here, so the probe only loads it
    counts = _probe({})
    assert counts["after_attention"] == counts["before"] + 1, counts  # the attention op started the helper
    assert counts["after_gemm"] == counts["after_attention"], counts  # the GEMM found it


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the pool runs serially on one CPU")
def test_the_helpers_polling_time_does_not_change_a_bit():
    polling, sleeping = _probe({}), _probe({"FD_CPU_POOL_SPIN_US": "0"})
    assert polling["gemm"] == sleeping["gemm"] and polling["attention"] == sleeping["attention"]
