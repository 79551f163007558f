"""Engine configuration: cache, scheduler and parallel settings, and FDConfig, which validates them
against the model at start-up (the model's own configuration is read in `fastdeploy/model_config.py`;
its classes are importable from here too, upstream FastDeploy's path).

Every check raises `ValueError` with a message that names the offending field, so a bad flag
stops the server before it loads anything instead of crashing a step later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from fastdeploy import envs
from fastdeploy.model_config import (  # noqa: F401  (the model's classes, re-exported at upstream's path)
    COMPUTE_DTYPES,
    HeadWiseSWAConfig,
    ModelConfig,
    MoEConfig,
    _is_int,
)
from fastdeploy.model_executor.layers.quantization import kv_cache as kv_quant
from fastdeploy.model_executor.swa_head_placement import place_swa_heads
from fastdeploy.model_executor.tensor_parallel import check_shardable

logger = logging.getLogger("fastdeploy.config")

DEFAULT_KV_CACHE_MEMORY = 256 * 1024 * 1024
CACHE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # float16: the CUDA op only
# reserve: a request is admitted only when its lifetime peak fits beside the others' (never preempted);
# on_demand: upstream's first chunk + FD_ENC_DEC_BLOCK_NUM blocks, LIFO preemption and recompute;
# projected (default): reserves each request's one-token-step page curve, projected over the steps it
# has left, and lets prefill chunks borrow the unreserved rest (never preempted). See ResourceManagerV1.
ADMISSION_POLICIES = ("reserve", "on_demand", "projected")
DEFAULT_ADMISSION_POLICY = "projected"


@dataclass
class CacheConfig:
    block_size: int = 64
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    cache_dtype: str = "float32"
    # None = on unless the attention backend cannot read shared pages (resolved to a bool by FDConfig).
    enable_prefix_caching: Optional[bool] = None
    # none / int8 / block_wise_fp8 / block_wise_int4 / k8v4 (layers/quantization/kv_cache.py); None = the
    # checkpoint's quantization_config.kv_cache_quant_type, else none (resolved by FDConfig).
    kv_cache_quant_type: Optional[str] = None
    # GiB of host memory for the prefix cache's second tier (upstream's --swap-space; cache_manager/host_tier.py);
    # None or 0: no tier.
    swap_space: Optional[float] = None
    # int8 / int4: the host and disk tiers keep pages as codes with a scale per token and head (tier_codec.py);
    # None: as the pool holds them.
    swap_space_dtype: Optional[str] = None
    # The disk tier below the host tier (upstream's --kvcache-storage-backend; cache_manager/disk_tier.py):
    # "file" or None; its directory and the GiB of page files it may hold.
    kvcache_storage_backend: Optional[str] = None
    kvcache_storage_path: Optional[str] = None
    kvcache_storage_space: float = 16.0
    num_gpu_blocks: int = 0  # resolved by FDConfig

    @property
    def swap_space_bytes(self) -> int:
        return int((self.swap_space or 0) * (1 << 30))

    def page_dtype(self, lane: str) -> str:
        """The dtype of the K (lane="key") or V (lane="value") tensors: int8 / float8_e4m3fn / uint8 (int4
        pairs) for quantized pages, else cache_dtype; k8v4's lanes differ (int8 keys, uint8 values)."""
        return kv_quant.page_dtype(self.kv_cache_quant_type or "none", self.cache_dtype, lane)

    def row_elements(self, head_dim: int, lane: str) -> int:
        """The last dim of a K or V tensor: head_dim, or head_dim / 2 bytes of int4 pairs."""
        return kv_quant.row_elements(self.kv_cache_quant_type or "none", head_dim, lane)

    @property
    def quantized(self) -> bool:
        return kv_quant.is_quantized(self.kv_cache_quant_type or "none")

    def block_bytes(self, model: ModelConfig, tensor_parallel_size: int) -> int:
        """Bytes one block takes on one rank: K and V, every layer, this rank's KV heads (the same for
        any slot layout: k lanes x G slots = layers x heads), quantized pages' scales included."""
        heads = model.num_key_value_heads // tensor_parallel_size
        kv_row = kv_quant.kv_row_bytes(self.kv_cache_quant_type or "none", CACHE_DTYPE_BYTES[self.cache_dtype],
                                       model.head_dim)
        return model.num_hidden_layers * heads * self.block_size * kv_row


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
    admission_policy: str = DEFAULT_ADMISSION_POLICY
    enc_dec_block_num: int = 2
    attention_backend: str = "APPEND_ATTN"
    device: str = "cpu"  # resolved by --device (worker/device.py): "gpu" or "cpu"
    head_wise_attn: str = "SINGLE_PASS"  # FD_HEAD_WISE_ATTN: SINGLE_PASS or DUAL_PASS (upstream's baseline)
    speculative_config: Any = None  # spec_decode.config.SpeculativeConfig, or None: no speculation
    guided_decoding_backend: str = "auto"  # --guided-decoding-backend (model_executor/guided_decoding/backend.py)
    # --splitwise-role / --kv-transfer-config (disaggregation/transfer_config.py); None: a plain server
    kv_transfer_config: Any = None
    # --kv-events-config (engine/kv_events_publisher.py); None: no KV-cache events
    kv_events_config: Any = None
    env: Any = None  # every environment flag as it was when the config was made (envs.snapshot())

    def __post_init__(self) -> None:
        if self.env is None:  # built directly (tests): the flags as they are now
            self.env = envs.snapshot()
        self._validate()
        self._resolve_slots()
        self._resolve_num_blocks()
        self._fit_max_model_len()

    @property
    def reserve_output_pages(self) -> bool:
        return self.admission_policy == "reserve"

    @classmethod
    def from_env(cls, admission_policy: Optional[str] = None, env: Any = None, **parts: Any) -> "FDConfig":
        """The config with the env flags of `env` (an envs.snapshot(); None: taken now). It keeps them:
        later changes to the environment do not affect it, and nothing reads the environment after it."""
        env = env if env is not None else envs.snapshot()
        if env.ENABLE_V1_KVCACHE_SCHEDULER != 1:
            raise ValueError("ENABLE_V1_KVCACHE_SCHEDULER=0: this engine only has the V1 KV-cache scheduler; "
                             "unset the flag or set it to 1")
        return cls(
            head_wise_kv_cache=_bool_flag("FD_HEAD_WISE_KV_CACHE", env.FD_HEAD_WISE_KV_CACHE),
            swa_recycle=_bool_flag("FD_HEAD_WISE_SWA_RECYCLE", env.FD_HEAD_WISE_SWA_RECYCLE),
            admission_policy=_admission_policy(admission_policy, env),
            enc_dec_block_num=env.FD_ENC_DEC_BLOCK_NUM,
            attention_backend=env.FD_ATTENTION_BACKEND,
            head_wise_attn=env.FD_HEAD_WISE_ATTN,
            env=env,
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
        self.model_config = model = place_swa_heads(model, self.attention_backend, tp, par.balance_swa_heads)
        if not _is_int(cache.block_size) or cache.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {cache.block_size!r}")
        if cache.cache_dtype not in CACHE_DTYPE_BYTES:
            raise ValueError(f"cache_dtype must be one of {sorted(CACHE_DTYPE_BYTES)}, got {cache.cache_dtype!r}")
        cache.kv_cache_quant_type = kv_quant.resolve_kv_cache_quant_type(cache.kv_cache_quant_type, model.raw)
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
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission_policy (FD_ADMISSION_POLICY / --admission-policy) must be one of "
                             f"{', '.join(ADMISSION_POLICIES)}, got {self.admission_policy!r}")
        if self.enc_dec_block_num < 0:
            raise ValueError(f"FD_ENC_DEC_BLOCK_NUM must be >= 0, got {self.enc_dec_block_num}")
        if self.head_wise_kv_cache:
            if model.head_wise_swa is None and model.layer_sliding_window is None:
                raise ValueError("FD_HEAD_WISE_KV_CACHE=1 but the model declares no SWA KV heads and no sliding "
                                 "layers: add a head_wise_swa section to config.json or pass "
                                 "--head-wise-swa-config")
        elif not self.swa_recycle:
            raise ValueError("FD_HEAD_WISE_SWA_RECYCLE=0 has no effect without FD_HEAD_WISE_KV_CACHE=1")
        self._resolve_prefix_caching()
        self._check_swap_space()
        self._check_swap_space_dtype()
        self._check_storage()
        self._check_device()
        self._check_kv_transfer()
        if self.kv_events_config is not None and not self.cache_config.enable_prefix_caching:
            raise ValueError("--kv-events-config: KV-cache events describe the prefix cache, which is off "
                             "(drop --no-enable-prefix-caching)")

    def _check_kv_transfer(self) -> None:
        """What a prefill/decode pair moves is one rank's pool of pages in host memory."""
        if self.kv_transfer_config is None:
            return
        role = self.kv_transfer_config.splitwise_role
        if self.parallel_config.tensor_parallel_size != 1:
            raise ValueError(f"--splitwise-role {role}: KV transfer is built for tensor_parallel_size 1 (each "
                             f"rank's pool would need its own agent)")
        if self.attention_backend == "NATIVE_ATTN":
            raise ValueError(f"--splitwise-role {role}: the NATIVE_ATTN oracle keeps no paged KV to transfer")
        if self.device != "cpu":
            raise ValueError(f"--splitwise-role {role}: KV transfer registers host memory (NIXL DRAM segments); "
                             f"pages in GPU memory are not built here")

    def _resolve_slots(self) -> None:
        """The slot layout (cache_manager/slots.py) of the model's per-(layer, KV head) attention types,
        chosen once here and logged: every memory mode addresses the cache through it."""
        from fastdeploy.cache_manager.slots import assign_slots
        from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table

        types = attention_type_table(self.model_config)
        self.slot_layout = assign_slots(types, self.parallel_config.tensor_parallel_size)
        if self.model_config.layer_sliding_window is not None or self.slot_layout.num_lanes != \
                self.model_config.num_hidden_layers or len(self.slot_layout.sliding_types) > 1:
            logger.info("KV slots: %s", self.slot_layout.describe())

    def _check_device(self) -> None:
        from fastdeploy.worker.device import check_gpu_attention_dtypes, check_gpu_attention_shapes, \
            default_cache_dtype

        if self.device not in ("gpu", "cpu"):
            raise ValueError(f"device must be resolved to gpu or cpu, got {self.device!r}")
        if self.device == "gpu" and self.attention_backend == "APPEND_ATTN":
            check_gpu_attention_dtypes(self.model_config.dtype, self.cache_config.cache_dtype)
            model = self.model_config
            check_gpu_attention_shapes(model.head_dim, self.cache_config.block_size, model.num_attention_heads,
                                       model.num_key_value_heads, model.preset)
        if self.attention_backend == "CUDA_ON_CPU":
            # The CUDA op's kernels on the CPU: the shapes they exist for, and the GPU's page format.
            if self.device != "cpu":
                raise ValueError("FD_ATTENTION_BACKEND=CUDA_ON_CPU runs the CUDA kernels on the CPU: use --device cpu "
                                 "(on a GPU the default APPEND_ATTN runs them there)")
            model = self.model_config
            check_gpu_attention_shapes(model.head_dim, self.cache_config.block_size, model.num_attention_heads,
                                       model.num_key_value_heads, model.preset)
            if not self.cache_config.quantized and self.cache_config.cache_dtype != "bfloat16":
                raise ValueError("FD_ATTENTION_BACKEND=CUDA_ON_CPU keeps bfloat16 pages, as the CUDA op on a GPU; "
                                 f"got --cache-dtype {self.cache_config.cache_dtype}")
        if self.device == "cpu" and self.cache_config.cache_dtype == "float16":
            raise ValueError("cache_dtype=float16 needs --device gpu; the CPU op stores float32 or bfloat16")
        kv_quant.check_kv_cache_quant_type(self.cache_config.kv_cache_quant_type, self.cache_config.cache_dtype,
                                           default_cache_dtype(self.device, self.model_config.dtype,
                                                               self.attention_backend),
                                           self.attention_backend, self.device, self.model_config.dtype,
                                           self.model_config.head_dim)
        if self.head_wise_attn == "DUAL_PASS":
            # Upstream's baseline: two kernel passes over one shared 1-D table. Only the CUDA op has
            # the second pass; on the CPU, or with per-head tables, it would be a silent no-op.
            if self.device != "gpu":
                raise ValueError("FD_HEAD_WISE_ATTN=dual_pass runs two passes of the CUDA op; it needs "
                                 "--device gpu (the CPU op has the single-pass kernel only)")
            if self.head_wise_kv_cache:
                raise ValueError("FD_HEAD_WISE_ATTN=dual_pass is the 1-D-table baseline; set "
                                 "FD_HEAD_WISE_KV_CACHE=0 (the A/B arm against head-wise tables)")
            if self.model_config.head_wise_swa is None:
                raise ValueError("FD_HEAD_WISE_ATTN=dual_pass but the model declares no SWA KV heads: add a "
                                 "head_wise_swa section to config.json or pass --head-wise-swa-config")
            if self.attention_backend != "APPEND_ATTN":
                raise ValueError("FD_HEAD_WISE_ATTN=dual_pass needs FD_ATTENTION_BACKEND=APPEND_ATTN")

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

    def _check_swap_space(self) -> None:
        """The host tier lies below the prefix cache, and copies pages of the in-process rank's host tensors."""
        space = self.cache_config.swap_space
        if space is None or space == 0:
            return
        if isinstance(space, bool) or not isinstance(space, (int, float)) or not space > 0:
            raise ValueError(f"swap_space (--swap-space) must be a positive number of GiB, got {space!r}")
        if not self.cache_config.enable_prefix_caching:
            raise ValueError("--swap-space: the host tier holds pages the prefix cache evicts, and the prefix "
                             "cache is off (drop --no-enable-prefix-caching)")
        if self.parallel_config.tensor_parallel_size != 1:
            raise ValueError("--swap-space: the host tier is built for tensor_parallel_size 1 (the workers' pools "
                             "would each need their own)")
        if self.device != "cpu":
            raise ValueError("--swap-space: the host tier copies pages of KV tensors in host memory; pages in GPU "
                             "memory (pinned host copies) are not built here")

    def _check_swap_space_dtype(self) -> None:
        cache = self.cache_config
        dtype = cache.swap_space_dtype
        if dtype is None:
            return
        if dtype not in ("int8", "int4"):
            raise ValueError(f"--swap-space-dtype: {dtype!r} is not one of int8, int4")
        if not cache.swap_space_bytes:
            raise ValueError("--swap-space-dtype compresses the host tier's pages; give it memory with --swap-space")
        if cache.kv_cache_quant_type != "none" or cache.cache_dtype != "float32":
            raise ValueError(f"--swap-space-dtype: the pool's pages are already {cache.kv_cache_quant_type} / "
                             f"{cache.cache_dtype}; the tier compresses float32 pages only")

    def _check_storage(self) -> None:
        """The disk tier takes what the host tier lets go: it needs the host tier and a directory."""
        cache = self.cache_config
        backend = cache.kvcache_storage_backend
        if backend is None:
            return
        if backend != "file":
            raise ValueError(f"--kvcache-storage-backend: {backend!r} is not built here (choices: file)")
        if not cache.swap_space_bytes:
            raise ValueError("--kvcache-storage-backend file: the disk tier holds what the host tier lets go; "
                             "give the host tier memory with --swap-space")
        if not cache.kvcache_storage_path:
            raise ValueError("--kvcache-storage-backend file needs --kvcache-storage-path DIR")
        space = cache.kvcache_storage_space
        if isinstance(space, bool) or not isinstance(space, (int, float)) or not space > 0:
            raise ValueError(f"--kvcache-storage-space must be a positive number of GiB, got {space!r}")

    def _resolve_num_blocks(self) -> None:
        cache = self.cache_config
        block_bytes = cache.block_bytes(self.model_config, self.parallel_config.tensor_parallel_size)
        if cache.num_gpu_blocks_override is not None:
            n = cache.num_gpu_blocks_override
            if not _is_int(n) or n < 1:
                raise ValueError(f"num_gpu_blocks_override must be a positive integer, got {n!r}")
            source = "--num-gpu-blocks-override"
        else:
            budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
            if not _is_int(budget) or budget < 1:
                raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {budget!r}")
            n = budget // block_bytes
            if n < 1:
                raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {block_bytes} bytes")
            source = f"--kv-cache-memory {budget} bytes"
        cache.num_gpu_blocks = int(n)
        slots = self.slot_layout.slots_per_rank  # a page: one slot's block_size tokens in every lane
        self.kv_cache_summary = (f"KV cache: {kv_quant.describe_pages(cache.kv_cache_quant_type, cache.cache_dtype)}, "
                                 f"{block_bytes // slots} bytes per page, {cache.num_gpu_blocks * slots} pages per "
                                 f"rank ({cache.num_gpu_blocks} blocks x {slots} slots) from {source}")

    def _fit_max_model_len(self) -> None:
        """max_model_len must fit the sized KV cache: one request that long must find its peak pages.

        A default (max_position_embeddings, 131072 on real models) is capped to what fits, and
        the log says so; a value the user gave that does not fit is logged, and each request
        that cannot fit is refused with a clear error when it arrives.
        """
        from fastdeploy.cache_manager.head_wise import PageLayout

        model = self.model_config
        layout = PageLayout.from_config(self)
        pages = self.cache_config.num_gpu_blocks * layout.slots_per_rank
        chunk = self.scheduler_config.max_num_batched_tokens

        def fits(length: int) -> bool:  # all prompt, or a one-token prompt and all output
            return all(max(layout.peak_pages_per_rank(p, length - p, chunk)) <= pages for p in (length - 1, 1))

        if fits(model.max_model_len):
            return
        if model.max_model_len_given:
            # Kept as given (tests squeeze the cache on purpose): a request that cannot fit is
            # refused when it arrives, with the scheduler's error naming the page shortfall.
            logger.warning("max_model_len=%d does not fit the KV cache (%d blocks of %d tokens): requests "
                           "longer than the cache holds will be refused", model.max_model_len,
                           self.cache_config.num_gpu_blocks, self.cache_config.block_size)
            return
        low, high = 1, model.max_model_len  # fits(low) or low == 1; not fits(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        if low < 2:
            raise ValueError(f"the KV cache ({self.cache_config.num_gpu_blocks} blocks) holds no request; "
                             "give more --kv-cache-memory / --num-gpu-blocks-override")
        logger.warning("max_model_len defaults to %d (capped from %d: the most one request can hold in the "
                       "KV cache of %d blocks x %d tokens); pass --max-model-len / --kv-cache-memory to change it",
                       low, model.max_model_len, self.cache_config.num_gpu_blocks, self.cache_config.block_size)
        model.max_model_len = low

    def startup_log(self, num_pages: int) -> list:
        """(logging level, message) lines the engine logs once built: the memory mode, the page format,
        where the sliding heads come from, and what recycling can buy on each tensor-parallel rank."""
        model = self.model_config
        lines = [(logging.INFO, f"engine built: {model.served_model_name}, {self.cache_config.num_gpu_blocks} KV "
                                f"blocks ({num_pages} pages), head-wise={self.head_wise_kv_cache} recycle="
                                f"{self.swa_recycle_active} backend={self.attention_backend}"),
                 (logging.INFO, self.kv_cache_summary)]  # the page format, its bytes (scales included), pages
        swa = model.head_wise_swa
        if swa is not None:
            lines.append((logging.INFO, f"head_wise_swa from {model.head_wise_swa_source}: window "
                                        f"{swa.sliding_window}, sink {swa.sink_size}"))
            if swa.per_head_windows:
                types = [[swa.head_type(layer, h) for h in heads] for layer, heads in enumerate(swa.layer_kv_heads)]
                lines.append((logging.INFO, f"per-head windows (load-time order, per layer): windows "
                                            f"{[[w for w, _ in row] for row in types]}, sinks "
                                            f"{[[s for _, s in row] for row in types]}"))
            if swa.layer_kv_heads is not None:
                lines.append((logging.INFO, f"per-layer SWA KV heads (load-time order) "
                                            f"{[list(h) for h in swa.layer_kv_heads]}; KV head order per layer "
                                            f"{[list(model.layer_kv_head_order(l)) for l in range(model.num_hidden_layers)]}"))
        if model.preset is not None:
            lines.append((logging.WARNING, f"model {model.preset} is a built-in preset with random weights: its "
                                           f"generated text is meaningless"))
        return lines + self._rank_ceilings_log()

    def _rank_ceilings_log(self) -> list:
        """How much recycling can buy on each rank (admission waits for the fullest one)."""
        from fastdeploy.cache_manager.head_wise import rank_ceilings

        model, tp = self.model_config, self.parallel_config.tensor_parallel_size
        if tp == 1 or model.head_wise_swa is None:
            return []
        half = model.max_model_len // 2
        c = rank_ceilings(self, half, model.max_model_len - half)
        orders = [list(model.layer_kv_head_order(l)) for l in range(model.num_hidden_layers)]
        order = orders[0] if all(o == orders[0] for o in orders) else f"per layer {orders}"
        lines = [(logging.INFO, f"tensor parallel {tp}: SWA KV heads per rank {c['swa_heads_per_rank']} (KV head "
                                f"order {order}); recycling ceiling per rank "
                                f"[{', '.join(f'{x:.2f}' for x in c['per_rank'])}] for a {model.max_model_len}-token "
                                f"request, engine ceiling {c['ceiling']:.2f} (the fullest rank)")]
        counts = c["swa_heads_per_rank"]
        if max(counts) - min(counts) > 1:
            lines.append((logging.WARNING, "the SWA heads sit unevenly on the ranks: pass --balance-swa-heads to "
                                           "spread them"))
        return lines

    @property
    def table_rows(self) -> int:
        """Rows of a request's block table, all ranks: one per KV slot head-wise; 1 in 1-D mode, where a
        block id addresses every head (and is the same on every rank)."""
        return self.slot_layout.num_slots if self.head_wise_kv_cache else 1

    @property
    def table_rows_per_rank(self) -> int:
        return self.slot_layout.slots_per_rank if self.head_wise_kv_cache else 1

    @property
    def swa_recycle_active(self) -> bool:
        """True when SWA pages really are returned early: head-wise tables, SWA heads, recycle on."""
        return self.head_wise_kv_cache and self.swa_recycle and bool(self.slot_layout.sliding_slots)


def _bool_flag(name: str, value: int) -> bool:
    if value not in (0, 1):
        raise ValueError(f"environment variable {name}={value} must be 0 or 1")
    return bool(value)


def _admission_policy(cli_value: Optional[str], env) -> str:
    """The engine arg, else FD_ADMISSION_POLICY, else the legacy FD_RESERVE_OUTPUT_PAGES if set, else the default."""
    if cli_value is not None:
        return str(cli_value).strip().lower().replace("-", "_")
    if env.FD_ADMISSION_POLICY is not None:
        return env.FD_ADMISSION_POLICY
    if env.FD_RESERVE_OUTPUT_PAGES is not None:
        return "reserve" if _bool_flag("FD_RESERVE_OUTPUT_PAGES", env.FD_RESERVE_OUTPUT_PAGES) else "on_demand"
    return DEFAULT_ADMISSION_POLICY
