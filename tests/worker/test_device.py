"""--device: parsing, resolution, the start-up checks tied to it, and dispatch of the attention op by
tensor place. Runs on the CPU wheel; where Paddle has CUDA and a GPU, the GPU-only checks run too."""

from __future__ import annotations

import importlib
import os

import numpy as np
import paddle
import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai.api_server import build_parser
from fastdeploy.worker.device import cuda_device_count, resolve_device

# The module (the package re-exports its function under the same name).
op_module = importlib.import_module("fastdeploy.model_executor.layers.attention.ops.append_attention")
HAS_GPU = cuda_device_count() > 0


def test_device_flag_parses_upstream_style_and_defaults_to_fd_device(monkeypatch):
    parser = build_parser()
    assert parser.parse_args([]).device is None  # then FD_DEVICE, whose default is auto
    monkeypatch.delenv("FD_DEVICE")
    assert EngineArgs().create_engine_config().device == ("gpu" if HAS_GPU else "cpu")
    monkeypatch.setenv("FD_DEVICE", "cpu")
    assert EngineArgs().create_engine_config().device == "cpu"
    monkeypatch.setenv("FD_DEVICE", "tpu")
    with pytest.raises(ValueError, match="FD_DEVICE"):
        EngineArgs().create_engine_config()
    assert parser.parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["--device", "tpu"])


def test_auto_resolves_to_the_gpu_exactly_when_paddle_sees_one():
    assert resolve_device("auto") == ("gpu" if HAS_GPU else "cpu")
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")


@pytest.mark.skipif(HAS_GPU, reason="a GPU is visible")
def test_device_gpu_without_a_cuda_paddle_fails_at_start_up_naming_both_wheels():
    with pytest.raises(ValueError) as err:
        EngineArgs(device="gpu").create_engine_config()
    assert "paddlepaddle-gpu" in str(err.value) and "`paddlepaddle`" in str(err.value)
    assert "--device cpu" in str(err.value)


def test_a_ranks_gpu_is_the_one_paddle_launch_selected_not_its_global_rank(monkeypatch):
    from fastdeploy.worker.device import paddle_device_name

    # paddle.distributed.launch, second machine of two with --nproc_per_node 2: global rank 3 is
    # local GPU 1, which init_parallel_env binds NCCL to (FLAGS_selected_gpus).
    monkeypatch.setenv("FLAGS_selected_gpus", "1")
    assert paddle_device_name("gpu", 3) == "gpu:1"
    monkeypatch.setenv("FLAGS_selected_gpus", "4,5")  # one process driving several: Paddle takes the first
    assert paddle_device_name("gpu", 0) == "gpu:4"
    monkeypatch.delenv("FLAGS_selected_gpus")
    assert paddle_device_name("gpu", 2) == "gpu:2"  # the engine's in-process / own launcher default
    assert paddle_device_name("cpu", 3) == "cpu"


def test_a_rank_takes_its_collective_backend_from_the_device_not_the_launchers_environment(monkeypatch):
    from fastdeploy.worker.device import collective_backend
    from fastdeploy.worker.worker_process import place_rank

    # The multi-machine recipe exports PADDLE_DISTRI_BACKEND=gloo (the CPU wheel needs it); on a GPU
    # Paddle that would build a CPU-only group that cannot all-reduce the GPU tensors.
    assert collective_backend("gpu") == "nccl" and collective_backend("cpu") == "gloo"
    monkeypatch.setenv("PADDLE_DISTRI_BACKEND", "nccl")
    place_rank("cpu", 0)
    assert os.environ["PADDLE_DISTRI_BACKEND"] == "gloo" and paddle.get_device() == "cpu"
    monkeypatch.setenv("PADDLE_DISTRI_BACKEND", "gloo")
    if not HAS_GPU:  # the CPU wheel refuses gpu:N, after the backend was set
        with pytest.raises(ValueError):
            place_rank("gpu", 0)
        assert os.environ["PADDLE_DISTRI_BACKEND"] == "nccl"


def _gpu_config(model=None, block_size=64):
    """A config resolved for --device gpu (buildable with the CPU wheel: nothing here touches a GPU)."""
    from fastdeploy.config import CacheConfig, FDConfig, ModelConfig, ParallelConfig, SchedulerConfig

    model_config = ModelConfig.create(model, None, None, device="gpu")
    return FDConfig.from_env(model_config=model_config, scheduler_config=SchedulerConfig(),
                             cache_config=CacheConfig(block_size=block_size, cache_dtype=model_config.dtype),
                             parallel_config=ParallelConfig(), device="gpu")


