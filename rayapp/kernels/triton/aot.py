"""Ahead-of-time compilation of the Triton retrieval kernels for a target, without its device.

``triton.compile`` lowers a kernel through Triton's own toolchain (ptxas ships in the triton wheel;
the AMD backend links with the wheel's LLVM), so CI can prove the kernels compile for CUDA and ROCm
on a machine that has neither. :func:`kernel_sources` is also what bench/triton_ascend_lowering.py
lowers with triton-ascend, whose ``ASTSource`` takes the same three positional arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

import rayapp.kernels.triton.kernels as kernels
from rayapp.kernels.triton.launch import as_mode, decode_meta, dot_precision, interpreting, merge_meta, score_meta

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32"}


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel compiled for one target: its device binary (``binary_format``: cubin, hsaco...)."""

    name: str
    target: GPUTarget
    binary_format: str
    binary: bytes
    seconds: float
    compiled: object  # triton's CompiledKernel: asm stages and metadata


def _source(kernel, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> ASTSource:
    """``kernel`` specialized: pointers of the element types given, ``floats`` fp32, other ints i32."""
    jit = as_mode(kernel, False)
    signature = {}
    for name in jit.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return ASTSource(jit, signature, constexprs)


def kernel_sources(
    target: GPUTarget,
    *,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    group: int = 8,
    page_size: int = 16,
    kind: str = "multimean",
    rows: int = 4,
    splits: int = 16,
) -> list[ASTSource]:
    """Block scoring, split decode and its merge, specialized as a launch with such tensors would be:
    cache and query ``dtype``, ``head_dim``, query heads per KV head ``group``, ``page_size``, the
    scoring ``kind`` with ``rows`` representative rows (multimean), and ``splits`` decode splits."""
    elem = TRITON_TYPES[dtype]
    rows = {"mean": 1, "minmax": 2}.get(kind, rows)
    decode_pointers = {name: elem for name in ("q_ptr", "k_ptr", "v_ptr")}
    decode_pointers |= {"table_ptr": "i32", "lens_ptr": "i32", "max_ptr": "fp32", "sum_ptr": "fp32", "acc_ptr": "fp32"}
    return [
        _source(
            kernels.score_blocks_kernel,
            {"q_ptr": elem, "reps_ptr": "fp32", "out_ptr": "fp32"},
            (),
            score_meta(kind, rows, group, head_dim, num_blocks=256),
        ),
        _source(
            kernels.decode_split_kernel,
            decode_pointers,
            ("scale_log2",),
            decode_meta(group, head_dim, page_size, dot_precision(dtype, target)),
        ),
        _source(
            kernels.merge_splits_kernel,
            {"max_ptr": "fp32", "sum_ptr": "fp32", "acc_ptr": "fp32", "out_ptr": elem},
            (),
            merge_meta(head_dim, splits),
        ),
    ]


def compile_for(target: GPUTarget, **specialization) -> list[CompiledKernel]:
    """Compile block scoring, split decode and its merge for ``target``, e.g.
    ``GPUTarget("cuda", 90, 32)``, ``GPUTarget("cuda", 80, 32)`` or ``GPUTarget("hip", "gfx942", 64)``.

    ``specialization``: the keywords of :func:`kernel_sources` (dtype, head_dim, group, page_size,
    kind, rows, splits). Each compile is fresh (not Triton's cache), so ``seconds`` is its cost.
    """
    if interpreting():
        raise RuntimeError(
            "compile_for needs a process without TRITON_INTERPRET=1: under it Triton's own library is interpreted"
        )
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4})
    compiled_kernels = []
    for source in kernel_sources(target, **specialization):
        start = time.perf_counter()
        with triton.knobs.compilation.scope():
            triton.knobs.compilation.always_compile = True
            compiled = triton.compile(source, target=target, options=options.__dict__)
        seconds = time.perf_counter() - start
        binary = compiled.asm[backend.binary_ext]
        compiled_kernels.append(CompiledKernel(source.name, target, backend.binary_ext, binary, seconds, compiled))
    return compiled_kernels
