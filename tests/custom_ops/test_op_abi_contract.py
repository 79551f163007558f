"""The argument contracts of the GPU-only code, checked on the CPU by reading the sources.

Nothing here needs a GPU, so a drift that would otherwise surface only on one is caught in CI:
- the ctypes structs and prototypes (gpu_harness: the harness, the kernel benchmark and
  benchmarks/gpu_check.py) against the C header append_attn_api.cuh and harness.cu;
- every Paddle op registration (PD_BUILD_OP in the CPU .cc and the CUDA .cu) against its kernel
  function, InferShape and InferDtype (Paddle maps them by position at run time: an arity slip
  compiles and fails on the first call), and against the Python entry's argument lists.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gpu_harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
API_HEADER = ROOT / "custom_ops" / "gpu_ops" / "append_attn" / "append_attn_api.cuh"
HARNESS_SOURCE = ROOT / "custom_ops" / "gpu_ops" / "append_attn" / "harness.cu"
OP_SOURCES = (ROOT / "custom_ops" / "cpu_ops" / "append_attention.cc", ROOT / "custom_ops" / "gpu_ops" / "append_attention.cu")

op_module = importlib.import_module("fastdeploy.model_executor.layers.attention.ops.append_attention")


def _code(path: Path) -> str:
    """The source without comments."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


# -- C ABI ----------------------------------------------------------------------------------------
def _c_type(decl: str):
    """ctypes type of one C declaration's type (`const AppendAttnParams*`, `size_t`, `cudaStream_t`)."""
    t = " ".join(decl.replace("const ", "").replace("*", " * ").split())
    named = {"AppendAttnParams *": ctypes.POINTER(gpu_harness._Params),
             "AppendAttnBuffers *": ctypes.POINTER(gpu_harness._Buffers),
             "float *": ctypes.POINTER(ctypes.c_float), "int *": ctypes.c_void_p, "char *": ctypes.c_char_p,
             "void *": ctypes.c_void_p, "cudaStream_t": ctypes.c_void_p,  # an opaque pointer
             "int": ctypes.c_int, "float": ctypes.c_float, "size_t": ctypes.c_size_t, "double": ctypes.c_double}
    return named[t]


def _abi_class(ctype):
    """What the ABI sees: any pointer is one machine word; scalars by type (c_int is not c_size_t)."""
    pointer = ctype in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(ctype, ctypes._Pointer)
    return "pointer" if pointer else ctype


def _same_ctype(a, b) -> bool:
    return _abi_class(a) == _abi_class(b)


def _struct_fields(text: str, name: str) -> list:
    body = re.search(rf"typedef struct {name} \{{(.*?)\}} {name};", text, re.S).group(1)
    return [(field, _c_type(ctype)) for ctype, field in re.findall(r"([\w\s\*]+?)\s*(\w+);", body)]


def _prototype(text: str, name: str) -> tuple:
    """(return ctype or None for void, [param ctypes]) of the C function `name`."""
    m = re.search(rf"([\w\s\*]+?)\s*\b{name}\s*\(([^)]*)\)", text)
    ret, params = m.group(1).strip(), m.group(2).strip()
    args = [] if params in ("", "void") else [_c_type(re.sub(r"\s*\b\w+$", "", p.strip())) for p in params.split(",")]
    return _c_type(ret), args


@pytest.mark.parametrize("struct, name", [(gpu_harness._Params, "AppendAttnParams"),
                                          (gpu_harness._Buffers, "AppendAttnBuffers")])
def test_ctypes_structs_have_the_headers_fields_in_its_order_and_types(struct, name):
    header = _struct_fields(_code(API_HEADER), name)
    mine = [(field, ctype) for field, ctype in struct._fields_]
    assert [f for f, _ in mine] == [f for f, _ in header]
    for (field, ours), (_, theirs) in zip(mine, header):
        assert _same_ctype(ours, theirs), field