def test_without_a_model_the_gpu_serves_the_head_dim_64_twin_of_the_tiny_preset():
    from fastdeploy.model_executor.models.tiny_preset import TINY_GPU_PRESET_NAME, TINY_PRESET_NAME

    gpu = _gpu_config().model_config
    cpu = EngineArgs(device="cpu").create_engine_config().model_config
    assert (gpu.preset, gpu.served_model_name, gpu.head_dim) == (TINY_GPU_PRESET_NAME, TINY_GPU_PRESET_NAME, 64)
    assert (cpu.preset, cpu.head_dim) == (TINY_PRESET_NAME, 32)  # the CPU default is unchanged
    for field in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_wise_swa", "seed"):
        assert getattr(gpu, field) == getattr(cpu, field)
    assert _gpu_config("tiny-moe-hd64").model_config.head_dim == 64


def test_shapes_the_cuda_op_has_no_kernels_for_are_start_up_errors_on_the_gpu():
    from fastdeploy.worker.device import check_gpu_attention_shapes

    # tiny-moe has head_dim 16: every step would fail inside the CUDA op; say so at start-up.
    with pytest.raises(ValueError, match=r"head_dim 64, 128 or 256, but the model has head_dim 16.*--model tiny-moe-hd64"):
        _gpu_config("tiny-moe")
    with pytest.raises(ValueError, match="--block-size 16 or 64, got 32"):
        _gpu_config(block_size=32)
    with pytest.raises(ValueError, match="at most 8 query heads per KV head"):
        check_gpu_attention_shapes(128, 64, 36, 4)
    check_gpu_attention_shapes(128, 64, 20, 4)  # ERNIE-4.5-21B-A3B
    check_gpu_attention_shapes(256, 64, 4, 1)  # Gemma 3 270M
    assert EngineArgs(device="cpu", model="tiny-moe").create_engine_config().model_config.head_dim == 16


def test_the_gpu_shape_limits_are_the_cuda_launchers():
    import re
    from pathlib import Path

    from fastdeploy.worker import device

    src = Path(__file__).resolve().parents[2] / "custom_ops" / "gpu_ops" / "append_attn"
    launcher = (src / "launcher.cu").read_text()
    for field, allowed in (("head_dim", device.GPU_ATTENTION_HEAD_DIMS),
                           ("block_size", device.GPU_ATTENTION_BLOCK_SIZES)):
        refused = re.search(rf"if \((p\.{field} != \d+(?: && p\.{field} != \d+)*)\)", launcher).group(1)
        assert tuple(int(v) for v in re.findall(r"!= (\d+)", refused)) == allowed
    group = re.search(r"constexpr int kMaxGroup = (\d+);", (src / "append_attn_common.cuh").read_text())
    assert int(group.group(1)) == device.GPU_ATTENTION_MAX_GROUP


def test_cpu_device_keeps_the_float32_cache_default_and_the_config_records_the_device():
    fd = EngineArgs(device="cpu").create_engine_config()
    assert fd.device == "cpu" and fd.cache_config.cache_dtype == "float32"


def test_float16_cache_on_the_cpu_is_a_start_up_error():
    with pytest.raises(ValueError, match="float16 needs --device gpu"):
        EngineArgs(device="cpu", cache_dtype="float16").create_engine_config()


