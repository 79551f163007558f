"""Engine configuration: model, cache, scheduler and parallel settings, validated at start-up.

Every check raises `ValueError` with a message that names the offending field, so a bad flag
stops the server before it loads anything instead of crashing a step later.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from fastdeploy import envs
from fastdeploy.model_executor.tensor_parallel import balanced_kv_head_order, check_shardable
from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG, TINY_PRESET_NAME

DEFAULT_KV_CACHE_MEMORY = 256 * 1024 * 1024
CACHE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class HeadWiseSWAConfig:
    """Which KV heads slide (in every layer), their window and their attention sink, in tokens."""

    sliding_window: int
    sink_size: int
    swa_kv_heads: tuple

    @classmethod
    def from_dict(cls, spec: Any, num_kv_heads: int) -> "HeadWiseSWAConfig":
        where = "head_wise_swa"
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc.msg} at char {exc.pos})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected an object with sliding_window, sink_size, swa_kv_heads")
        unknown = set(spec) - {"sliding_window", "sink_size", "swa_kv_heads"}
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
            raise ValueError(f"{where}.swa_kv_heads must be a non-empty list of KV head indices, got {heads!r}")
        for h in heads:
            if not _is_int(h) or not 0 <= h < num_kv_heads:
                raise ValueError(
                    f"{where}.swa_kv_heads: head {h!r} is out of range (the model has {num_kv_heads} KV heads)"
                )
        if len(set(heads)) != len(heads):
            raise ValueError(f"{where}.swa_kv_heads lists a head twice: {list(heads)}")
        return cls(int(window), int(sink), tuple(sorted(int(h) for h in heads)))

    def to_dict(self) -> dict:
        return {"sliding_window": self.sliding_window, "sink_size": self.sink_size,
                "swa_kv_heads": list(self.swa_kv_heads)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    # Load-time KV-head order: slot i holds the checkpoint's KV head kv_head_order[i] (None: identity).
    # head_wise_swa.swa_kv_heads is in this order. Set by --balance-swa-heads.
    kv_head_order: Optional[tuple] = None

    @classmethod
    def create(cls, model: Optional[str], max_model_len: Optional[int], head_wise_swa_override: Any,
               served_model_name: Optional[str] = None) -> "ModelConfig":
        raw = dict(TINY_PRESET_CONFIG) if model is None else _read_model_config(model)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            if not _is_int(raw.get(key)) or raw[key] < 1:
                raise ValueError(f"model config: {key} must be a positive integer, got {raw.get(key)!r}")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        if heads % kv_heads:
            raise ValueError(f"model config: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        if head_dim % 2:
            raise ValueError(f"model config: head_dim={head_dim} must be even for rotary embeddings")
        max_pos = int(raw.get("max_position_embeddings", 4096))
        if max_model_len is None:
            max_model_len = min(max_pos, 4096) if model is None else max_pos
        if not _is_int(max_model_len) or max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")
        swa_spec = head_wise_swa_override if head_wise_swa_override is not None else raw.get("head_wise_swa")
        swa = None if swa_spec is None else HeadWiseSWAConfig.from_dict(swa_spec, kv_heads)
        name = served_model_name or (TINY_PRESET_NAME if model is None else os.path.basename(os.path.normpath(model)))
        return cls(
            model=model,
            architectures=list(raw.get("architectures", ["Ernie4_5_ForCausalLM"])),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw.get("intermediate_size", 4 * raw["hidden_size"])),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(heads),
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=max_pos,
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            pad_token_id=int(raw.get("pad_token_id", 0)),
            bos_token_id=int(raw.get("bos_token_id", 1)),
            eos_token_id=int(raw.get("eos_token_id", 2)),
            max_model_len=int(max_model_len),
            head_wise_swa=swa,
            seed=int(raw.get("seed", 0)),
            served_model_name=name,
            raw=raw,
        )

    @property
    def swa_kv_heads(self) -> tuple:
        return self.head_wise_swa.swa_kv_heads if self.head_wise_swa else ()


def _read_model_config(model: str) -> dict:
    path = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise ValueError(f"model: {model!r} is not a directory")
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


@dataclass
class CacheConfig:
    block_size: int = 64
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    cache_dtype: str = "float32"
    # None = on unless the attention backend cannot read shared pages (resolved to a bool by FDConfig).
    enable_prefix_caching: Optional[bool] = None
    num_gpu_blocks: int = 0  # resolved by FDConfig

    def block_bytes(self, model: ModelConfig, tensor_parallel_size: int) -> int:
        """Bytes one block takes on one rank: K and V, every layer, this rank's KV heads."""
        heads = model.num_key_value_heads // tensor_parallel_size
        return (2 * model.num_hidden_layers * heads * self.block_size * model.head_dim
                * CACHE_DTYPE_BYTES[self.cache_dtype])


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    # Permute whole KV-head groups at load time so every rank gets its share of the SWA heads.
    balance_swa_heads: bool = False


