"""rayapp's C++ CPU kernels (`csrc/`), built on first use by torch's cpp_extension and cached.

- `paged_decode_attention`: rayapp's engine's decode attention, reading its pages in place. The decode step on
  CPU spent half its time in `F.scaled_dot_product_attention` over gathered, masked pages (1.1 ms a layer for
  8 sequences of ~700 tokens; this kernel: ~0.4 ms).
- `select_retrieval_blocks` and `vec_pages_decode_attention`: the `retrieval` plugin's sparse decode on vLLM's
  CPU cache (`rayapp.vllm_ext.retrieval_backend`): top-k block selection in one pass over the representations,
  and attention over each KV head's own pages in vLLM's `vec` packing (`bench/sparse_vllm.py`).

The build needs a C++ compiler (g++) and takes ~30 s once per machine; it lands under torch's extension directory
(`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`), named by the sources, torch's version and this
CPU's instruction set, so a shared home directory never hands one CPU another's build. Where it cannot be built,
or with `RAYAPP_NATIVE_KERNELS=0`, the plain-torch kernels (and vLLM's own attention, for the plugin) run instead
(equal up to rounding, slower), after one warning that says why."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_decode.cpp", CSRC / "retrieval_select.cpp", CSRC / "vec_pages_decode.cpp"]
HEAD_DIMS = (64, 128)  # head dims the decode kernel is compiled for (csrc/paged_decode.cpp)
MAX_HEADS = 256  # query heads of a layer it handles
# float32 stays on torch's SDPA: its rounding is what the exactness tests hold against transformers (logprobs
# within 1e-4 over 30 layers); this kernel's error against float64 is of the same order, its rounding not the same.
DTYPES = (torch.bfloat16, torch.float16)
# No -ffast-math: GCC would link crtfastmath into the library, flushing denormals for the whole process.
# -fopenmp: ATen's parallel_for is inlined into the kernels, and only spreads work over threads when they are built
# with OpenMP (without it every call ran on one thread). The library binds to the libgomp torch has loaded.
_CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build_name() -> str:
    texts = [f.read_text() for f in sorted(CSRC.iterdir())]  # the sources and the headers they include
    key = "\n".join([*texts, torch.__version__, " ".join(_CFLAGS), _cpu_flags()])
    return f"rayapp_cpu_{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def available() -> bool:
    """Whether the CPU kernels are built and loaded in this process (building them on the first call)."""
    if "loaded" in _state:
        return _state["loaded"]
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _load()
    return _state["loaded"]


def _load() -> bool:
    if os.environ.get("RAYAPP_NATIVE_KERNELS", "1") == "0":
        logger.info("RAYAPP_NATIVE_KERNELS=0: the plain-torch CPU kernels run")
        return False
    try:
        from torch.utils.cpp_extension import load

        load(
            name=_build_name(),
            sources=[str(f) for f in SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as error:  # no compiler, no ninja, a read-only cache: serve with the torch kernels
        logger.warning(
            "rayapp's C++ CPU kernels could not be built (%s); decode attention runs in plain torch, slower. "
            "Install g++ and ninja, or set RAYAPP_NATIVE_KERNELS=0 to skip the build.",
            str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__,
        )
        return False
    return True


def handles_decode(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` of these tensors can run on the C++ kernel."""
    Hq, D = q.shape[1], q.shape[2]
    return (
        q.device.type == "cpu"
        and D in HEAD_DIMS
        and Hq <= MAX_HEADS
        and q.dtype in DTYPES
        and k_cache.is_contiguous()
        and available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`rayapp.kernels.attention.paged_decode_attention` on the C++ kernel (check `handles_decode` first)."""
    if not available():
        raise RuntimeError("rayapp's C++ CPU kernels are not built in this process (see the warning logged)")
    return torch.ops.rayapp_cpu.paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale)


def handles_selection(q: torch.Tensor, representation: str) -> bool:
    """Whether `select_retrieval_blocks` of these queries can run on the C++ kernel."""
    return q.device.type == "cpu" and q.shape[2] in HEAD_DIMS and representation == "multimean" and available()


def select_retrieval_blocks(
    q: torch.Tensor, reps: torch.Tensor, block_keys: torch.Tensor, num_blocks: torch.Tensor, num_selected: torch.Tensor
) -> torch.Tensor:
    """`score_blocks(q, reps[h, block_keys], "multimean")` then `select_topk_blocks` in one pass, on the C++ kernel
    (check `handles_selection` first). q: [B, Hq, D]; reps: [Hkv, P, R, D] float32, the representation of block i
    of row b at reps[:, block_keys[b, i]]; returns blocks [B, Hkv, K] as `select_topk_blocks` does."""
    if not available():
        raise RuntimeError("rayapp's C++ CPU kernels are not built in this process (see the warning logged)")
    return torch.ops.rayapp_cpu.select_retrieval_blocks(q, reps, block_keys, num_blocks, num_selected)


def handles_vec_pages(q: torch.Tensor, kv_cache: torch.Tensor, isa: str) -> bool:
    """Whether `vec_pages_decode_attention` can read this vLLM CPU cache: the `vec` packing, unquantized, AVX-512."""
    return (
        isa == "vec"
        and q.dtype in DTYPES
        and kv_cache.dtype == q.dtype
        and q.shape[2] in HEAD_DIMS
        and kv_cache.is_contiguous()
        and kv_cache.shape[2] % 16 == 0
        and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
        and available()
    )


def vec_pages_decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, page_lists: torch.Tensor, lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token per row over vLLM's CPU cache `[num_blocks, Hkv, bs, 2 * D]` in its `vec` packing (per page
    and head, K transposed then V), KV head h of row b reading the pages `page_lists[b, h]` (its first
    `ceil(lens[b] / bs)`, `lens[b]` tokens in all). q: [B, Hq, D]; returns [B, Hq, D]. Check `handles_vec_pages`."""
    if not available():
        raise RuntimeError("rayapp's C++ CPU kernels are not built in this process (see the warning logged)")
    return torch.ops.rayapp_cpu.vec_pages_decode_attention(q, kv_cache, page_lists, lens, scale)
