"""A CPU engine compiles (first use) and loads every op its forward calls while it is built, so a server
says ready only when its first request will not wait for the compiler (that request used to build the
dense-layer ops and ran past a 60 s client timeout on a cold op cache)."""

import subprocess
import sys

PROBE = """
from fastdeploy import LLM
from fastdeploy.model_executor.layers import blas_gemm
LLM(max_num_seqs=2)  # the tiny preset; nothing generated
print(blas_gemm._ops.cache_info().currsize)
"""


def test_building_a_cpu_engine_loads_the_dense_layer_ops_before_any_request():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"