def test_dual_pass_on_the_cpu_is_a_start_up_error(monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_ATTN", "dual_pass")
    with pytest.raises(ValueError, match="FD_HEAD_WISE_ATTN=dual_pass .*--device gpu"):
        EngineArgs(device="cpu").create_engine_config()


def test_unknown_head_wise_attn_value_is_rejected(monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_ATTN", "triple_pass")
    with pytest.raises(ValueError, match="FD_HEAD_WISE_ATTN"):
        EngineArgs(device="cpu").create_engine_config()


@pytest.mark.skipif(not HAS_GPU, reason="needs Paddle with CUDA and a GPU")
def test_dual_pass_needs_the_1d_table_on_the_gpu(monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_ATTN", "dual_pass")
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    with pytest.raises(ValueError, match="FD_HEAD_WISE_KV_CACHE=0"):
        EngineArgs(device="gpu").create_engine_config()
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "0")
    fd = EngineArgs(device="gpu").create_engine_config()
    assert fd.head_wise_attn == "DUAL_PASS" and fd.model_config.dtype == "bfloat16"
    assert fd.cache_config.cache_dtype == "bfloat16"


# -- dispatch by place --------------------------------------------------------------------------------
class _GpuPlace:
    """Stands in for Place(gpu:0): the CPU wheel cannot make a GPU tensor, and dispatch reads only
    the place's kind (a real one is used where a GPU exists, below)."""

    def is_cpu_place(self):
        return False

    def is_gpu_place(self):
        return True

    def __str__(self):
        return "Place(gpu:0)"


def test_cpu_tensors_go_to_the_cpu_op():
    op, on_gpu = op_module.select_op(paddle.CPUPlace())
    assert op is op_module.load_cpu_ops().append_attention_cpu and not on_gpu


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="this Paddle has CUDA")
def test_a_gpu_tensor_meeting_the_cpu_wheel_raises_naming_both_wheels():
    with pytest.raises(ValueError) as err:
        op_module.select_op(_GpuPlace())
    text = str(err.value)
    assert "Place(gpu:0)" in text and "paddlepaddle-gpu" in text and "`paddlepaddle`" in text


def test_dual_pass_on_cpu_tensors_is_refused_by_the_entry():
    with pytest.raises(ValueError, match="CUDA op only"):
        op_module.select_op(paddle.CPUPlace(), dual_pass=True)


def _small_inputs(head_wise: bool, d: int = 8, bs: int = 4):
    rng = np.random.default_rng(0)
    nh, kvh = 4, 2
    qkv = paddle.to_tensor(rng.standard_normal((3, (nh + 2 * kvh) * d)).astype(np.float32))
    cache = [paddle.zeros([4, kvh, bs, d]) for _ in range(2)]
    table = np.array([[[0, 2], [1, 3]]] if head_wise else [[0, 1]], np.int32)
    cos = paddle.to_tensor(np.ones((16, d // 2), np.float32))
    sin = paddle.to_tensor(np.zeros((16, d // 2), np.float32))
    ints = lambda *v: paddle.to_tensor(np.array(v, np.int32))  # noqa: E731
    tensors = dict(qkv=qkv, key_cache=cache[0], value_cache=cache[1], seq_lens_encoder=ints(3),
                   seq_lens_decoder=ints(0), seq_lens_this_time=ints(3), cu_seqlens_q=ints(0, 3),
                   block_tables=paddle.to_tensor(table), rotary_cos=cos, rotary_sin=sin,
                   head_windows=paddle.to_tensor(np.array([[2, 0], [0, 0]], np.int32)),
                   kv_head_slots=ints(0, 1), key_cache_scales=op_module.no_scales(qkv.place),
                   value_cache_scales=op_module.no_scales(qkv.place), attention_sinks=op_module.no_sinks(qkv.place))
    attrs = dict(num_heads=nh, kv_num_heads=kvh, head_dim=d)
    # one 3-token prompt; KV head 0 slides (window 2)
    return tensors, attrs


def test_op_arguments_are_the_ops_order_and_both_ops_share_them():
    tensors, attrs = _small_inputs(head_wise=True)
    ordered, values = op_module.op_arguments(tensors, **attrs)
    assert [id(t) for t in ordered] == [id(tensors[n]) for n in op_module.TENSOR_ARGS]
    assert values == (4, 2, 8, False, 0.0, False)  # the ATTR_ARGS order
    # The CPU op takes all attributes but dual_pass: calling it through the entry gives what calling
    # it directly with the shared arguments gives.
    direct = op_module.load_cpu_ops().append_attention_cpu(*ordered, *values[:-1])[0].numpy()
    tensors2, _ = _small_inputs(head_wise=True)
    via_entry = op_module.append_attention(*[tensors2[n] for n in op_module.TENSOR_ARGS], **attrs).numpy()
    np.testing.assert_array_equal(direct, via_entry)


def test_op_arguments_name_a_missing_tensor_and_refuse_dual_pass_on_a_head_wise_table():
    tensors, attrs = _small_inputs(head_wise=True)
    with pytest.raises(ValueError, match="block_tables"):
        op_module.op_arguments({**tensors, "block_tables": None}, **attrs)
    with pytest.raises(ValueError, match="1-D block table"):
        op_module.op_arguments(tensors, **attrs, visit_all_pages=True, dual_pass=True)
    flat, _ = _small_inputs(head_wise=False)
    assert op_module.op_arguments(flat, **attrs, visit_all_pages=True, dual_pass=True)[1][-1] is True


def test_device_errors_are_decoded_like_the_cuda_launcher_describes_them():
    op_module.check_device_errors(np.zeros(4, np.int32))
    with pytest.raises(ValueError, match=r"-1 but the step needs it \(request 2, kv head 1, block index 5\)"):
        op_module.check_device_errors(np.array([1, 2, 1, 5], np.int32))


@pytest.mark.skipif(not HAS_GPU, reason="needs Paddle with CUDA and a GPU")
def test_gpu_tensors_go_to_the_cuda_op_and_match_the_cpu_op():
    tensors, attrs = _small_inputs(head_wise=True, d=64, bs=16)  # shapes the CUDA kernels support
    # The reference sees the GPU's bf16 inputs (rounded, then float32): only the math may differ.
    tensors["qkv"] = tensors["qkv"].astype("bfloat16").astype("float32")
    cpu = op_module.append_attention(*[tensors[n] for n in op_module.TENSOR_ARGS], **attrs).numpy()
    gpu_tensors, _ = _small_inputs(head_wise=True, d=64, bs=16)
    moved = {k: (v.cuda().astype("bfloat16") if k in ("qkv", "key_cache", "value_cache") else v.cuda())
             for k, v in gpu_tensors.items()}
    attrs_gpu = dict(attrs)
    out = op_module.append_attention(*[moved[n] for n in op_module.TENSOR_ARGS], **attrs_gpu)
    assert out.place.is_gpu_place()
    np.testing.assert_allclose(out.astype("float32").numpy(), cpu, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not HAS_GPU, reason="needs Paddle with CUDA and a GPU")
def test_engine_on_the_gpu_runs_attention_on_the_cuda_op_and_follows_the_cpu_path(monkeypatch):
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.model_executor.models.tiny_preset import TINY_GPU_PRESET_NAME

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    prompts = [[3 + (i * 37 + n * 11) % 250 for i in range(n)] for n in (5, 130, 300)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for device in ("gpu", "cpu"):
        llm = LLM(model=TINY_GPU_PRESET_NAME, device=device, block_size=16, max_model_len=1024, cache_dtype="bfloat16",
                  dtype="bfloat16" if device == "gpu" else "float32")
        runner = llm.engine.runner.ranks
        assert runner.attn_backend.key_caches[0].place.is_gpu_place() == (device == "gpu")
        outs[device] = [o.outputs.token_ids[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["gpu"] == outs["cpu"]  # the first token: same prefix, bf16 vs float32 compute


def test_jit_build_and_setup_ops_compile_the_same_cuda_sources_targets_and_include_dirs():
    import sys as _sys

    from fastdeploy.model_executor.layers.attention.ops import gpu_op_loader

    _sys.path.insert(0, str(gpu_op_loader._REPO_ROOT / "custom_ops"))
    try:
        import setup_ops
    finally:
        _sys.path.pop(0)
    jit = [p.name for p in gpu_op_loader.gpu_sources()]
    assert jit[0] == "append_attention.cu" and "harness.cu" not in jit
    assert sorted(jit[1:]) == sorted(p.name for p in setup_ops.KERNEL_SOURCES)
    assert gpu_op_loader.NVCC_FLAGS == setup_ops.NVCC_FLAGS
    # The wrapper includes append_attention_checks.h from cpu_ops/: both builds must see it.
    assert gpu_op_loader.include_dirs() == [d.resolve() for d in setup_ops.INCLUDE_DIRS]
    assert any((d / "append_attention_checks.h").is_file() for d in gpu_op_loader.include_dirs())
    assert all(p.is_file() for p in gpu_op_loader.gpu_sources())


@pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="this Paddle has CUDA")
def test_loading_the_cuda_op_on_the_cpu_wheel_names_both_wheels():
    from fastdeploy.model_executor.layers.attention.ops.gpu_op_loader import GpuOpUnavailable, load_gpu_ops

    with pytest.raises(GpuOpUnavailable, match="paddlepaddle-gpu.*`paddlepaddle`"):
        load_gpu_ops()


@pytest.mark.skipif(not HAS_GPU, reason="needs Paddle with CUDA and a GPU")
def test_dual_pass_on_the_1d_table_gives_the_single_pass_tokens(monkeypatch):
    from fastdeploy import LLM, SamplingParams

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "0")
    prompts = [[3 + (i * 37 + n * 11) % 250 for i in range(n)] for n in (5, 300)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for mode in ("single_pass", "dual_pass"):
        monkeypatch.setenv("FD_HEAD_WISE_ATTN", mode)
        llm = LLM(device="gpu", block_size=16, max_model_len=1024)
        assert llm.engine.runner.ranks.attn_backend.dual_pass == (mode == "dual_pass")
        tokens[mode] = [o.outputs.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["dual_pass"] == tokens["single_pass"]  # same math, two kernel passes
