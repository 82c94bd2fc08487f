"""The dtype and linear kernels chosen for each kind of CPU, described to the choice; and this CPU read right."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rayapp.kernels.cpu import CPUFeatures, detect, plan_for

BASE = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}
CPUS = {
    # AMD Zen 3 (EPYC Milan) and most desktops: AVX2 only.
    "avx2": CPUFeatures("AMD EPYC 7763", "AVX2", frozenset(BASE)),
    # Intel Skylake-SP: AVX-512 without bf16 instructions; oneDNN still runs bf16 (converting).
    "avx512": CPUFeatures("Intel Xeon Gold 6148", "AVX512", frozenset(AVX512)),
    # AMD Zen 4: AVX-512 with AVX512-BF16.
    "avx512-bf16": CPUFeatures("AMD EPYC 9654", "AVX512", frozenset(AVX512 | {"avx512_bf16"})),
    # Intel Sapphire Rapids: AVX-512, AVX512-BF16 and AMX.
    "amx": CPUFeatures(
        "Intel Xeon Platinum 8480+", "AVX512", frozenset(AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile"})
    ),
    # Intel Arrow Lake / Sierra Forest: AVX2 with AVX-NE-CONVERT.
    "avx-ne-convert": CPUFeatures("Intel Core Ultra 9 285K", "AVX2", frozenset(BASE | {"avx_ne_convert"})),
}


@pytest.mark.parametrize(
    "name, dtype", [("avx2", torch.float32), ("avx512", torch.bfloat16), ("avx512-bf16", torch.bfloat16),
                    ("amx", torch.bfloat16), ("avx-ne-convert", torch.bfloat16)],
)  # fmt: skip
def test_auto_takes_bf16_only_where_onednn_runs_it(name, dtype):
    plan = plan_for("auto", CPUS[name])
    assert plan.dtype == dtype and plan.prepack
    assert plan.dtype_name in plan.reason


def test_bfloat16_on_an_avx2_only_cpu_is_an_error_naming_what_is_missing_and_the_setting():
    with pytest.raises(ValueError) as error:
        plan_for("bfloat16", CPUS["avx2"])
    message = str(error.value)
    assert "AMD EPYC 7763" in message and "avx512bw" in message and "avx_ne_convert" in message
    assert "set dtype: auto (float32 here) or float32" in message


@pytest.mark.parametrize("name", ["avx512", "amx", "avx-ne-convert"])
def test_bfloat16_runs_packed_where_onednn_runs_it(name):
    plan = plan_for("bfloat16", CPUS[name])
    assert plan.dtype == torch.bfloat16 and plan.prepack


@pytest.mark.parametrize("name", list(CPUS))
def test_float32_always_runs_packed_and_float16_runs_as_auto_says(name):
    assert plan_for("float32", CPUS[name]).dtype == torch.float32
    assert plan_for("float32", CPUS[name]).prepack
    half = plan_for("float16", CPUS[name])
    assert half.dtype == plan_for("auto", CPUS[name]).dtype and "float16 runs as" in half.reason


def test_without_onednn_nothing_is_packed_and_bf16_is_refused_naming_the_build():
    cpu = CPUFeatures("Intel Xeon Platinum 8480+", "AVX512", CPUS["amx"].flags, onednn=False)
    assert plan_for("auto", cpu).dtype == torch.float32 and not plan_for("auto", cpu).prepack
    with pytest.raises(ValueError, match="no oneDNN"):
        plan_for("bfloat16", cpu)


def test_an_unknown_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="dtype='fp8' is not supported; use one of auto, float32, bfloat16, float16"):
        plan_for("fp8", CPUS["amx"])


def test_descriptions_name_the_cpu_and_its_bf16_and_amx():
    assert "AMX yes" in CPUS["amx"].describe() and "bf16 matmul no" in CPUS["avx2"].describe()
    assert CPUS["avx2"].describe().startswith("AMD EPYC 7763 (torch kernels AVX2")


def test_this_cpu_is_read_as_torch_reads_it():
    cpu = detect()
    assert cpu.capability == torch.backends.cpu.get_cpu_capability()
    assert cpu.bf16_matmul == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert cpu.bf16_dot == (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def test_onednn_held_to_avx2_runs_float32_packed_and_refuses_bf16():
    # A process whose oneDNN may not use AVX-512 stands in for an AVX2-only CPU: bf16 packing there raises
    # "bf16 path needs the cpu support avx_ne_convert or avx512bw, ...", the error that crash-looped the replica.
    script = (
        "import torch; from torch import nn\n"
        "from rayapp.kernels.cpu import detect, plan_for\n"
        "from rayapp.kernels.linear import PackedLinear, can_prepack\n"
        "plan = plan_for('auto', detect())\n"
        "assert plan.dtype == torch.float32 and plan.prepack, plan\n"
        "assert not can_prepack(nn.Linear(8, 8).bfloat16().weight)\n"
        "PackedLinear(nn.Linear(8, 8))(torch.randn(2, 8))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
