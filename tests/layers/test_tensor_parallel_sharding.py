"""The sharding rules in numpy: the ranks' slices, combined as the collectives combine them,
give back the full layer; the KV-head permutation keeps a layer's output; SWA balancing."""

import numpy as np
import pytest

from fastdeploy.model_executor import tensor_parallel as tp_
from fastdeploy.model_executor.models.decoder import random_checkpoint


@pytest.fixture
def cfg(make_config):
    return make_config("head_wise_recycle_on", num_gpu_blocks_override=4).model_config


def attention_layer(w: dict, x: np.ndarray, cfg, num_q: int, num_kv: int) -> np.ndarray:
    """Per-head 'attention' that only mixes a head's own q, k, v (softmax over the head's dims) and
    then o_proj: enough to see that heads and their o_proj columns stay together."""
    d = cfg.head_dim
    q = (x @ w["model.layers.0.self_attn.q_proj.weight"].T).reshape(-1, num_q, d)
    k = (x @ w["model.layers.0.self_attn.k_proj.weight"].T).reshape(-1, num_kv, d)
    v = (x @ w["model.layers.0.self_attn.v_proj.weight"].T).reshape(-1, num_kv, d)
    k, v = np.repeat(k, num_q // num_kv, axis=1), np.repeat(v, num_q // num_kv, axis=1)
    att = np.exp(q * k) / np.exp(q * k).sum(-1, keepdims=True) * v
    return att.reshape(len(x), -1) @ w["model.layers.0.self_attn.o_proj.weight"].T


def test_column_and_row_parallel_slices_sum_to_the_full_layers(cfg):
    w = {k: v.astype(np.float64) for k, v in random_checkpoint(cfg).items()}
    x = np.random.default_rng(0).standard_normal((5, cfg.hidden_size))
    full_attn = attention_layer(w, x, cfg, cfg.num_attention_heads, cfg.num_key_value_heads)
    mlp = lambda s: (lambda g, u: (g / (1 + np.exp(-g)) * u) @ s["model.layers.0.mlp.down_proj.weight"].T)(
        x @ s["model.layers.0.mlp.gate_proj.weight"].T, x @ s["model.layers.0.mlp.up_proj.weight"].T)
    shards = [tp_.shard_weights(w, cfg, r, 2) for r in range(2)]
    # Row-parallel outputs are partial sums: the all-reduce adds them.
    attn = sum(attention_layer(s, x, cfg, cfg.num_attention_heads // 2, cfg.num_key_value_heads // 2) for s in shards)
    np.testing.assert_allclose(attn, full_attn, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(sum(mlp(s) for s in shards), mlp(w), rtol=1e-10, atol=1e-10)
    # Vocab-parallel: the slices (the last padded with zero rows) side by side are the whole matrix.
    lm = np.concatenate([s["lm_head.weight"] for s in shards])
    assert lm.shape[0] == 2 * tp_.vocab_slice(cfg.vocab_size, 0, 2)[2] >= cfg.vocab_size
    np.testing.assert_array_equal(lm[:cfg.vocab_size], w["lm_head.weight"])
    assert not lm[cfg.vocab_size:].any()
    # Norms are replicated.
    np.testing.assert_array_equal(shards[1]["model.norm.weight"], w["model.norm.weight"])


def test_moving_whole_kv_head_groups_keeps_the_layer_output(cfg):
    w = {k: v.astype(np.float64) for k, v in random_checkpoint(cfg).items()}
    x = np.random.default_rng(1).standard_normal((3, cfg.hidden_size))
    permuted = tp_.permute_kv_heads(w, cfg, (0, 2, 1, 3))
    assert not np.array_equal(permuted["model.layers.0.self_attn.k_proj.weight"],
                              w["model.layers.0.self_attn.k_proj.weight"])
    np.testing.assert_allclose(attention_layer(permuted, x, cfg, 8, 4), attention_layer(w, x, cfg, 8, 4),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads,tp,swa,expected", [
    (4, 2, [0, 1], [0, 2, 1, 3]),        # both SWA heads on rank 0 -> one each
    (4, 2, [0, 2], [0, 1, 2, 3]),        # already one each: unchanged
    (4, 4, [0], [0, 1, 2, 3]),           # one SWA head cannot be split: nothing to gain
    (8, 4, [0, 1, 2, 3], [0, 4, 1, 5, 2, 6, 3, 7]),
    (8, 2, [5, 6, 7], [0, 1, 5, 7, 2, 3, 4, 6]),
])
def test_balanced_order_gives_every_rank_its_share_of_swa_heads(heads, tp, swa, expected):
    order = tp_.balanced_kv_head_order(heads, swa, tp)
    assert order == expected and sorted(order) == list(range(heads))
    per_rank = heads // tp
    counts = [sum(order[i] in swa for i in range(r * per_rank, (r + 1) * per_rank)) for r in range(tp)]
    assert max(counts) - min(counts) <= 1


def test_a_rank_without_swa_heads_caps_the_engine_ceiling_at_one(make_config):
    from fastdeploy.cache_manager.head_wise import rank_ceilings

    swa = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [0, 1]}
    plain = make_config(num_gpu_blocks_override=64, tensor_parallel_size=2, head_wise_swa_config=swa)
    balanced = make_config(num_gpu_blocks_override=64, tensor_parallel_size=2, head_wise_swa_config=swa,
                           balance_swa_heads=True)
    c = rank_ceilings(plain, 512, 512)
    assert c["swa_heads_per_rank"] == [2, 0] and c["per_rank"][1] == 1.0 and c["ceiling"] == 1.0
    b = rank_ceilings(balanced, 512, 512)
    assert b["swa_heads_per_rank"] == [1, 1] and b["ceiling"] > 1.5


def test_tensor_parallel_size_must_divide_the_kv_heads(make_config):
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide num_key_value_heads=4"):
        make_config(tensor_parallel_size=8)


def test_balancing_a_model_without_swa_heads_is_a_start_up_error(make_config):
    from dataclasses import replace

    from fastdeploy.config import FDConfig, ParallelConfig

    cfg = make_config("1d", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="balance_swa_heads: the model declares no SWA KV heads"):
        FDConfig(model_config=replace(cfg.model_config, head_wise_swa=None), cache_config=cfg.cache_config,
                 scheduler_config=cfg.scheduler_config,
                 parallel_config=ParallelConfig(tensor_parallel_size=2, balance_swa_heads=True))


def test_the_worker_side_never_imports_the_scheduler():
    """worker/ reads plain step messages; the import graph runs one way (engine -> worker)."""
    import subprocess
    import sys

    code = ("import sys, fastdeploy.worker.worker_process, fastdeploy.worker.model_runner, fastdeploy.worker.step_input;"
            "print(sorted(m for m in sys.modules if m.startswith('fastdeploy.engine')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def biased_attention_layer(w: dict, layer: int, x: np.ndarray, cfg, num_q: int, num_kv: int) -> np.ndarray:
    """attention_layer's per-head mixing for any layer, with q/k/v biases (Qwen-style attention)."""
    p, d = f"model.layers.{layer}.self_attn.", cfg.head_dim
    q = (x @ w[p + "q_proj.weight"].T + w[p + "q_proj.bias"]).reshape(-1, num_q, d)
    k = (x @ w[p + "k_proj.weight"].T + w[p + "k_proj.bias"]).reshape(-1, num_kv, d)
    v = (x @ w[p + "v_proj.weight"].T + w[p + "v_proj.bias"]).reshape(-1, num_kv, d)
    k, v = np.repeat(k, num_q // num_kv, axis=1), np.repeat(v, num_q // num_kv, axis=1)
    att = np.exp(q * k) / np.exp(q * k).sum(-1, keepdims=True) * v
    return att.reshape(len(x), -1) @ w[p + "o_proj.weight"].T


def test_per_layer_orders_move_each_layers_heads_with_their_biases_and_keep_its_output(cfg):
    rng = np.random.default_rng(2)
    w = {k: v.astype(np.float64) for k, v in random_checkpoint(cfg).items()}
    for layer in range(cfg.num_hidden_layers):
        for proj, rows in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads), ("v", cfg.num_key_value_heads)):
            w[f"model.layers.{layer}.self_attn.{proj}_proj.bias"] = rng.standard_normal(rows * cfg.head_dim)
    orders = ((0, 1, 2, 3), (1, 0, 3, 2))
    permuted = tp_.permute_kv_heads(w, cfg, orders)
    for name in w:  # layer 0's order is the identity; norms and embeddings never move
        if tp_.layer_of(name) != 1 or "self_attn" not in name:
            np.testing.assert_array_equal(permuted[name], w[name])
    d = cfg.head_dim
    bias = "model.layers.1.self_attn.k_proj.bias"
    np.testing.assert_array_equal(permuted[bias][:d], w[bias][d:2 * d])  # slot 0 holds head 1
    x = rng.standard_normal((3, cfg.hidden_size))
    for layer in range(cfg.num_hidden_layers):
        np.testing.assert_allclose(biased_attention_layer(permuted, layer, x, cfg, 8, 4),
                                   biased_attention_layer(w, layer, x, cfg, 8, 4), rtol=1e-10, atol=1e-10)
    # Sharded after the permutation, the ranks' partial sums still give the whole layer (biases split by rows).
    shards = [tp_.shard_weights(permuted, cfg, r, 2) for r in range(2)]
    np.testing.assert_allclose(sum(biased_attention_layer(s, 1, x, cfg, 4, 2) for s in shards),
                               biased_attention_layer(w, 1, x, cfg, 8, 4), rtol=1e-10, atol=1e-10)


def test_rank_tensor_permutes_by_the_layer_number_in_the_name(make_config):
    # Two ranks: a head's position decides its rank, so layer 1's SWA head 3 moves to layer 0's SWA slot.
    model = make_config(num_gpu_blocks_override=4, tensor_parallel_size=2, head_wise_swa_config={
        "sliding_window": 8, "sink_size": 0, "swa_kv_heads": [[1], [3]]}).model_config
    assert model.kv_head_orders == ((0, 1, 2, 3), (0, 3, 1, 2))
    w = random_checkpoint(model)
    name = "model.layers.1.self_attn.v_proj.weight"
    d = model.head_dim
    got = tp_.rank_tensor(name, w[name], model, 0, 2)
    np.testing.assert_array_equal(got[d:2 * d], w[name][3 * d:4 * d])  # slot 1 holds layer 1's SWA head 3
    zero = "model.layers.0.self_attn.v_proj.weight"
    np.testing.assert_array_equal(tp_.rank_tensor(zero, w[zero], model, 0, 2), w[zero][:2 * d])
    assert tp_.layer_of("model.layers.12.mlp.up_proj.weight") == 12 and tp_.layer_of("model.norm.weight") is None


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_a_ranks_permuted_slice_keeps_the_gguf_blocks_of_every_projection(make_config, qtype):
    """Permuting KV heads and slicing for a rank select whole rows, and o_proj / down_proj columns in whole
    head_dim-wide groups: the rank keeps the file's blocks (no float32 copy), and they dequantize to
    exactly the float32 rows and columns it selects."""
    from test_gguf_blocks import dequantized, random_gguf_tensor, rebuilt

    import paddle

    from fastdeploy.model_executor.layers import gguf_blocks

    model = make_config(num_gpu_blocks_override=4, tensor_parallel_size=2, head_wise_swa_config={
        "sliding_window": 8, "sink_size": 0, "swa_kv_heads": [[1], [3]]}).model_config
    for name, shape in (("model.layers.1.self_attn.q_proj.weight", (8 * 32, 256)),
                        ("model.layers.1.self_attn.k_proj.weight", (4 * 32, 256)),
                        ("model.layers.1.self_attn.o_proj.weight", (256, 8 * 32)),
                        ("model.layers.1.mlp.down_proj.weight", (256, 512)),
                        ("model.embed_tokens.weight", (259, 256))):
        source = random_gguf_tensor(qtype, *shape)
        full = paddle.to_tensor(dequantized(source))
        full.gguf_blocks = gguf_blocks.from_gguf(source)
        for rank in range(2):
            part = tp_.rank_tensor(name, full, model, rank, 2)
            assert part.gguf_blocks is not None, name
            assert np.array_equal(rebuilt(part.gguf_blocks).view(np.int32), part.numpy().view(np.int32)), name
