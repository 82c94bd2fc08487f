"""Sparse retrieval kernels in Triton, for GPUs (CUDA, ROCm) and Ascend NPUs (triton-ascend).

The same contracts as :mod:`rayapp.kernels.retrieval`, whose PyTorch and C++ kernels stay the
CPU path. Top-k stays :func:`torch.topk` (a ``tl.topk`` kernel compiles for minutes).

- :func:`score_blocks`: block scores for the ``mean``, ``minmax`` and ``multimean`` representations;
- :func:`select_topk_blocks`: the PyTorch top-k of :mod:`rayapp.kernels.retrieval`, re-exported;
- :func:`sparse_decode_attention`: decode attention over per-KV-head page lists, K and V read
  through their own strides (any of vLLM's cache layouts as a view), split over the pages;
- :func:`compile_for`: ahead-of-time compilation for a ``GPUTarget``, no device needed
  (:func:`kernel_sources`: the specialized kernels it compiles).

CPU tensors run only in Triton's interpreter: ``TRITON_INTERPRET=1`` set before triton is imported.
"""

from rayapp.kernels.retrieval import select_topk_blocks
from rayapp.kernels.triton.aot import CompiledKernel, compile_for, kernel_sources
from rayapp.kernels.triton.launch import interpreting, score_blocks, sparse_decode_attention

__all__ = [
    "CompiledKernel",
    "compile_for",
    "interpreting",
    "kernel_sources",
    "score_blocks",
    "select_topk_blocks",
    "sparse_decode_attention",
]
