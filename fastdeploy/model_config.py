"""A model's configuration, read and validated at start-up: its architecture and shapes (config.json, a
GGUF file's metadata, a preset or a named model), its head-wise SWA section and its MoE settings.

The engine's own settings (cache, scheduler, parallelism) and the checks that tie them to the model
are in `fastdeploy/config.py`, which re-exports these classes under upstream FastDeploy's import path.
Every check raises `ValueError` with a message that names the offending field.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from fastdeploy.json_flag import json_object
from fastdeploy.model_executor.models.architectures import (ABOVE_MAX_WINDOW_LAYERS, ACTIVATIONS, ALL_LAYERS, ERNIE4_5,
                                                           EVERY_NTH_GLOBAL, Architecture, architecture)
from fastdeploy.model_executor.layers.rope_scaling import SUPPORTED as ROPE_SCALINGS
from fastdeploy.model_executor.layers.rope_scaling import rope_attention_factor
from fastdeploy.model_executor.layers.rope_scaling import frequency_divisors
from fastdeploy.model_executor.models.named_models import NAMED_MODELS
from fastdeploy.model_executor.models.tiny_preset import PRESETS, TINY_PRESET_NAME, default_preset

logger = logging.getLogger("fastdeploy.config")

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class HeadWiseSWAConfig:
    """Which KV heads slide, their window and their attention sink, in tokens.

    `swa_kv_heads` in the spec is one list (the same heads slide in every layer) or one list per
    layer (§13 of the design). `layer_kv_heads` keeps the per-layer lists (None for one list);
    `swa_kv_heads` is then the heads that slide in *every* layer, the only ones whose pages (a page
    is one KV head in all layers) may be recycled. Head indices are in the load-time KV-head order
    (ModelConfig.layer_kv_head_order), which start-up may permute (FDConfig, swa_head_placement.py).

    Per-head windows (design §17): with the per-layer form, `head_windows` / `head_sinks` give each
    listed head its own window / sink (lists of the same shape as `swa_kv_heads`); a head without one
    uses `sliding_window` / `sink_size`. They are kept parallel to `layer_kv_heads` (sorted by head) and
    move with their heads when the KV heads are permuted (`permuted`).
    """

    sliding_window: int
    sink_size: int
    swa_kv_heads: tuple
    layer_kv_heads: Optional[tuple] = None  # one sorted tuple per layer, or None: swa_kv_heads everywhere
    layer_head_windows: Optional[tuple] = None  # per layer, the window of each of layer_kv_heads[l]; None: all W
    layer_head_sinks: Optional[tuple] = None  # per layer, the sink of each of layer_kv_heads[l]; None: all S

    @classmethod
    def from_dict(cls, spec: Any, num_kv_heads: int, num_layers: Optional[int] = None) -> "HeadWiseSWAConfig":
        where = "head_wise_swa"
        spec = json_object(spec, where, "with sliding_window, sink_size, swa_kv_heads")
        unknown = set(spec) - {"sliding_window", "sink_size", "swa_kv_heads", "head_windows", "head_sinks"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        for name in ("sliding_window", "sink_size", "swa_kv_heads"):
            if name not in spec:
                raise ValueError(f"{where}.{name} is required")
        window, sink, heads = spec["sliding_window"], spec["sink_size"], spec["swa_kv_heads"]
        if not _is_int(window) or window < 1:
            raise ValueError(f"{where}.sliding_window must be an integer >= 1, got {window!r}")
        if not _is_int(sink) or sink < 0:
            raise ValueError(f"{where}.sink_size must be an integer >= 0, got {sink!r}")
        if not isinstance(heads, (list, tuple)) or not heads:
            raise ValueError(f"{where}.swa_kv_heads must be a non-empty list of KV head indices (or one list "
                             f"per layer), got {heads!r}")
        if not any(isinstance(h, (list, tuple)) for h in heads):
            for name in ("head_windows", "head_sinks"):
                if name in spec:
                    raise ValueError(f"{where}.{name} needs swa_kv_heads as one list per layer (it gives the "
                                     f"window or sink of each listed head, layer by layer)")
            one = _head_set(heads, num_kv_heads, f"{where}.swa_kv_heads")
            return cls(int(window), int(sink), one)
        if not all(isinstance(h, (list, tuple)) for h in heads):
            raise ValueError(f"{where}.swa_kv_heads mixes head indices and per-layer lists: give one list of "
                             f"KV heads (every layer) or one list per layer, got {heads!r}")
        if num_layers is not None and len(heads) != num_layers:
            raise ValueError(f"{where}.swa_kv_heads has {len(heads)} per-layer lists but the model has "
                             f"{num_layers} layers (one list per layer, or one list for every layer)")
        layers = tuple(_head_set(h, num_kv_heads, f"{where}.swa_kv_heads[layer {i}]") for i, h in enumerate(heads))
        if not any(layers):
            raise ValueError(f"{where}.swa_kv_heads: no layer lists a SWA head")
        windows = _per_head_values(spec, "head_windows", heads, 1, where)
        sinks = _per_head_values(spec, "head_sinks", heads, 0, where)
        return cls(int(window), int(sink), _in_every_layer(layers), layers, windows, sinks)

    def head_type(self, layer: int, head: int) -> tuple:
        """(window, sink) of one sliding head of one layer (load-time order)."""
        heads = self.heads_of_layer(layer)
        if head not in heads:
            raise ValueError(f"head_wise_swa: KV head {head} does not slide in layer {layer}")
        i = heads.index(head)
        window = self.sliding_window if self.layer_head_windows is None else self.layer_head_windows[layer][i]
        sink = self.sink_size if self.layer_head_sinks is None else self.layer_head_sinks[layer][i]
        return window, sink

    @property
    def per_head_windows(self) -> bool:
        """True when some sliding head has a window or sink of its own (not every head the same)."""
        return self.layer_kv_heads is not None and len({self.head_type(layer, h)
                                                        for layer, heads in enumerate(self.layer_kv_heads)
                                                        for h in heads}) > 1

    def heads_of_layer(self, layer: int) -> tuple:
        """The SWA KV heads of one layer (load-time order)."""
        return self.swa_kv_heads if self.layer_kv_heads is None else self.layer_kv_heads[layer]

    @property
    def same_in_every_layer(self) -> bool:
        return self.layer_kv_heads is None or len(set(self.layer_kv_heads)) == 1

    def with_layer_heads(self, layers: tuple) -> "HeadWiseSWAConfig":
        """The same spec with new per-layer head sets (after a KV-head permutation). Only for a spec whose
        heads all share one window and sink: with per-head windows use `permuted`, which moves them."""
        from dataclasses import replace

        if self.layer_head_windows is not None or self.layer_head_sinks is not None:
            raise ValueError("internal: per-head windows must move with their heads: use permuted()")
        layers = tuple(tuple(sorted(h)) for h in layers)
        if self.layer_kv_heads is None:
            if len(set(layers)) != 1:
                raise ValueError("internal: a one-list spec must be permuted the same way in every layer")
            return replace(self, swa_kv_heads=layers[0])
        return replace(self, swa_kv_heads=_in_every_layer(layers), layer_kv_heads=layers)

    def permuted(self, steps: list) -> "HeadWiseSWAConfig":
        """The spec after new KV head i of layer l takes what head steps[l][i] held: the sliding heads move,
        and so do their windows and sinks."""
        from dataclasses import replace

        layers = range(len(steps))
        moved = [[(i, self.head_type(l, s)) for i, s in enumerate(steps[l]) if s in self.heads_of_layer(l)]
                 for l in layers]
        heads = tuple(tuple(i for i, _ in row) for row in moved)
        if self.layer_head_windows is None and self.layer_head_sinks is None:
            return self.with_layer_heads(heads)
        windows = tuple(tuple(t[0] for _, t in row) for row in moved) if self.layer_head_windows else None
        sinks = tuple(tuple(t[1] for _, t in row) for row in moved) if self.layer_head_sinks else None
        return replace(self, swa_kv_heads=_in_every_layer(heads), layer_kv_heads=heads,
                       layer_head_windows=windows, layer_head_sinks=sinks)

    def to_dict(self) -> dict:
        heads = list(self.swa_kv_heads) if self.layer_kv_heads is None else [list(h) for h in self.layer_kv_heads]
        out = {"sliding_window": self.sliding_window, "sink_size": self.sink_size, "swa_kv_heads": heads}
        if self.layer_head_windows is not None:
            out["head_windows"] = [list(w) for w in self.layer_head_windows]
        if self.layer_head_sinks is not None:
            out["head_sinks"] = [list(s) for s in self.layer_head_sinks]
        return out


def _per_head_values(spec: dict, name: str, heads: list, least: int, where: str) -> Optional[tuple]:
    """`head_windows` / `head_sinks`: one list per layer parallel to `swa_kv_heads`, each value an integer
    >= `least`; returned per layer in the order of the sorted heads. None when the field is absent."""
    values = spec.get(name)
    if values is None:
        return None
    if not isinstance(values, (list, tuple)) or len(values) != len(heads):
        raise ValueError(f"{where}.{name} must be one list per layer like swa_kv_heads ({len(heads)} lists), "
                         f"got {values!r}")
    out = []
    for layer, (row, listed) in enumerate(zip(values, heads)):
        if not isinstance(row, (list, tuple)) or len(row) != len(listed):
            raise ValueError(f"{where}.{name}[layer {layer}] must give one value for each of the "
                             f"{len(listed)} heads swa_kv_heads[layer {layer}] lists, got {row!r}")
        for v in row:
            if not _is_int(v) or v < least:
                raise ValueError(f"{where}.{name}[layer {layer}]: {v!r} must be an integer >= {least}")
        out.append(tuple(int(v) for _, v in sorted(zip(listed, row))))
    return tuple(out)


def _head_set(heads: Any, num_kv_heads: int, where: str) -> tuple:
    """One list of KV head indices, checked (in range, no duplicate) and sorted."""
    for h in heads:
        if not _is_int(h) or not 0 <= h < num_kv_heads:
            raise ValueError(f"{where}: head {h!r} is out of range (the model has {num_kv_heads} KV heads)")
    if len(set(heads)) != len(heads):
        raise ValueError(f"{where} lists a head twice: {list(heads)}")
    return tuple(sorted(int(h) for h in heads))


def _in_every_layer(layers: tuple) -> tuple:
    return tuple(sorted(set(layers[0]).intersection(*layers[1:])))


def layer_sliding_windows(raw: dict, num_layers: int) -> Optional[tuple]:
    """Per-layer sliding windows of a model config: `layer_sliding_window` (a window or null per
    layer), or Hugging Face's `layer_types` ("sliding_attention" / "full_attention") with
    `sliding_window`. None when no layer slides."""
    windows = raw.get("layer_sliding_window")
    if windows is None and raw.get("layer_types") is not None:
        kinds = raw["layer_types"]
        if not isinstance(kinds, (list, tuple)) or any(k not in ("sliding_attention", "full_attention") for k in kinds):
            raise ValueError(f"model config: layer_types must list 'sliding_attention' or 'full_attention' per "
                             f"layer, got {kinds!r}")
        windows = [raw.get("sliding_window") if k == "sliding_attention" else None for k in kinds]
    if windows is None:
        return None
    if not isinstance(windows, (list, tuple)) or len(windows) != num_layers:
        raise ValueError(f"model config: layer_sliding_window must list a window (or null) for each of "
                         f"{num_layers} layers, got {windows!r}")
    for layer, w in enumerate(windows):
        if w is not None and (not _is_int(w) or w < 1):
            raise ValueError(f"model config: layer_sliding_window[{layer}] must be an integer >= 1 or null, "
                             f"got {w!r}")
    return tuple(windows) if any(w is not None for w in windows) else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MoEConfig:
    """The routed-expert part of an ERNIE-4.5 MoE model (`Ernie4_5_MoeForCausalLM`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int
    layer_start_index: int
    layer_end_index: int
    layer_interval: int
    norm_min: float
    use_correction_bias: bool
    style: str = "ernie4_5"  # or "gpt_oss": top-k of biased router logits, clamped SwiGLU experts (gpt_oss_moe.py)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def gpt_oss(cls, raw: dict) -> "MoEConfig":
        """gpt-oss: every layer MoE, `num_local_experts` experts of `intermediate_size`, `num_experts_per_tok`
        a token, no shared experts."""
        experts, k = raw.get("num_local_experts"), raw.get("num_experts_per_tok")
        for name, value in (("num_local_experts", experts), ("num_experts_per_tok", k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if k > experts:
            raise ValueError(f"model config: num_experts_per_tok={k} exceeds num_local_experts={experts}")
        return cls(num_experts=experts, top_k=k, intermediate_size=int(raw["intermediate_size"]),
                   num_shared_experts=0, layer_start_index=0, layer_end_index=int(raw["num_hidden_layers"]) - 1,
                   layer_interval=1, norm_min=0.0, use_correction_bias=False, style="gpt_oss",
                   swiglu_alpha=_positive_float(raw, "swiglu_alpha", 1.702),
                   swiglu_limit=_positive_float(raw, "swiglu_limit", 7.0))

    @classmethod
    def from_raw(cls, raw: dict) -> "MoEConfig":
        def first(value):  # multimodal checkpoints give [text, vision]; the text part serves
            return value[0] if isinstance(value, (list, tuple)) else value

        experts, width = first(raw["moe_num_experts"]), first(raw["moe_intermediate_size"])
        layers = raw["num_hidden_layers"]
        end = raw["moe_layer_end_index"]
        end = layers - 1 if end == -1 else first(end)
        moe = cls(num_experts=int(experts), top_k=int(raw["moe_k"]), intermediate_size=int(width),
                  num_shared_experts=int(raw["moe_num_shared_experts"]),
                  layer_start_index=int(first(raw["moe_layer_start_index"])), layer_end_index=int(end),
                  layer_interval=int(raw["moe_layer_interval"]), norm_min=float(raw["moe_norm_min"]),
                  use_correction_bias=bool(raw["moe_use_aux_free"]))
        for name, value in (("moe_num_experts", moe.num_experts), ("moe_intermediate_size", moe.intermediate_size),
                            ("moe_layer_interval", moe.layer_interval)):
            if value < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {value}")
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"model config: moe_k={moe.top_k} must be in [1, moe_num_experts={moe.num_experts}]")
        if raw["scoring_func"] != "softmax" or raw["moe_group_experts"]:
            raise ValueError("model config: only softmax routing without expert groups is supported "
                             f"(scoring_func={raw['scoring_func']!r}, moe_group_experts={raw['moe_group_experts']})")
        return moe


@dataclass
class ModelConfig:
    model: Optional[str]
    architectures: list
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int
    max_model_len: int
    head_wise_swa: Optional[HeadWiseSWAConfig]
    seed: int = 0
    served_model_name: str = TINY_PRESET_NAME
    raw: dict = field(default_factory=dict, repr=False)
    model_type: str = "ernie4_5"
    moe: Optional[MoEConfig] = None
    dtype: str = "float32"  # compute dtype of the weights and activations
    eos_token_ids: tuple = (2,)  # every id that ends generation (config.json + generation_config.json)
    preset: Optional[str] = None  # the built-in preset's name when its random weights serve
    max_model_len_given: bool = True  # False: the default, capped later to what the KV cache holds
    # Load-time KV-head order, per layer: slot i of layer l holds the checkpoint's KV head
    # kv_head_orders[l][i] (None: identity everywhere). head_wise_swa is in this order. Set at start-up
    # (swa_head_placement.py): per-layer SWA heads moved to shared slots, then --balance-swa-heads.
    kv_head_orders: Optional[tuple] = None
    arch: Architecture = ERNIE4_5  # what the decoder does differently for this architecture (architectures.py)
    hidden_act: str = "silu"
    qkv_bias: bool = False
    attn_scale_ratio: float = 1.0  # query scale / head_dim ** -0.5 (Gemma's query_pre_attn_scalar)
    # Sliding *layers* (a model trained with them, Gemma 3): the window of each layer, None for a global
    # one; None for a model without. The model's own semantics: they apply in every memory mode.
    layer_sliding_window: Optional[tuple] = None
    layer_rope_theta: Optional[tuple] = None  # per layer, where layers differ (Gemma 3's local base; None: no RoPE)
    logit_scale: float = 1.0  # the LM head's logits times this (Cohere's logit_scale)
    # Soft-capping (Gemma 2): attention scores and final logits become cap * tanh(x / cap); 0: none.
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    o_bias: bool = False  # o_proj carries a bias (gpt-oss: attention_bias covers o_proj too)
    rope_attention_factor: float = 1.0  # cos and sin scaled by it (YaRN)
    # Per layer, whether the RoPE scaling (rope_freq_divisors, rope_attention_factor) applies; None: every layer.
    # OLMo 3's rope_parameters scale the full layers only.
    rope_scaled_layers: Optional[tuple] = None
    # RoPE scaling as one divisor per frequency (Llama 3's rope_scaling, or a GGUF's rope_freqs); None: plain.
    rope_freq_divisors: Optional[tuple] = None
    gguf_file: Optional[str] = None  # the GGUF file the weights, tokenizer and template come from
    head_wise_swa_source: str = "none"  # where head_wise_swa came from (logged at start-up)

    @classmethod
    def create(cls, model: Optional[str], max_model_len: Optional[int], head_wise_swa_override: Any,
               served_model_name: Optional[str] = None, dtype: str = "auto", device: str = "cpu",
               calibrated: bool = False) -> "ModelConfig":
        """`calibrated`: a named model without an override serves its calibrated head_wise_swa section
        (it trades accuracy: the engine passes FD_HEAD_WISE_KV_CACHE=1, the user's choice of the feature)."""
        named = NAMED_MODELS.get(model) if model is not None else None
        preset = default_preset(device) if model is None else (model if model in PRESETS else None)
        gguf_file = None
        if preset is not None:
            raw, model = dict(PRESETS[preset]), None
        elif named is not None:
            from fastdeploy.model_executor.models.named_models import resolve

            gguf_file = model = resolve(named.name)
            raw = _read_gguf_config(model)
        elif _is_gguf_path(model):
            gguf_file = model
            raw = _read_gguf_config(model)
        else:
            raw = _read_model_config(model)
        arch = _check_architecture(raw, model or preset)
        raw = _normalise_raw(arch, {**arch.defaults, **raw}, model or preset)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not _is_int(raw.get(key)) or raw[key] < 1:
                raise ValueError(f"model config: {key} must be a positive integer, got {raw.get(key)!r}")
        if raw.get("use_bias"):
            raise ValueError("model config: use_bias=true (linear biases) is not supported")
        if raw.get("mlp_bias"):
            raise ValueError("model config: mlp_bias=true (MLP biases) is not supported")
        hidden_act = ACTIVATIONS.get(raw.get("hidden_act", "silu"))
        if hidden_act is None or (arch.activation != hidden_act):
            raise ValueError(f"model config: hidden_act={raw.get('hidden_act')!r} is not supported for "
                             f"{arch.name} (expected {arch.activation})")
        quant = raw.get("quantization_config")
        if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
            raise ValueError("model config: quantization_config quant_method 'mxfp4' (gpt-oss's MXFP4 expert blocks) "
                             "is not supported: serve a checkpoint whose experts are bfloat16/float32 weights")
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None and not arch.logit_softcapping:
                raise ValueError(f"model config: {key}={raw[key]!r} is not supported for {arch.name}")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        if heads % kv_heads:
            raise ValueError(f"model config: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise ValueError(f"model config: head_dim={head_dim} must be even for rotary embeddings")
        max_pos = int(raw["max_position_embeddings"])
        given = max_model_len is not None
        if not given:
            # Capped again by FDConfig to what the KV cache holds (real models say 131072).
            max_model_len = min(max_pos, 4096) if preset is not None else max_pos
        if not _is_int(max_model_len) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        swa_spec, source = head_wise_swa_override, "--head-wise-swa-config"
        if isinstance(swa_spec, str) and not swa_spec.lstrip().startswith("{") and named is not None:
            # a name: one of the named model's calibrated configurations (calibrated/NAME.json)
            swa_spec = named.calibrated_head_wise_swa(swa_spec.strip())
        if swa_spec is None and raw.get("head_wise_swa") is not None:
            swa_spec, source = raw.get("head_wise_swa"), "config.json"
        if swa_spec is None and named is not None and calibrated:
            # A calibrated section trades accuracy: only when the user turned the feature on.
            swa_spec, source = named.calibrated_head_wise_swa(), f"the calibrated configuration of {named.name}"
        swa = None if swa_spec is None else HeadWiseSWAConfig.from_dict(swa_spec, kv_heads,
                                                                         int(raw["num_hidden_layers"]))
        name = served_model_name or (preset if preset is not None else named.name if named is not None
                                     else os.path.basename(os.path.normpath(model)))
        eos_ids = _eos_token_ids(raw, None if gguf_file else model)
        layer_windows = _layer_sliding_windows(arch, raw)
        return cls(
            model=model,
            architectures=list(raw.get("architectures", ["Ernie4_5_ForCausalLM"])),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(heads),
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=max_pos,
            rope_theta=float(raw["rope_theta"]),
            rms_norm_eps=float(raw["rms_norm_eps"]),
            tie_word_embeddings=bool(raw["tie_word_embeddings"]),
            pad_token_id=int(raw["pad_token_id"] if raw.get("pad_token_id") is not None else eos_ids[0]),
            bos_token_id=int(raw["bos_token_id"] if raw.get("bos_token_id") is not None else eos_ids[0]),
            eos_token_id=eos_ids[0],
            max_model_len=int(max_model_len),
            head_wise_swa=swa,
            seed=int(raw.get("seed", 0)),
            served_model_name=name,
            raw=raw,
            model_type=arch.model_type,
            moe=(MoEConfig.gpt_oss(raw) if arch.moe_style == "gpt_oss" else MoEConfig.from_raw(raw)) if arch.moe else None,
            dtype=_resolve_dtype(dtype, None if gguf_file else model, raw.get("torch_dtype"), device),
            eos_token_ids=eos_ids,
            preset=preset,
            max_model_len_given=given,
            arch=arch,
            hidden_act=hidden_act,
            qkv_bias=arch.qkv_bias if arch.qkv_bias is not None else bool(raw.get("attention_bias", False)),
            attn_scale_ratio=float(head_dim / raw["query_pre_attn_scalar"]) ** 0.5
            if raw.get("query_pre_attn_scalar") else 1.0,
            layer_sliding_window=layer_windows,
            layer_rope_theta=_layer_rope_thetas(raw, layer_windows, arch.nope_full_layers),
            logit_scale=_positive_float(raw, "logit_scale", 1.0),
            attn_logit_softcapping=_softcap(raw, "attn_logit_softcapping"),
            final_logit_softcapping=_softcap(raw, "final_logit_softcapping"),
            o_bias=arch.o_bias and bool(raw.get("attention_bias", False)),
            rope_attention_factor=rope_attention_factor(raw),
            rope_scaled_layers=tuple(w is None for w in layer_windows)
            if raw.get("rope_scaling_full_layers_only") and layer_windows is not None else None,
            rope_freq_divisors=frequency_divisors(raw, int(head_dim), model or preset),
            gguf_file=gguf_file,
            head_wise_swa_source=source if swa is not None else "none",
        )

    @property
    def swa_kv_heads(self) -> tuple:
        """The KV heads that slide in every layer (load-time order): what the page model recycles."""
        return self.head_wise_swa.swa_kv_heads if self.head_wise_swa else ()

    def layer_swa_kv_heads(self, layer: int) -> tuple:
        """The SWA KV heads of layer `layer`, in load-time order (what its attention masks)."""
        return self.head_wise_swa.heads_of_layer(layer) if self.head_wise_swa else ()

    def layer_kv_head_order(self, layer: int) -> tuple:
        """Slot i of layer `layer` holds the checkpoint's KV head layer_kv_head_order(layer)[i]."""
        if self.kv_head_orders is None:
            return tuple(range(self.num_key_value_heads))
        return self.kv_head_orders[layer]

    @property
    def kv_head_order(self) -> Optional[tuple]:
        """The one KV-head order of every layer (None: identity); an error when layers differ."""
        if self.kv_head_orders is None:
            return None
        if len(set(self.kv_head_orders)) != 1:
            raise ValueError("kv_head_order: the KV heads are permuted differently per layer; "
                             "use layer_kv_head_order(layer)")
        return self.kv_head_orders[0]


def _check_architecture(raw: dict, where: str) -> Architecture:
    """The architecture the config declares; one we do not serve, or a mismatched model_type, is an error."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or len(archs) != 1:
        raise ValueError(f"model {where!r}: architectures={archs!r} must name exactly one architecture")
    try:
        arch = architecture(archs[0])
    except ValueError as exc:
        raise ValueError(f"model {where!r}: {exc}") from None
    declared = raw.get("model_type", arch.model_type)
    if declared not in (arch.model_type, arch.gguf_arch):
        raise ValueError(f"model {where!r}: model_type={declared!r} does not match architecture {arch.name} "
                         f"(expected {arch.model_type!r})")
    return arch


def _normalise_raw(arch: Architecture, raw: dict, where: str) -> dict:
    """Field spellings of other transformers versions mapped onto one: aliases and `rope_parameters`."""
    for alias, name in arch.config_aliases.items():
        if alias in raw:
            raw[name] = raw.pop(alias)
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):
        per_type = {k: v for k, v in rope.items() if isinstance(v, dict)}
        for kind, params in (per_type or {"full_attention": rope}).items():
            rope_type = params.get("rope_type", "default")
            if rope_type != "default" and (rope_type not in ROPE_SCALINGS or kind != "full_attention"):
                raise ValueError(f"model {where!r}: rope_type={rope_type!r} is not supported"
                                 + (f" on {kind} layers" if per_type and rope_type in ROPE_SCALINGS else
                                    f" (supported: {', '.join(ROPE_SCALINGS)})"))
            if rope_type != "default":
                raw["rope_scaling"] = params
                raw["rope_scaling_full_layers_only"] = bool(per_type)
            key = "rope_local_base_freq" if kind == "sliding_attention" else "rope_theta"
            if "rope_theta" in params:
                raw[key] = params["rope_theta"]
    return raw


def _layer_sliding_windows(arch: Architecture, raw: dict) -> Optional[tuple]:
    """Per layer: the window of a sliding layer, None for a global one (config `layer_types`, else the
    architecture's own rule: Architecture.sliding_layers); None when no layer slides."""
    layers = raw["num_hidden_layers"]
    if arch.sliding_layers == ABOVE_MAX_WINDOW_LAYERS and not raw.get("use_sliding_window"):
        return None  # transformers' Qwen2/3 drop the window without use_sliding_window, whatever layer_types says
    types = raw.get("layer_types") or _rule_layer_types(arch.sliding_layers, raw, layers)
    if arch.sliding_layers != EVERY_NTH_GLOBAL:
        return layer_sliding_windows(dict(raw, layer_types=types) if types is not None else raw, layers)
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"model config: layer_types must list full_attention/sliding_attention for each of the "
                         f"{layers} layers, got {types!r}")
    window = raw.get("sliding_window")
    if not _is_int(window) or window < 1:
        raise ValueError(f"model config: sliding_window must be an integer >= 1, got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _rule_layer_types(rule: str, raw: dict, layers: int) -> Optional[list]:
    """The layer types a config without `layer_types` implies by its architecture's rule (None: it names
    none, and `layer_sliding_window`, if any, says)."""
    if rule == ALL_LAYERS:
        return ["sliding_attention" if raw.get("sliding_window") is not None else "full_attention"] * layers
    if rule == ABOVE_MAX_WINDOW_LAYERS:
        first = raw.get("max_window_layers")
        if not _is_int(first) or first < 0:
            raise ValueError(f"model config: max_window_layers must be an integer >= 0, got {first!r}")
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if rule == EVERY_NTH_GLOBAL:
        pattern = int(raw["sliding_window_pattern"])
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    return None


def _layer_rope_thetas(raw: dict, layer_windows: Optional[tuple], nope_full: bool = False) -> Optional[tuple]:
    """Per layer, its RoPE base (None: no RoPE, the full layers of an architecture with nope_full_layers)."""
    if layer_windows is None:
        return (None,) * int(raw["num_hidden_layers"]) if nope_full else None
    local = float(raw.get("rope_local_base_freq", raw["rope_theta"]))
    full = None if nope_full else float(raw["rope_theta"])
    return tuple(local if w is not None else full for w in layer_windows)


def _positive_float(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"model config: {key} must be a positive number, got {value!r}")
    return float(value)


def _softcap(raw: dict, key: str) -> float:
    """A soft-capping value: null (or absent) is none (0.0), anything else a positive number."""
    return 0.0 if raw.get(key) is None else _positive_float(raw, key, 0.0)


def _is_gguf_path(model: str) -> bool:
    from fastdeploy.model_executor.gguf_loader import is_gguf

    return not os.path.isdir(model) and is_gguf(model)


def _read_gguf_config(path: str) -> dict:
    from fastdeploy.input.gguf_tokenizer import stop_token_ids
    from fastdeploy.model_executor.gguf_loader import gguf_config, open_gguf

    reader = open_gguf(path)
    raw = gguf_config(reader, path)
    raw["eos_token_id"] = list(stop_token_ids(reader))  # eos, then the template's end of turn
    return raw


def _eos_token_ids(raw: dict, model: Optional[str]) -> tuple:
    """config.json's eos_token_id (int or list) plus generation_config.json's, first one first."""
    ids: list = []
    sources = [raw.get("eos_token_id")]
    gen_path = os.path.join(model, "generation_config.json") if model else None
    if gen_path and os.path.isfile(gen_path):
        try:
            with open(gen_path, encoding="utf-8") as f:
                sources.append(json.load(f).get("eos_token_id"))
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"model: cannot read {gen_path}: {exc}") from None
    for value in sources:
        for token in (value if isinstance(value, list) else [value]):
            if token is None:
                continue
            if not _is_int(token) or token < 0:
                raise ValueError(f"model config: eos_token_id must be an integer or a list of them, got {value!r}")
            if token not in ids:
                ids.append(token)
    return tuple(ids) or (2,)


def _resolve_dtype(requested: str, model: Optional[str], declared: Optional[str] = None, device: str = "cpu") -> str:
    """`--dtype`: auto = the checkpoint's dtype where this device has a matmul kernel for it, else float32
    (on the GPU: the checkpoint's 16-bit dtype, else bfloat16, which the CUDA attention op needs)."""
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {requested!r}")
    import importlib.util

    if importlib.util.find_spec("paddle") is None:  # a config-only process (scheduler tools): no model runs here
        return requested if requested != "auto" else (declared if declared in COMPUTE_DTYPES else "float32")
    from fastdeploy.model_executor.model_loader import checkpoint_dtype, device_supports

    if requested != "auto":
        if device != "gpu" and not device_supports(requested):
            raise ValueError(f"dtype={requested}: this device has no matmul kernel for {requested}; "
                             f"use --dtype float32")
        return requested
    stored = declared if declared in COMPUTE_DTYPES else "float32"
    if model is not None:
        try:
            stored = checkpoint_dtype(model)
        except ValueError:  # no weights yet: the loader reports that; config checks still run
            pass
    if device == "gpu":
        return stored if stored in ("bfloat16", "float16") else "bfloat16"
    return stored if device_supports(stored) else "float32"


def _read_model_config(model: str) -> dict:
    path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is neither a model directory, a .gguf file, a preset "
                         f"({', '.join(sorted(PRESETS))}) nor a named model ({', '.join(sorted(NAMED_MODELS))})")
    if not os.path.isfile(path):
        raise ValueError(f"model: {model!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model: {path} must hold a JSON object")
    return raw