@dataclass
class FDConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    head_wise_kv_cache: bool = False
    swa_recycle: bool = True
    reserve_output_pages: bool = True
    enc_dec_block_num: int = 2
    attention_backend: str = "APPEND_ATTN"

    def __post_init__(self) -> None:
        self._validate()
        self._resolve_num_blocks()

    @classmethod
    def from_env(cls, **parts: Any) -> "FDConfig":
        """Snapshot the env flags now; later changes to the environment do not affect this config."""
        if envs.ENABLE_V1_KVCACHE_SCHEDULER != 1:
            raise ValueError("ENABLE_V1_KVCACHE_SCHEDULER=0: this engine only has the V1 KV-cache scheduler; "
                             "unset the flag or set it to 1")
        head_wise = _bool_flag("FD_HEAD_WISE_KV_CACHE", envs.FD_HEAD_WISE_KV_CACHE)
        return cls(
            head_wise_kv_cache=head_wise,
            swa_recycle=_bool_flag("FD_HEAD_WISE_SWA_RECYCLE", envs.FD_HEAD_WISE_SWA_RECYCLE),
            reserve_output_pages=_bool_flag("FD_RESERVE_OUTPUT_PAGES", envs.FD_RESERVE_OUTPUT_PAGES),
            enc_dec_block_num=envs.FD_ENC_DEC_BLOCK_NUM,
            attention_backend=envs.FD_ATTENTION_BACKEND,
            **parts,
        )

    def _validate(self) -> None:
        model, cache, sched, par = self.model_config, self.cache_config, self.scheduler_config, self.parallel_config
        tp = par.tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        if model.num_key_value_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_key_value_heads="
                             f"{model.num_key_value_heads}")
        check_shardable(model, tp)
        if par.balance_swa_heads:
            self.model_config = model = _balance_swa_heads(model, tp)
        if not _is_int(cache.block_size) or cache.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {cache.block_size!r}")
        if cache.cache_dtype not in CACHE_DTYPE_BYTES:
            raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPE_BYTES)}, got {cache.cache_dtype!r}")
        if not _is_int(sched.max_num_seqs) or sched.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {sched.max_num_seqs!r}")
        if sched.max_num_batched_tokens is None:
            sched.max_num_batched_tokens = max(2048, sched.max_num_seqs) if sched.enable_chunked_prefill \
                else max(model.max_model_len, sched.max_num_seqs)
        if not _is_int(sched.max_num_batched_tokens) or sched.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {sched.max_num_batched_tokens!r}")
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < model.max_model_len:
            raise ValueError(f"max_num_batched_tokens={sched.max_num_batched_tokens} is smaller than max_model_len="
                             f"{model.max_model_len}; enable chunked prefill or raise it")
        if self.enc_dec_block_num < 0:
            raise ValueError(f"FD_ENC_DEC_BLOCK_NUM must be >= 0, got {self.enc_dec_block_num}")
        if self.head_wise_kv_cache:
            if model.head_wise_swa is None:
                raise ValueError("FD_HEAD_WISE_KV_CACHE=1 but the model declares no SWA KV heads: add a "
                                 "head_wise_swa section to config.json or pass --head-wise-swa-config")
        elif not self.swa_recycle:
            raise ValueError("FD_HEAD_WISE_SWA_RECYCLE=0 has no effect without FD_HEAD_WISE_KV_CACHE=1")
        self._resolve_prefix_caching()

    def _resolve_prefix_caching(self) -> None:
        """On by default (upstream); the dense NATIVE_ATTN oracle keeps K/V per request slot, not in
        pages, so a cache hit would leave it without the prefix's keys: there the default is off and
        asking for it explicitly is a start-up error."""
        cache = self.cache_config
        dense = self.attention_backend == "NATIVE_ATTN"
        if cache.enable_prefix_caching is None:
            cache.enable_prefix_caching = not dense
        elif not isinstance(cache.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {cache.enable_prefix_caching!r}")
        elif cache.enable_prefix_caching and dense:
            raise ValueError("enable_prefix_caching: FD_ATTENTION_BACKEND=NATIVE_ATTN keeps K/V per request and "
                             "cannot reuse cached pages; pass --no-enable-prefix-caching")

    def _resolve_num_blocks(self) -> None:
        cache = self.cache_config
        if cache.num_gpu_blocks_override is not None:
            n = cache.num_gpu_blocks_override
            if not _is_int(n) or n < 1:
                raise ValueError(f"num_gpu_blocks_override must be a positive integer, got {n!r}")
        else:
            budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
            if not _is_int(budget) or budget < 1:
                raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {budget!r}")
            n = budget // cache.block_bytes(self.model_config, self.parallel_config.tensor_parallel_size)
            if n < 1:
                raise ValueError(f"kv_cache_memory={budget} bytes holds no block of "
                                 f"{cache.block_bytes(self.model_config, self.parallel_config.tensor_parallel_size)} bytes")
        cache.num_gpu_blocks = int(n)

    @property
    def swa_recycle_active(self) -> bool:
        """True when SWA pages really are returned early: head-wise tables, SWA heads, recycle on."""
        return self.head_wise_kv_cache and self.swa_recycle and self.model_config.head_wise_swa is not None


def _balance_swa_heads(model: ModelConfig, tp: int) -> ModelConfig:
    """The same model with its KV-head groups reordered so the SWA heads spread over the ranks."""
    from dataclasses import replace

    if model.head_wise_swa is None:
        raise ValueError("balance_swa_heads: the model declares no SWA KV heads to balance")
    if model.kv_head_order is not None:
        return model  # already balanced (a config built twice from the same ModelConfig)
    order = balanced_kv_head_order(model.num_key_value_heads, model.head_wise_swa.swa_kv_heads, tp)
    swa = tuple(i for i, h in enumerate(order) if h in model.head_wise_swa.swa_kv_heads)
    return replace(model, kv_head_order=tuple(order), head_wise_swa=replace(model.head_wise_swa, swa_kv_heads=swa))


def _bool_flag(name: str, value: int) -> bool:
    if value not in (0, 1):
        raise ValueError(f"environment variable {name}={value} must be 0 or 1")
    return bool(value)
