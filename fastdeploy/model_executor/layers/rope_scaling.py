"""RoPE frequency scaling, as per-frequency divisors: pair i rotates by t * theta^(-2i/d) / divisor[i]
(and, for YaRN, cos and sin times an attention factor).

One shape serves both sources of Llama 3's scaling: a config.json's `rope_scaling` / `rope_parameters`
with rope_type "llama3" (the divisors computed here from factor, low_freq_factor, high_freq_factor and
original_max_position_embeddings), and a llama.cpp GGUF file's `rope_freqs.weight` tensor, which holds
the same divisors already computed.

Llama 3's rule, per frequency f with wavelength w = 2 pi / f and the original context L: long waves
(w > L / low_freq_factor) are slowed by `factor`; short ones (w < L / high_freq_factor) are kept; in
between the divisor moves smoothly from `factor` to 1 with s = (L / w - low) / (high - low), the new
frequency being (1 - s) f / factor + s f.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
SUPPORTED = ("default", "llama3", "yarn")


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """float64 [head_dim // 2]: theta^(-2i/d)."""
    return theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def llama3_divisors(head_dim: int, theta: float, params: dict) -> tuple:
    """Per-frequency divisors of Llama 3's scaling; ValueError naming a missing or bad field."""
    for name in LLAMA3_FIELDS:
        value = params.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"model config: rope_scaling {name} must be a positive number for rope_type "
                             f"'llama3', got {value!r}")
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    if high <= low:
        raise ValueError(f"model config: rope_scaling high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    context = float(params["original_max_position_embeddings"])
    freq = inverse_frequencies(head_dim, theta)
    wavelength = 2 * math.pi / freq
    smooth = np.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) * freq / factor + smooth * freq
    scaled = np.where(wavelength > context / low, freq / factor, np.where(wavelength < context / high, freq, scaled))
    return tuple(float(d) for d in freq / scaled)


def _yarn_correction_dim(rotations: float, dim: int, theta: float, context: float) -> float:
    """The frequency index whose wavelength fits `rotations` turns in the original context."""
    return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_inverse_frequencies(head_dim: int, theta: float, params: dict) -> np.ndarray:
    """YaRN (gpt-oss's rope_type "yarn"): frequencies that turn fewer than beta_slow times in the original
    context are slowed by `factor`, those turning more than beta_fast times are kept, a linear ramp over the
    frequency index in between (the correction range floored / ceiled unless `truncate` is false). In float32
    as transformers computes them, so the tables agree with the reference's to its rounding."""
    factor, context = float(params["factor"]), float(params["original_max_position_embeddings"])
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    low, high = (_yarn_correction_dim(r, head_dim, theta, context) for r in (fast, slow))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    position_freqs = np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim))
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # 1: extrapolate (keep the frequency), 0: interpolate (slow it)
    extrapolated, interpolated = 1.0 / position_freqs, 1.0 / (np.float32(factor) * position_freqs)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def rope_attention_factor(raw: dict) -> float:
    """cos and sin are scaled by this (YaRN's attention factor, 0.1 ln(factor) + 1 unless the config names
    one); 1 for every other kind."""
    scaling = raw.get("rope_scaling")
    if not isinstance(scaling, dict) or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        def mscale(m):
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def frequency_divisors(raw: dict, head_dim: int, where: str) -> Optional[tuple]:
    """The divisors a config asks for (None: plain RoPE): a GGUF's rope_freq_factors, or rope_scaling."""
    factors = raw.get("rope_freq_factors")
    if factors is not None:
        if len(factors) != head_dim // 2 or any(not f > 0 for f in factors):
            raise ValueError(f"model {where!r}: rope_freqs must hold {head_dim // 2} positive factors, "
                             f"got {len(factors)}")
        return tuple(float(f) for f in factors)
    scaling = raw.get("rope_scaling")
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"model {where!r}: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED:
        raise ValueError(f"model {where!r}: rope_type={kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if kind == "default":
        return None
    if kind == "yarn":
        for name in ("factor", "original_max_position_embeddings"):
            value = scaling.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"model {where!r}: rope_scaling {name} must be a positive number for rope_type "
                                 f"'yarn', got {value!r}")
        theta = float(raw["rope_theta"])
        return tuple(float(d) for d in inverse_frequencies(head_dim, theta)
                     / yarn_inverse_frequencies(head_dim, theta, scaling).astype(np.float64))
    return llama3_divisors(head_dim, float(raw["rope_theta"]), scaling)
