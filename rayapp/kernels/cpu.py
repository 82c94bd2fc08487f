"""What this CPU runs fast, found once per process, and the dtype and linear kernels chosen from it.

rayapp's figures were first taken on Intel CPUs with AVX-512 and AMX, where bfloat16 weights packed in
oneDNN's blocked layout are the fastest path. Elsewhere that path does not exist: oneDNN's bf16 matmul needs
AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and packing a bf16 weight on an AVX2-only CPU (AMD Zen 2/3, most desktops)
raises at load. So `dtype: auto` takes bfloat16 only where oneDNN has a bf16 path, float32 elsewhere; an explicit
`bfloat16` on a CPU without one is a start error naming what is missing.

Measured (`bench/cpu_linear.py`, SmolLM2-135M's projections, 2 threads, AMD EPYC Zen 4 with oneDNN held to AVX2
by `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`): float32 packed ran 16 rows 3.0x faster than bf16
without packing, and one row as fast; so float32, not unpacked bf16, is the choice there.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from rayapp.config import DTYPE_OPTIONS

logger = logging.getLogger(__name__)

# oneDNN's bf16 matmul (and so weight packing) runs on its `avx512_core` ISA or on `avx2_vnni_2`; torch's
# `mkldnn_bf16_device_check` asks the same question of oneDNN.
_AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
_AVX_NE_CONVERT = "avx_ne_convert"


@dataclass(frozen=True)
class CPUFeatures:
    """A CPU as rayapp's kernel choices see it."""

    model: str
    # The instruction set torch's own CPU kernels were dispatched to: "AVX512", "AVX2", "DEFAULT", ...
    capability: str
    # /proc/cpuinfo's flags (lower case): what the decisions below read.
    flags: frozenset[str]
    # torch is built with oneDNN (mkldnn) here: float32 weights can be packed.
    onednn: bool = True
    # oneDNN may use the ISAs that run bf16 (False where the CPU lacks them, or ONEDNN_MAX_CPU_ISA caps it).
    onednn_isa_allows_bf16: bool = True

    @property
    def bf16_matmul(self) -> bool:
        """oneDNN runs bf16 matmuls and packs bf16 weights on this CPU."""
        has_isa = self.flags >= _AVX512_CORE or _AVX_NE_CONVERT in self.flags
        return self.onednn and self.onednn_isa_allows_bf16 and has_isa

    @property
    def bf16_dot(self) -> bool:
        """Native bf16 dot products (AVX512-BF16 or AMX), which rayapp's C++ decode kernel and oneDNN use."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_bf16" in self.flags

    def bf16_missing(self) -> str:
        """What this CPU lacks for bf16, in words (empty where bf16 runs)."""
        if self.bf16_matmul:
            return ""
        if not self.onednn:
            return "this torch build has no oneDNN (mkldnn)"
        lacking = sorted(_AVX512_CORE - self.flags)
        if not lacking and not self.onednn_isa_allows_bf16:
            return "ONEDNN_MAX_CPU_ISA keeps oneDNN below AVX-512"
        return f"it has neither {', '.join(lacking)} nor {_AVX_NE_CONVERT}"

    def describe(self) -> str:
        """One line: the CPU and what its kernels can use."""
        bf16 = "bf16 matmul " + ("yes" if self.bf16_matmul else "no")
        parts = [f"torch kernels {self.capability}", bf16, f"AVX512-BF16 {'yes' if self.bf16_dot else 'no'}"]
        parts.append(f"AMX {'yes' if self.amx else 'no'}")
        return f"{self.model or 'unknown CPU'} ({'; '.join(parts)})"


@dataclass(frozen=True)
class CPUPlan:
    """The dtype and linear kernels rayapp's engine runs with on a CPU, and why."""

    dtype: torch.dtype
    # Linear weights packed in oneDNN's blocked layout (`rayapp.kernels.linear.PackedLinear`).
    prepack: bool
    reason: str

    @property
    def dtype_name(self) -> str:
        return _name(self.dtype)


def plan_for(requested: str, cpu: CPUFeatures) -> CPUPlan:
    """Choose the dtype and linear kernels for `dtype: requested` on `cpu`.

    Raises ValueError, naming what the CPU lacks and the setting to change, for `bfloat16` on a CPU
    without oneDNN's bf16 path (it would run on torch's reference GEMM, several times slower)."""
    best = torch.bfloat16 if cpu.bf16_matmul else torch.float32
    if requested == "auto":
        why = "oneDNN runs bf16 here" if cpu.bf16_matmul else f"no bf16 path on this CPU: {cpu.bf16_missing()}"
        return CPUPlan(best, cpu.onednn, f"dtype: auto -> {_name(best)} ({why})")
    if requested == "bfloat16":
        if not cpu.bf16_matmul:
            raise ValueError(
                f"dtype: bfloat16 needs a CPU where oneDNN runs bf16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), and "
                f"{cpu.model or 'this CPU'}: {cpu.bf16_missing()}; set dtype: auto (float32 here) or float32"
            )
        return CPUPlan(torch.bfloat16, True, "dtype: bfloat16")
    if requested == "float32":
        return CPUPlan(torch.float32, cpu.onednn, "dtype: float32")
    if requested == "float16":
        # No CPU path of rayapp's packs or multiplies fp16 weights natively; vLLM's CPU backend also prefers bf16.
        return CPUPlan(best, cpu.onednn, f"dtype: float16 runs as {_name(best)} on CPU (no fp16 matmul path here)")
    raise ValueError(f"dtype={requested!r} is not supported; use one of {', '.join(DTYPE_OPTIONS)}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def detect() -> CPUFeatures:
    """This process's CPU, read once: /proc/cpuinfo's model and flags, torch's dispatch and oneDNN's ISA."""
    model, flags = "", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:  # not Linux: no flags, so no bf16 choice is made from them
        pass
    onednn = torch.backends.mkldnn.is_available()
    return CPUFeatures(
        model=model or os.uname().machine,
        capability=torch.backends.cpu.get_cpu_capability(),
        flags=flags,
        onednn=onednn,
        # torch asks oneDNN itself, which honours ONEDNN_MAX_CPU_ISA.
        onednn_isa_allows_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    )


def cpu_plan(requested: str) -> CPUPlan:
    """`plan_for` this process's CPU, logged once per call with the CPU's description."""
    cpu = detect()
    plan = plan_for(requested, cpu)
    packing = "oneDNN-packed linears" if plan.prepack else "torch linears"
    logger.info("CPU: %s -> %s, %s [%s]", cpu.describe(), plan.dtype_name, packing, plan.reason)
    return plan
