"""CUDA_ON_CPU: the paged backend with the CUDA op's own kernels, executed on the CPU.

The cache, tables, slot maps and per-layer arguments are APPEND_ATTN's (the same engine, scheduler
and cache manager); the per-layer call goes to the C ABI of the CUDA kernels (append_attn_api.cuh)
compiled for the CUDA-on-CPU executor (ops/cuda_on_cpu_loader.py), on host buffers. The pages are
what a GPU holds: bfloat16, or int8 / e4m3 codes (int4: two codes per uint8; k8v4: int8 keys, int4
values) with float32 scales;
q, k, v enter as bfloat16 (the GPU's compute dtype) and the output returns in the model's dtype. Each launch runs its blocks one
after another under one thread order (CUDA_ON_CPU_ORDERS, default forward): slow, for checking the
kernels under real models, not for serving.
"""

from __future__ import annotations

import ctypes

import numpy as np
import paddle

from fastdeploy import envs
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.append_attn_backend import AppendAttentionBackend
from fastdeploy.model_executor.layers.attention.ops.append_attention import check_device_errors
from fastdeploy.model_executor.layers.attention.ops.cuda_on_cpu_loader import AppendAttnBuffers, \
    AppendAttnParams, configure_executor, load_cuda_on_cpu

_BF16 = 0  # AppendAttnDtype
# AppendAttnCacheQuant of the (key, value) lane dtypes: alike, or int8 keys with int4 values (k8v4).
_CACHE_QUANT = {(paddle.bfloat16, paddle.bfloat16): 0, (paddle.int8, paddle.int8): 1,
                (paddle.float8_e4m3fn, paddle.float8_e4m3fn): 2, (paddle.uint8, paddle.uint8): 3,
                (paddle.int8, paddle.uint8): 4}


def _ptr(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


class CudaOnCpuAttentionBackend(AppendAttentionBackend):
    def __init__(self, fd_config, rotary: list, tp_rank: int = 0, attention_sinks=None):
        super().__init__(fd_config, rotary, tp_rank, attention_sinks)
        self.lib = load_cuda_on_cpu()
        # One order unless asked (CUDA_ON_CPU_ORDERS): the race check (several orders) snapshots only the
        # harness's buffers.
        configure_executor(self.lib, fd_config.env if fd_config.env is not None else envs.snapshot())
        self.quantized = fd_config.cache_config.quantized
        # The kernels read float32 rotary tables: converted once (layers share one pair), not per call.
        float32 = {}
        self.rotary32 = [tuple(float32.setdefault(id(t), t.astype("float32").contiguous()) for t in pair)
                         for pair in rotary]
        self._sinks = [None if s.shape[0] == 0 else s.astype("float32").contiguous() for s in self.layer_sinks]
        self._workspace = np.zeros(0, np.uint8)
        self._error_info = np.zeros(4, np.int32)
        self._step_meta, self._step_ints = None, None  # the step's int32 lengths and table, for every layer

    def _bind_cpu_op(self):
        return None  # forward calls the CUDA kernels' C ABI instead

    def forward(self, layer_id: int, qkv: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        table = self.kernel_table(meta.block_tables)
        # int32 already (AppendAttentionBackend): head_windows [2, kv_heads], each head's window and sink
        head_windows, slots = self.layer_args[layer_id]
        cos32, sin32 = self.rotary32[layer_id]
        key_cache, value_cache = self.key_caches[layer_id], self.value_caches[layer_id]
        q16 = qkv.astype(paddle.bfloat16).contiguous()
        token_num = int(q16.shape[0])
        out = paddle.empty([token_num, self.num_heads * self.head_dim], dtype=paddle.bfloat16)
        if meta is not self._step_meta:  # the first layer of a step
            self._step_meta = meta
            self._step_ints = [t.astype("int32").contiguous() for t in (
                meta.seq_lens_encoder, meta.seq_lens_decoder, meta.seq_lens_this_time, meta.cu_seqlens_q, table)]
        enc, dec, this_time, cu, table32 = self._step_ints
        params = AppendAttnParams(
            dtype=_BF16, token_num=token_num, bsz=int(this_time.shape[0]), num_heads=self.num_heads,
            kv_num_heads=self.kv_num_heads, head_dim=self.head_dim, block_size=int(key_cache.shape[2]),
            num_blocks=int(key_cache.shape[0]), max_blocks_per_seq=int(table32.shape[-1]),
            head_wise_table=int(len(table32.shape) == 3), max_position=int(cos32.shape[0]),
            visit_all_pages=0, dual_pass=0, kv_slots=int(key_cache.shape[1]),
            cache_quant=_CACHE_QUANT[key_cache.dtype, value_cache.dtype], softcap=self.softcap)
        scales = (self.key_scales[layer_id], self.value_scales[layer_id]) if self.quantized else (None, None)
        buffers = AppendAttnBuffers(
            qkv=_ptr(q16), key_cache=_ptr(key_cache), value_cache=_ptr(value_cache), seq_lens_encoder=_ptr(enc),
            seq_lens_decoder=_ptr(dec), seq_lens_this_time=_ptr(this_time), cu_seqlens_q=_ptr(cu),
            block_tables=_ptr(table32), rotary_cos=_ptr(cos32), rotary_sin=_ptr(sin32), head_windows=_ptr(head_windows),
            out=_ptr(out), kv_head_slots=_ptr(slots), key_cache_scales=_ptr(scales[0]),
            value_cache_scales=_ptr(scales[1]), attention_sinks=_ptr(self._sinks[layer_id]))
        need = self.lib.append_attention_workspace_bytes(ctypes.byref(params))
        if need == 0:
            raise ValueError(f"CUDA_ON_CPU: {self.lib.append_attention_last_error().decode()}")
        if self._workspace.nbytes < need:
            self._workspace = np.zeros(need, np.uint8)
        status = self.lib.append_attention_launch(
            ctypes.byref(params), ctypes.byref(buffers), self._workspace.ctypes.data_as(ctypes.c_void_p),
            ctypes.c_size_t(self._workspace.nbytes), self._error_info.ctypes.data_as(ctypes.c_void_p), None)
        if status != 0:
            raise ValueError(f"CUDA_ON_CPU: append_attention_launch: {self.lib.append_attention_last_error().decode()}")
        check_device_errors(self._error_info)  # launches are synchronous: the error is there now
        return out.astype(qkv.dtype)
