"""The simulator's tensor-parallel degree: per-rank shapes, the slowest rank, per-rank page pools."""

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

from serving_sim.hardware import Hardware, get_hardware  # noqa: E402
from serving_sim.simulator import Scenario, ceiling  # noqa: E402
from serving_sim.step_model import ModelShape, StepModel  # noqa: E402
from serving_sim.tensor_parallel import TensorParallelStepModel, rank_shape  # noqa: E402
from serving_sim.workload import Workload  # noqa: E402

ERNIE_JSON = os.path.join(REPO_ROOT, "benchmarks", "models", "ernie-4.5-21b-a3b.json")
UNIT_HW = Hardware("unit", 1.0, 1.0, 0)
HAND_CONFIG = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
               "head_dim": 4, "vocab_size": 10, "intermediate_size": 16, "tie_word_embeddings": False}


def test_a_rank_multiplies_through_half_the_weights():
    shape = ModelShape.from_config(HAND_CONFIG)
    half = rank_shape(shape, 2)
    assert 2 * half.always_read_params == shape.always_read_params
    assert 2 * half.lm_head_params == shape.lm_head_params
    with pytest.raises(ValueError, match="does not divide num_kv_heads"):
        rank_shape(shape, 4)


def test_the_step_waits_for_the_rank_whose_heads_read_the_most_keys():
    shape = ModelShape.from_config(HAND_CONFIG)
    chunks = [(500, 1, True)]  # a decode far past the window: the SWA head reads 4 + 0 keys, a full head 501
    unbalanced = TensorParallelStepModel(shape, UNIT_HW, 0.0, [1, 0], window=4, sink=0, dtype_bytes=2,
                                         link_bytes_per_s=1e30)
    full_rank = StepModel(rank_shape(shape, 2), UNIT_HW, 0.0, 0, window=4, sink=0)
    swa_rank = StepModel(rank_shape(shape, 2), UNIT_HW, 0.0, 1, window=4, sink=0)
    assert swa_rank.step_time(chunks) < full_rank.step_time(chunks)
    comm = unbalanced.all_reduce_seconds(1)
    assert unbalanced.step_time(chunks) == pytest.approx(full_rank.step_time(chunks) + comm)
    assert comm == pytest.approx((2 * 2 + 1) * 10e-6, rel=1e-6)  # latency only on an infinite link


def scenario(tp: int, balance: bool) -> Scenario:
    return Scenario(name="t", model_config=ERNIE_JSON, hardware=get_hardware("A800-80GB"),
                    workload=Workload(64, 10600, 4096, float("inf")), swa_heads=2, window=4096, sink=64,
                    max_num_seqs=512, tensor_parallel_size=tp, balance_swa_heads=balance)


def test_two_swa_heads_on_one_rank_buy_nothing_until_balanced():
    settings = {b: scenario(2, b).settings() for b in (False, True)}
    assert ceiling(settings[False], scenario(2, False).workload)["ceiling"] == 1.0
    assert ceiling(settings[True], scenario(2, True).workload)["ceiling"] > 1.4
    # Each rank's GPU holds half the weights and half the KV heads: more blocks than one GPU alone.
    assert settings[True].num_gpu_blocks > scenario(1, False).settings().num_gpu_blocks
    model = scenario(2, True).step_model(settings[True])
    assert isinstance(model, TensorParallelStepModel) and [r.num_swa_pairs for r in model.ranks] == [model.shape.num_layers] * 2
