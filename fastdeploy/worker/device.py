"""The one place that picks the device the model runs on (`--device auto|gpu|cpu`).

auto = the GPU where Paddle was built with CUDA and a GPU is visible, else the CPU. Everything
device-specific downstream keys off the resolved name: the model runner sets Paddle's default
device to it (weights, caches, step buffers follow), and the attention entry dispatches by the
place of its tensors. Paddle is imported only to answer "auto" or to check "gpu", so a
Paddle-free process (the GPU check's scheduler loop) can still build a config with "cpu".
"""

from __future__ import annotations

import os

DEVICE_CHOICES = ("auto", "gpu", "cpu")
GPU_WHEEL_HINT = ("install the GPU wheel `paddlepaddle-gpu` (the CPU wheel `paddlepaddle` has no CUDA), "
                  "or start with --device cpu")
# The CUDA AppendAttention op computes in 16-bit floats; qkv and the caches share one dtype.
GPU_ATTENTION_DTYPES = ("bfloat16", "float16")
# The shapes its kernels exist for (validate() in custom_ops/gpu_ops/append_attn/launcher.cu, kMaxGroup
# in append_attn_common.cuh); anything else fails every step, so it is refused at start-up.
GPU_ATTENTION_HEAD_DIMS = (64, 128, 256)  # 256: Gemma 3
GPU_ATTENTION_BLOCK_SIZES = (16, 64)
GPU_ATTENTION_MAX_GROUP = 8  # query heads per KV head


def cuda_device_count() -> int:
    """GPUs Paddle can use: 0 without Paddle, with the CPU wheel, or with no visible device."""
    try:
        import paddle
    except ImportError:
        return 0
    if not paddle.is_compiled_with_cuda():
        return 0
    try:
        return int(paddle.device.cuda.device_count())
    except (RuntimeError, ValueError, OSError):
        return 0


def resolve_device(requested: str) -> str:
    """'gpu' or 'cpu' for `--device`; raises ValueError naming the flag when it cannot be honoured."""
    requested = (requested or "auto").lower()
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    available = cuda_device_count() > 0
    if requested == "gpu" and not available:
        raise ValueError(f"--device gpu: {gpu_unavailable_reason()}; {GPU_WHEEL_HINT}")
    return "gpu" if available else "cpu"


def gpu_unavailable_reason() -> str:
    try:
        import paddle
    except ImportError:
        return "Paddle is not installed"
    if not paddle.is_compiled_with_cuda():
        return f"this Paddle ({paddle.__version__}) is the CPU build"
    return "Paddle has CUDA but sees no GPU (check CUDA_VISIBLE_DEVICES and the driver)"


def local_gpu_index(rank: int) -> int:
    """This process's GPU on its own machine. `paddle.distributed.launch` (and the engine's own
    launcher, engine/worker_group.py) name it in FLAGS_selected_gpus, which init_parallel_env binds
    the NCCL communicator to; the global rank is not it on a second machine (ranks 2, 3 of
    `--nproc_per_node 2` drive GPUs 0, 1) nor under `--gpus 4,5`. Without the flag: the rank."""
    selected = os.environ.get("FLAGS_selected_gpus", "").split(",")[0].strip()
    return int(selected) if selected.isdigit() else rank


def paddle_device_name(device: str, rank: int = 0) -> str:
    """Paddle's name for one rank's device: 'gpu:N' (N = local_gpu_index, one GPU per rank) or 'cpu'."""
    return f"gpu:{local_gpu_index(rank)}" if device == "gpu" else "cpu"


def collective_backend(device: str) -> str:
    """paddle.distributed's backend for ranks on `device`: NCCL on the GPU, gloo on the CPU. The
    worker sets it from the device the engine resolved, whatever the launcher's environment says:
    under PADDLE_DISTRI_BACKEND=gloo (the CPU recipe, which the CPU wheel needs) a GPU Paddle builds
    a CPU-only group whose all-reduce cannot take the GPU tensors."""
    return "nccl" if device == "gpu" else "gloo"


def default_cache_dtype(device: str, compute_dtype: str, attention_backend: str = "APPEND_ATTN") -> str:
    """`--cache-dtype` left unset: float32 on the CPU (its op's fastest storage); on the GPU the
    compute dtype, which the CUDA op requires of its caches; bfloat16 for the CUDA kernels executed on
    the CPU (FD_ATTENTION_BACKEND=CUDA_ON_CPU), the pages a GPU would hold."""
    if attention_backend == "CUDA_ON_CPU":
        return "bfloat16"
    return compute_dtype if device == "gpu" else "float32"


def check_gpu_attention_dtypes(compute_dtype: str, cache_dtype: str) -> None:
    """Start-up check for the paged backend on the GPU (the CUDA op would refuse every step)."""
    if compute_dtype not in GPU_ATTENTION_DTYPES:
        raise ValueError(f"--device gpu: the CUDA attention op computes in {' or '.join(GPU_ATTENTION_DTYPES)}, "
                         f"but --dtype resolved to {compute_dtype}; pass --dtype bfloat16")
    if cache_dtype != compute_dtype:
        raise ValueError(f"--device gpu: the CUDA attention op needs --cache-dtype equal to the compute dtype "
                         f"({compute_dtype}), got {cache_dtype}")


def _one_of(values) -> str:
    """'64, 128 or 256' for a start-up message."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def check_gpu_attention_shapes(head_dim: int, block_size: int, num_heads: int, kv_heads: int,
                               preset: str | None = None) -> None:
    """Start-up check for the paged backend on the GPU: the CUDA op's kernels exist for these shapes
    only, and without this check the first step would fail inside the op."""
    from fastdeploy.model_executor.models.tiny_preset import GPU_TWIN

    if head_dim not in GPU_ATTENTION_HEAD_DIMS:
        twin = f"; use --model {GPU_TWIN[preset]} (this preset with head_dim 64)" if preset in GPU_TWIN else ""
        raise ValueError(f"--device gpu: the CUDA attention op supports head_dim {_one_of(GPU_ATTENTION_HEAD_DIMS)}, "
                         f"but the model has head_dim {head_dim}"
                         f"{twin}; or run it with --device cpu or FD_ATTENTION_BACKEND=NATIVE_ATTN")
    if block_size not in GPU_ATTENTION_BLOCK_SIZES:
        raise ValueError(f"--device gpu: the CUDA attention op supports --block-size "
                         f"{_one_of(GPU_ATTENTION_BLOCK_SIZES)}, got {block_size}")
    if num_heads // kv_heads > GPU_ATTENTION_MAX_GROUP:
        raise ValueError(f"--device gpu: the CUDA attention op supports at most {GPU_ATTENTION_MAX_GROUP} query "
                         f"heads per KV head, the model has {num_heads} / {kv_heads} = {num_heads // kv_heads}; "
                         f"run it with --device cpu or FD_ATTENTION_BACKEND=NATIVE_ATTN")
