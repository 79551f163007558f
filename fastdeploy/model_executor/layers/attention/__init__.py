"""Attention backends; `get_attention_backend` picks one from FD_ATTENTION_BACKEND (in the config)."""


def get_attention_backend(fd_config, rotary: list, tp_rank: int = 0, attention_sinks=None):
    """The backend of one tensor-parallel rank: its KV heads, its cache. `rotary`: (cos, sin) per layer;
    `attention_sinks`: per layer the rank's query heads' learned sink logits, or None (CausalLM.attention_sinks)."""
    if fd_config.attention_backend == "NATIVE_ATTN":
        from fastdeploy.model_executor.layers.attention.native_attn_backend import NativeAttentionBackend

        return NativeAttentionBackend(fd_config, rotary, tp_rank, attention_sinks)
    if fd_config.attention_backend == "CUDA_ON_CPU":
        from fastdeploy.model_executor.layers.attention.cuda_on_cpu_backend import CudaOnCpuAttentionBackend

        return CudaOnCpuAttentionBackend(fd_config, rotary, tp_rank, attention_sinks)
    from fastdeploy.model_executor.layers.attention.append_attn_backend import AppendAttentionBackend

    return AppendAttentionBackend(fd_config, rotary, tp_rank, attention_sinks)
