"""EngineArgs: the engine's command-line flags (upstream names) and their mapping onto FDConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

from fastdeploy import envs
from fastdeploy.config import (ADMISSION_POLICIES, COMPUTE_DTYPES, DEFAULT_ADMISSION_POLICY, CacheConfig, FDConfig,
                               ModelConfig, ParallelConfig, SchedulerConfig)
from fastdeploy.disaggregation.transfer_config import SPLITWISE_ROLES, KVTransferConfig
from fastdeploy.engine.kv_events_publisher import KVEventsConfig
from fastdeploy.model_executor.guided_decoding.backend import BACKENDS, check_backend
from fastdeploy.spec_decode.config import SpeculativeConfig
from fastdeploy.worker.device import DEVICE_CHOICES, default_cache_dtype, resolve_device


@dataclass
class EngineArgs:
    model: Optional[str] = None
    served_model_name: Optional[str] = None
    max_model_len: Optional[int] = None
    max_num_seqs: int = 8
    block_size: int = 64
    num_gpu_blocks_override: Optional[int] = None
    kv_cache_memory: Optional[int] = None
    cache_dtype: Optional[str] = None  # None: float32 on the CPU, the compute dtype on the GPU
    kv_cache_quant_type: Optional[str] = None  # None: the checkpoint's quantization_config, else none
    swap_space: Optional[float] = None  # GiB of host memory for the prefix cache's host tier
    swap_space_dtype: Optional[str] = None  # int8 / int4: compressed host and disk tiers
    kvcache_storage_backend: Optional[str] = None  # "file": a disk tier below the host tier
    kvcache_storage_path: Optional[str] = None
    kvcache_storage_space: float = 16.0  # GiB of page files
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: Optional[bool] = None  # None: on, unless FD_ATTENTION_BACKEND=NATIVE_ATTN
    tensor_parallel_size: int = 1
    balance_swa_heads: bool = False
    head_wise_swa_config: Union[None, str, dict] = None
    dtype: str = "auto"
    admission_policy: Optional[str] = None  # None: FD_ADMISSION_POLICY, else FD_RESERVE_OUTPUT_PAGES, else default
    device: Optional[str] = None  # None: FD_DEVICE (default auto)
    speculative_config: Union[None, str, dict] = None  # spec_decode/config.py; None: no speculation
    guided_decoding_backend: str = "auto"  # structured outputs: auto (llguidance) or off
    splitwise_role: str = "mixed"  # prefill/decode disaggregation (upstream's flag); mixed: both in one server
    kv_transfer_config: Union[None, str, dict] = None  # vLLM's --kv-transfer-config JSON (NixlConnector)
    kv_events_config: Union[None, str, dict] = None  # vLLM's --kv-events-config JSON (KV-cache events over ZMQ)
    reasoning_parser: Optional[str] = None  # upstream's flag; harmony (gpt-oss); read by the API server's engine

    def create_engine_config(self) -> FDConfig:
        """Validate every flag (env flags included) and build the config; raises ValueError naming the field."""
        env = envs.snapshot()  # every flag, read once: the config keeps it
        device = resolve_device(self.device or env.FD_DEVICE.lower())
        model_config = ModelConfig.create(self.model, self.max_model_len, self.head_wise_swa_config,
                                          self.served_model_name, self.dtype, device,
                                          calibrated=env.FD_HEAD_WISE_KV_CACHE == 1)
        return FDConfig.from_env(
            env=env,
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_cache_memory=self.kv_cache_memory,
                cache_dtype=self.cache_dtype or default_cache_dtype(device, model_config.dtype, env.FD_ATTENTION_BACKEND),
                kv_cache_quant_type=self.kv_cache_quant_type,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space=self.swap_space,
                swap_space_dtype=self.swap_space_dtype,
                kvcache_storage_backend=self.kvcache_storage_backend,
                kvcache_storage_path=self.kvcache_storage_path,
                kvcache_storage_space=self.kvcache_storage_space,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           balance_swa_heads=self.balance_swa_heads),
            admission_policy=self.admission_policy,
            device=device,
            speculative_config=SpeculativeConfig.parse(self.speculative_config),
            guided_decoding_backend=check_backend(self.guided_decoding_backend),
            kv_transfer_config=KVTransferConfig.parse(self.splitwise_role, self.kv_transfer_config),
            kv_events_config=KVEventsConfig.parse(self.kv_events_config),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs
        g = parser.add_argument_group("engine")
        g.add_argument("--model", type=str, default=d.model,
                       help="model directory as PaddleFormers' save_pretrained writes it, or a preset name "
                            "(tiny-moe); omit for the built-in dense tiny preset")
        g.add_argument("--dtype", choices=list(COMPUTE_DTYPES), default=d.dtype,
                       help="compute dtype of weights and activations (auto: the checkpoint's where this device "
                            "has kernels for it, else float32)")
        g.add_argument("--served-model-name", type=str, default=d.served_model_name,
                       help="model name reported by the API (default: the model directory's name)")
        g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="longest prompt + output, in tokens")
        g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests running at once")
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block/page")
        g.add_argument("--num-gpu-blocks-override", type=int, default=d.num_gpu_blocks_override,
                       help="number of KV blocks (each holds every KV head); overrides --kv-cache-memory")
        g.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                       help="bytes of KV cache per rank (default 256 MiB)")
        g.add_argument("--cache-dtype", choices=["float32", "bfloat16", "float16"], default=d.cache_dtype,
                       help="storage type of the KV cache (default: float32 on the CPU, the compute dtype on the GPU)")
        g.add_argument("--kv-cache-quant-type", type=str, default=d.kv_cache_quant_type,
                       help="KV page format: none, int8 or block_wise_fp8 (8-bit K/V + a float32 scale per token "
                            "and KV head, ~3.8x the float32 pages at head_dim 64), block_wise_int4 (4-bit codes + "
                            "the same scales, ~7.1x, costly in accuracy), k8v4 (int8 keys, int4 values, each "
                            "with its scale, ~4.9x: the recommended 4-bit form, retrieval within 2 of float32 "
                            "pages, docs/swa_quality.md); "
                            "default: the checkpoint's quantization_config.kv_cache_quant_type, else none")
        g.add_argument("--device", choices=list(DEVICE_CHOICES), default=d.device,
                       help="where the model, KV cache and attention run (auto: the GPU when Paddle has CUDA and "
                            "sees one, else the CPU; default: FD_DEVICE, else auto)")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget of one step (prefill chunks + decodes)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       default=d.enable_chunked_prefill, help="split long prompts over several steps")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse KV blocks of shared prompt prefixes (default: on, except with the dense "
                            "NATIVE_ATTN oracle backend)")
        g.add_argument("--swap-space", type=float, default=d.swap_space,
                       help="GiB of host memory for a second tier of the prefix cache: cached pages the KV cache "
                            "evicts are copied there (not stale sliding-window pages) and copied back on a hit "
                            "(default: none)")
        g.add_argument("--swap-space-dtype", choices=["int8", "int4"], default=d.swap_space_dtype,
                       help="keep the host and disk tiers' pages as int8 or int4 codes with a scale per token and KV "
                            "head (3.76x / 7.1x the pages of float32 at head_dim 64); a page loaded back costs the "
                            "accuracy of a quantized page (default: the pool's float32)")
        g.add_argument("--kvcache-storage-backend", choices=["file"], default=d.kvcache_storage_backend,
                       help="a disk tier below --swap-space's host tier: pages it lets go are written to files in "
                            "--kvcache-storage-path, and at a clean shutdown every cached page is; the next start "
                            "with the same model and cache layout hits on them (default: none)")
        g.add_argument("--kvcache-storage-path", type=str, default=d.kvcache_storage_path,
                       help="directory of the disk tier's page files (one subdirectory per model and cache layout)")
        g.add_argument("--kvcache-storage-space", type=float, default=d.kvcache_storage_space,
                       help="GiB of page files the disk tier may hold; the oldest go first (default: 16)")
        g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                       help="ranks the model is split over: one worker process per rank (paddle.distributed), "
                            "each holding 1/N of the KV heads and their page pool")
        g.add_argument("--balance-swa-heads", action=argparse.BooleanOptionalAction, default=d.balance_swa_heads,
                       help="permute whole KV-head groups at load time so every rank gets its share of the SWA "
                            "heads (admission is limited by the fullest rank); outputs are unchanged")
        g.add_argument("--head-wise-swa-config", type=str, default=None,
                       help='JSON {"sliding_window": W, "sink_size": S, "swa_kv_heads": [..]}, the heads '
                            "one list (every layer) or one list per layer (then optional head_windows / "
                            "head_sinks of the same shape give each listed head its own window / sink); "
                            "overrides the model's own section of sliding heads; for a named model also the "
                            "name of one of its calibrated configurations (e.g. one-head-per-layer-w512)")
        g.add_argument("--admission-policy", choices=list(ADMISSION_POLICIES), default=d.admission_policy,
                       help="when a waiting request may start: reserve (its lifetime peak pages), on_demand "
                            "(upstream: first chunk, preempt when short) or projected (page curves of the "
                            f"running requests); default: FD_ADMISSION_POLICY, else {DEFAULT_ADMISSION_POLICY}")
        g.add_argument("--speculative-config", type=str, default=None,
                       help='JSON {"method": "ngram", "num_speculative_tokens": K, "max_ngram_size": N, '
                            '"min_ngram_size": M, "disable_by_batch_size": B}: draft up to K tokens a step by '
                            "looking the last N..M tokens up in the request's own prompt and output, verified in "
                            "one step; off in steps with more than B running requests (vLLM's prompt_lookup_max/"
                            "min are accepted for N/M). Greedy and seeded outputs are unchanged")
        g.add_argument("--guided-decoding-backend", choices=list(BACKENDS), default=d.guided_decoding_backend,
                       help="grammar engine of structured outputs (response_format json_schema / json_object, "
                            "guided_json, guided_regex, guided_choice, guided_grammar): auto and llguidance (guidance "
                            "is vLLM's name for it) use llguidance; off rejects constrained requests")
        g.add_argument("--reasoning-parser", choices=["harmony"], default=d.reasoning_parser,
                       help="split chat replies into content and reasoning_content: harmony reads gpt-oss's "
                            "channels (final: content, analysis: reasoning_content, commentary: neither); on by "
                            "itself for a GptOssForCausalLM checkpoint whose tokenizer has the harmony tokens "
                            "(docs/serving.md)")
        g = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
        g.add_argument("--splitwise-role", choices=list(SPLITWISE_ROLES), default=d.splitwise_role,
                       help="prefill: compute prompts and hand their KV to a decode server; decode: read a prompt's "
                            "KV from a prefill server and generate; mixed: one server does both (a plain server "
                            "unless --kv-transfer-config is given). A router (vllm-router --vllm-pd-disaggregation "
                            "--kv-connector nixl) sends each request to both")
        g.add_argument("--kv-transfer-config", type=str, default=None,
                       help='vLLM\'s JSON, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\'; '
                            "kv_connector_extra_config (or the top level) may set side_channel_host / "
                            "side_channel_port (where decode servers reach this one; default 127.0.0.1:5600, "
                            "also VLLM_NIXL_SIDE_CHANNEL_HOST / _PORT), kv_load_failure_policy (recompute | fail), "
                            "abort_timeout_s (480: parked pages nobody read are freed), handshake_timeout_s, "
                            "transfer_timeout_s, engine_id")
        g = parser.add_argument_group("replicas and KV-cache events (docs/scaling.md)")
        g.add_argument("--kv-events-config", type=str, default=None,
                       help='vLLM\'s JSON, e.g. \'{"enable_kv_cache_events":true,"publisher":"zmq",'
                            '"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}\': BlockStored / '
                            "BlockRemoved / AllBlocksCleared batches a KV-aware router (vllm-router --policy "
                            "kv_aware --kv-event-source URL=ENDPOINT) reads; a block is stored while a prefix hit "
                            "ending at it is valid here (every head holds what it needs)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