@pytest.mark.parametrize("abi, source", [(gpu_harness.C_ABI, API_HEADER), (gpu_harness.HARNESS_ABI, HARNESS_SOURCE)])
def test_ctypes_prototypes_match_the_c_declarations(abi, source):
    text = _code(source)
    for name, (restype, argtypes) in abi.items():
        c_ret, c_args = _prototype(text, name)
        assert _same_ctype(restype, c_ret), name
        assert len(argtypes) == len(c_args), name
        for i, (ours, theirs) in enumerate(zip(argtypes, c_args)):
            assert _same_ctype(ours, theirs), f"{name} argument {i}: {ours} vs the C {theirs}"


def test_the_header_parser_sees_a_swapped_field():
    text = _code(API_HEADER).replace("int token_num;", "int TMP;").replace("int bsz;", "int token_num;") \
        .replace("int TMP;", "int bsz;")
    assert [f for f, _ in _struct_fields(text, "AppendAttnParams")][1:3] == ["bsz", "token_num"]


@pytest.mark.skipif(gpu_harness.find_nvcc() is None, reason="nvcc not found")
def test_the_bound_prototypes_call_the_built_launcher_without_a_device():
    """Through the declared argtypes into the real library: the workspace size depends on every
    Params field being where the C side reads it (a shifted field is an unsupported shape: 0)."""
    lib = gpu_harness.bind(ctypes.CDLL(str(gpu_harness.cached_build(jobs=2))), gpu_harness.C_ABI)
    params = dict(dtype=gpu_harness.BF16, token_num=8, bsz=2, num_heads=20, kv_num_heads=4, head_dim=128,
                  block_size=64, num_blocks=16, max_blocks_per_seq=8, head_wise_table=1, max_position=512,
                  visit_all_pages=0, dual_pass=0, kv_slots=0, cache_quant=gpu_harness.CACHE_FLOAT)
    single = lib.append_attention_workspace_bytes(ctypes.byref(gpu_harness._Params(**params)))
    dual = lib.append_attention_workspace_bytes(ctypes.byref(gpu_harness._Params(**{**params, "dual_pass": 1})))
    assert 0 < single < dual  # dual_pass adds the stitch buffer and its window
    # cache_quant (the last field) is read where it is: an unknown page format is an unsupported shape
    assert lib.append_attention_workspace_bytes(ctypes.byref(gpu_harness._Params(**{**params, "cache_quant": 9}))) == 0
    assert lib.append_attention_workspace_bytes(ctypes.byref(gpu_harness._Params(**{**params, "head_dim": 96}))) == 0
    info = (ctypes.c_int * 4)()
    status = lib.append_attention_launch(ctypes.byref(gpu_harness._Params(**params)),
                                         ctypes.byref(gpu_harness._Buffers()), None, 0, info, None)
    assert status == 1 and b"workspace" in lib.append_attention_last_error()


# -- Paddle op registrations ----------------------------------------------------------------------
def _quoted(text: str) -> list:
    return re.findall(r'"([^"]*)"', text)


def _registrations(path: Path) -> dict:
    ops = {}
    for name, body in re.findall(r"PD_BUILD_OP\((\w+)\)(.*?);", _code(path), re.S):
        part = lambda key: re.search(rf"\.{key}\((.*?)\)\s*(?=\.|$)", body, re.S)  # noqa: E731
        inplace = part("SetInplaceMap")
        pairs = _quoted(inplace.group(1)) if inplace else []
        ops[name] = dict(
            inputs=_quoted(part("Inputs").group(1)), outputs=_quoted(part("Outputs").group(1)),
            inplace=dict(zip(pairs[::2], pairs[1::2])),
            attrs=[tuple(a.replace(" ", "").split(":")) for a in _quoted(part("Attrs").group(1))],
            kernel=re.search(r"PD_KERNEL\((\w+)\)", body).group(1),
            infer_shape=re.search(r"PD_INFER_SHAPE\((\w+)\)", body).group(1),
            infer_dtype=re.search(r"PD_INFER_DTYPE\((\w+)\)", body).group(1))
    return ops


