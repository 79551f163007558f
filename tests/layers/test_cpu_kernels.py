"""What the benchmarks and the start-up log print beside their numbers (layers/cpu_kernels.py): the
instruction set each op family runs, which FD_CPU_LINEAR_ISA caps, and the machine's read bandwidth."""

import os
import subprocess
import sys

from fastdeploy.model_executor.layers import cpu_kernels

PROBE = "from fastdeploy.model_executor.layers import cpu_kernels; print(cpu_kernels.kernel_isas())"


def test_the_kernels_named_are_this_cpus_best_when_nothing_caps_them(native_isa):
    isas = cpu_kernels.kernel_isas()
    assert isas["dense"] == native_isa == isas["attention"]
    assert isas["int8_activations"] in cpu_kernels.INT8_KERNELS
    assert native_isa in cpu_kernels.describe()


def test_the_cap_is_what_every_op_family_reports(capped_isa):
    env = dict(os.environ, FD_CPU_LINEAR_ISA=capped_isa)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    isas = eval(out.stdout.strip().splitlines()[-1])
    assert isas["dense"] == isas["attention"] == capped_isa
    assert isas["int8_activations"] == capped_isa


def test_read_bandwidth_is_measured_and_positive():
    assert cpu_kernels.memory_read_gbs(nbytes=8 << 20, repeats=2) > 0
