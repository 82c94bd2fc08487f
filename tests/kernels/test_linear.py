"""The CPU-packed projection equals `F.linear` (float32 up to summation order; bf16 exactly)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rayapp.kernels import linear
from rayapp.kernels.cpu import CPUFeatures, detect
from rayapp.kernels.linear import PackedLinear, can_prepack, prepack_linears, ref_linear

BF16 = pytest.param(
    torch.bfloat16,
    marks=pytest.mark.skipif(not detect().bf16_matmul, reason="oneDNN has no bf16 path on this CPU"),
)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_packed_linear_matches_reference(dtype, bias, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(576, 960, bias=bias).to(dtype)
    x = torch.randn(rows, 576, dtype=dtype)
    expected = ref_linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, expected, **tol)


def test_prepack_swaps_nested_linears_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(5, 64)
    expected = model(x)
    prepack_linears(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_half_precision_weights_are_left_alone():
    model = nn.Sequential(nn.Linear(16, 16).half())
    prepack_linears(model)
    assert isinstance(model[0], nn.Linear)


def test_bf16_weights_stay_torch_linears_on_a_cpu_without_onednns_bf16_path(monkeypatch):
    avx2 = CPUFeatures("AMD EPYC 7763", "AVX2", frozenset({"avx", "avx2", "fma"}))
    monkeypatch.setattr(linear, "detect", lambda: avx2)
    model = nn.Sequential(nn.Linear(16, 16).bfloat16(), nn.Linear(16, 16))
    assert not can_prepack(model[0].weight) and can_prepack(model[1].weight)
    prepack_linears(model)
    assert isinstance(model[0], nn.Linear) and isinstance(model[1], PackedLinear)
