"""rayapp's C++ CPU kernels (`csrc/`), built on first use by torch's cpp_extension and cached.

The decode step on CPU spent half its time in `F.scaled_dot_product_attention` over gathered,
masked pages (1.1 ms a layer for 8 sequences of ~700 tokens; the kernel here: ~0.4 ms), so decode
attention reads the pages in place instead. The build needs a C++ compiler (g++) and takes ~15 s
once per machine; it lands under torch's extension directory (`TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions`), named by the source, torch's version and this CPU's instruction set,
so a shared home directory never hands one CPU another's build. Where it cannot be built, or with
`RAYAPP_NATIVE_KERNELS=0`, the plain-torch kernels run instead (equal up to rounding, slower), after
one warning that says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
HEAD_DIMS = (64, 128)  # head dims the decode kernel is compiled for (csrc/paged_decode.cpp)
MAX_HEADS = 256  # query heads of a layer it handles
# float32 stays on torch's SDPA: its rounding is what the exactness tests hold against transformers (logprobs
# within 1e-4 over 30 layers); this kernel's error against float64 is of the same order, its rounding not the same.
DTYPES = (torch.bfloat16, torch.float16)
# No -ffast-math: GCC would link crtfastmath into the library, flushing denormals for the whole process.
_CFLAGS = ["-O3", "-march=native", "-std=c++17"]

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
    key = "\n".join([SOURCE.read_text(), torch.__version__, " ".join(_CFLAGS), _cpu_flags()])
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

        load(name=_build_name(), sources=[str(SOURCE)], extra_cflags=_CFLAGS, is_python_module=False)
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
