"""Dense projections: `y = x @ W.T + b`, with weights prepacked for the CPU.

Decode on a CPU reads every weight once per step, so the GEMM's memory access decides the
speed. oneDNN's blocked weight layout, packed once at load, ran the model's projections 1.5-2x
faster than `F.linear` on the 2-core test machine (bf16 and float32, 1 to 16 rows), with
float32 results equal to `F.linear` up to summation order (bf16: identical in our tests).
Other devices keep `F.linear`, which is already the vendor GEMM there. Whether this CPU packs a
dtype at all is `rayapp.kernels.cpu`'s answer (oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rayapp.kernels.cpu import detect


def can_prepack(weight: Tensor) -> bool:
    """Whether this CPU's oneDNN packs and multiplies `weight`'s dtype."""
    if weight.device.type != "cpu":
        return False
    cpu = detect()
    return (weight.dtype == torch.float32 and cpu.onednn) or (weight.dtype == torch.bfloat16 and cpu.bf16_matmul)


class PackedLinear(nn.Module):
    """A frozen `nn.Linear` whose weight lives in oneDNN's blocked layout (CPU only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if not can_prepack(linear.weight):
            raise ValueError(f"this CPU cannot prepack a {linear.weight.dtype} weight on {linear.weight.device}")
        self.out_features = linear.out_features
        # The batch-size hint only picks a blocking; measured the same for 1 to 512 rows.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def ref_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The reference the packed path is tested against."""
    return F.linear(x, weight, bias)


def prepack_linears(module: nn.Module) -> None:
    """Replace, in place, every `nn.Linear` under `module` that can be packed."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and can_prepack(child.weight):
            setattr(module, name, PackedLinear(child))
        else:
            prepack_linears(child)
