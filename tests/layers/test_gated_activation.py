"""The CPU gated activation (`act(gate) * up` in one op) equals a float64 reference for SiLU and the
tanh GELU over the whole float range a model produces, and gives a row the same bits whatever its
batch mates."""

import math

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.activation import gated_activation

F_WIDTH = 1536  # SmolLM2's intermediate size


def _reference(x: np.ndarray, activation: str) -> np.ndarray:
    x64 = x.astype(np.float64)
    gate, up = x64[..., :x.shape[-1] // 2], x64[..., x.shape[-1] // 2:]
    if activation == "silu":
        act = gate / (1.0 + np.exp(-gate))
    else:
        act = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    return act * up


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_equals_a_float64_reference(activation):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 2 * F_WIDTH)) * 4).astype(np.float32)
    x[0, :8] = [-120.0, -90.0, -30.0, -1e-8, 0.0, 1e-8, 30.0, 120.0]  # saturation and the origin
    got = gated_activation(paddle.to_tensor(x), activation).numpy()
    assert got.shape == (7, F_WIDTH) and np.isfinite(got).all()
    np.testing.assert_allclose(got, _reference(x, activation), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40])
def test_a_row_keeps_its_bits_whatever_its_batch_mates(rows):
    rng = np.random.default_rng(rows)
    probe = rng.standard_normal(2 * 100 + 2 * 7).astype(np.float32)  # a width that ends mid-vector
    alone = gated_activation(paddle.to_tensor(probe[None]), "silu").numpy()[0]
    batch = rng.standard_normal((rows, probe.size)).astype(np.float32)
    batch[rows // 2] = probe
    assert np.array_equal(gated_activation(paddle.to_tensor(batch), "silu").numpy()[rows // 2], alone)


def test_unknown_activation_is_a_clear_error():
    with pytest.raises(ValueError, match="gated activation must be one of"):
        gated_activation(paddle.ones([1, 4]), "relu")


_CAPPED_RUN = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_gated_activation import outputs_of_both_activations
np.save({path!r}, outputs_of_both_activations())
"""


def outputs_of_both_activations() -> np.ndarray:
    """SiLU and GELU-tanh of rows that end mid-vector, over the range a model produces: the bits to compare."""
    x = (np.random.default_rng(7).standard_normal((5, 2 * 203)) * 6).astype(np.float32)
    x[0, :6] = [-120.0, -90.0, -1e-8, 0.0, 30.0, 120.0]
    return np.stack([gated_activation(paddle.to_tensor(x), act).numpy() for act in ("silu", "gelu_tanh")])


def test_every_instruction_set_gives_the_best_kernels_bits(tmp_path, capped_isa):
    import os
    import subprocess
    import sys

    path = str(tmp_path / f"{capped_isa}.npy")
    script = _CAPPED_RUN.format(tests=os.path.dirname(__file__), path=path)
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "FD_CPU_LINEAR_ISA": capped_isa}, check=True,
                   timeout=600)
    assert np.array_equal(np.load(path).view(np.int32), outputs_of_both_activations().view(np.int32))