def _param_type(param: str) -> str:
    """`const paddle::Tensor& qkv` -> `const paddle::Tensor&`; `int num_heads` -> `int`; `bool` -> `bool`."""
    tokens = param.split()
    if len(tokens) > 1 and re.fullmatch(r"[A-Za-z_]\w*", tokens[-1]) and tokens[-2] != "const" \
            and tokens[-1] not in ("int", "bool", "float", "double", "int64_t"):
        tokens = tokens[:-1]
    return " ".join(tokens)


def _function(code: str, name: str) -> tuple:
    """([parameter types], [elements of the first `return {...}`]) of the C++ function `name`."""
    m = re.search(rf"\b{name}\s*\(([^)]*)\)\s*\{{", code)
    types = [_param_type(p) for p in m.group(1).split(",")]
    ret = re.search(r"return \{(.*?)\};", code[m.end():], re.S).group(1).strip()
    depth, parts, cur = 0, [], ""
    for ch in ret:
        depth += ch in "{(" and 1 or (ch in "})" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return types, [p.strip() for p in parts if p.strip()]


def _all_ops() -> dict:
    ops = {}
    for path in OP_SOURCES:
        code = _code(path)
        for name, op in _registrations(path).items():
            ops[name] = (op, code)
    return ops


OPS = _all_ops()


def test_every_registered_op_is_parsed():
    assert set(OPS) == {"append_attention_cpu", "append_attention_validate", "append_attention_gpu"}


@pytest.mark.parametrize("name", sorted(OPS))
def test_kernel_infer_shape_and_infer_dtype_match_the_registered_inputs_outputs_and_attrs(name):
    op, code = OPS[name]
    n_in, attr_types = len(op["inputs"]), [t for _, t in op["attrs"]]
    assert set(op["inplace"]) <= set(op["inputs"]) and set(op["inplace"].values()) <= set(op["outputs"])
    fresh_outputs = len(op["outputs"]) - len(op["inplace"])  # Paddle fills the in-place ones itself

    kernel, returned = _function(code, op["kernel"])
    tensors = [t for t in kernel if "paddle::Tensor" in t]
    assert len(tensors) == n_in and kernel[n_in:] == attr_types, kernel
    for input_name, t in zip(op["inputs"], tensors):
        if input_name in op["inplace"] and name == "append_attention_gpu":
            assert not t.startswith("const"), f"{input_name} is written in place: paddle::Tensor&"
    assert len(returned) == fresh_outputs

    shape, shapes = _function(code, op["infer_shape"])
    assert shape[:n_in] == ["const std::vector<int64_t>&"] * n_in and shape[n_in:] == attr_types
    assert len(shapes) == fresh_outputs

    dtype, dtypes = _function(code, op["infer_dtype"])
    assert dtype == ["const paddle::DataType&"] * n_in and len(dtypes) == fresh_outputs


def test_the_python_entry_passes_each_op_its_registered_inputs_and_attrs_in_order():
    cpu, gpu, validate = (OPS[n][0] for n in ("append_attention_cpu", "append_attention_gpu",
                                              "append_attention_validate"))
    assert tuple(cpu["inputs"]) == op_module.TENSOR_ARGS == tuple(validate["inputs"])
    assert tuple(gpu["inputs"]) == op_module.TENSOR_ARGS + ("error_info",)  # append_attention: error_info last
    assert tuple(a for a, _ in gpu["attrs"]) == op_module.ATTR_ARGS
    assert tuple(a for a, _ in cpu["attrs"]) == op_module.ATTR_ARGS[:-1]  # no dual_pass on the CPU
    assert [a for a, _ in validate["attrs"]] == [*op_module.ATTR_ARGS[:-1], "gpu_rules", "check_place"]
