"""Compressed lower tiers (--swap-space-dtype, cache_manager/tier_codec.py): what a page that went through the
tier holds when it comes back, and how many more pages the same memory holds."""

import numpy as np
import pytest

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.cache_manager.tier_codec import PageCodec

HEAD_DIM, TOKENS = 64, 16


def pool(seed=0, pages=12):
    """Keys then values, [pages, tokens x head_dim] float32, keys with an outlier channel (as trained keys have)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((pages, TOKENS, HEAD_DIM)).astype(np.float32)
    keys[:, :, 5] *= 30
    values = rng.standard_normal((pages, TOKENS, HEAD_DIM)).astype(np.float32)
    return [keys.reshape(pages, -1), values.reshape(pages, -1)]


@pytest.mark.parametrize("dtype,qmax", [("int8", 127), ("int4", 7)])
def test_a_page_comes_back_within_half_a_step_of_its_token_and_heads_scale(dtype, qmax):
    arrays = pool()
    views = [a.view(np.uint8) for a in arrays]
    codec = PageCodec(dtype, [v.shape[1] for v in views], HEAD_DIM, num_key_views=1)
    rows = np.zeros((3, codec.stored_bytes), np.uint8)
    for i, page in enumerate((2, 5, 9)):
        codec.encode(views, page, rows[i])
    out = [np.zeros_like(a) for a in arrays]
    codec.decode(rows, [o.view(np.uint8) for o in out], np.array([0, 1, 2]))
    for k, (got, want) in enumerate(zip(out, arrays)):
        want = want[[2, 5, 9]].reshape(3, TOKENS, HEAD_DIM)
        got = got[:3].reshape(3, TOKENS, HEAD_DIM)
        # Each (token, head) row is rounded to steps of absmax / qmax: in the rotated basis for keys (an
        # orthonormal rotation keeps the error's norm), per value for values.
        rotated = want @ codec.hadamard if k == 0 else want
        step = np.abs(rotated).max(axis=-1) / qmax
        err = np.linalg.norm(got - want, axis=-1)
        assert np.all(err <= 0.5 * step * np.sqrt(HEAD_DIM) * 1.001 + 1e-5)
        assert not np.array_equal(got, want)  # really quantized


def test_rotating_keys_spreads_an_outlier_channel_so_int4_keys_lose_less():
    arrays = pool()
    views = [a.view(np.uint8) for a in arrays]
    errors = {}
    for keys_rotated in (0, 1):
        codec = PageCodec("int4", [v.shape[1] for v in views], HEAD_DIM, num_key_views=keys_rotated)
        row = np.zeros((1, codec.stored_bytes), np.uint8)
        codec.encode(views, 3, row[0])
        out = [np.zeros_like(a) for a in arrays]
        codec.decode(row, [o.view(np.uint8) for o in out], np.array([0]))
        keys = arrays[0][3].reshape(TOKENS, HEAD_DIM)
        errors[keys_rotated] = np.linalg.norm(out[0][0].reshape(TOKENS, HEAD_DIM)[:, np.arange(HEAD_DIM) != 5]
                                              - keys[:, np.arange(HEAD_DIM) != 5])
    assert errors[1] < 0.5 * errors[0]


@pytest.mark.parametrize("dtype,ratio", [("int8", 512 / 136), ("int4", 512 / 72)])
def test_the_same_memory_holds_3_76x_or_7_1x_the_pages(dtype, ratio):
    arrays = pool()
    views = [a.view(np.uint8) for a in arrays]
    codec = PageCodec(dtype, [v.shape[1] for v in views], HEAD_DIM, num_key_views=1)
    plain = sum(v.shape[1] for v in views)
    assert plain / codec.stored_bytes == pytest.approx(ratio)
    tier = HostTier(4, views, codec=codec)
    assert tier.entry_bytes == codec.stored_bytes and tier.pool_entry_bytes == plain


@pytest.mark.parametrize("flags,error", [
    ({"swap_space_dtype": "int8"}, "give it memory with --swap-space"),
    ({"swap_space_dtype": "fp8", "swap_space": 1.0}, "'fp8' is not one of int8, int4"),
    ({"swap_space_dtype": "int8", "swap_space": 1.0, "kv_cache_quant_type": "int8"}, "already int8"),
])
def test_bad_swap_space_dtypes_are_refused_by_name(make_config, flags, error):
    with pytest.raises(ValueError, match=error):
        make_config("1d", **flags)
