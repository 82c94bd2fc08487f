"""The projections of one decoder layer on this CPU, per dtype and linear path: what `dtype: auto` chose and why.

Times the four projections of one layer of the shipped SmolLM2-135M (qkv, o, gate_up, down) for 1 and 16 rows,
in float32 and bfloat16, as torch's `F.linear` and packed for oneDNN (where this CPU packs that dtype), and prints
each path's time and its ratio to the path `dtype: auto` runs (`rayapp.kernels.cpu`). To see an AVX2-only CPU's
choice on an AVX-512 machine, hold oneDNN and torch's kernels to AVX2:

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python bench/cpu_linear.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from rayapp.kernels.cpu import detect, plan_for
from rayapp.models.loader import ModelSpec, prepare_default_model


def _time_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def layer_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(out, in) of a decoder layer's fused projections."""
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    return [
        (qkv, spec.hidden_size),
        (spec.hidden_size, spec.num_heads * spec.head_dim),
        (2 * spec.intermediate_size, spec.hidden_size),
        (spec.hidden_size, spec.intermediate_size),
    ]


def layer_time_us(shapes: list[tuple[int, int]], dtype: torch.dtype, packed: bool, rows: int, repeats: int) -> float:
    total = 0.0
    for out_features, in_features in shapes:
        weight = torch.randn(out_features, in_features).to(dtype)
        x = torch.randn(rows, in_features).to(dtype)
        if packed:
            w = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            total += _time_us(lambda x=x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), repeats)
        else:
            total += _time_us(lambda x=x, weight=weight: F.linear(x, weight), repeats)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    cpu = detect()
    plan = plan_for("auto", cpu)
    shapes = layer_shapes(ModelSpec.from_dir(prepare_default_model()))
    print(f"CPU: {cpu.describe()}; torch threads {torch.get_num_threads()}")
    print(f"dtype: auto -> {plan.dtype_name}, {'packed' if plan.prepack else 'F.linear'} ({plan.reason})")
    paths = [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)]
    if cpu.bf16_matmul:
        paths.append((torch.bfloat16, True))
    chosen = (plan.dtype, plan.prepack)
    for rows in (1, 16):
        times = {path: layer_time_us(shapes, *path, rows, args.repeats) for path in paths}
        print(f"\n{rows} row(s), one layer's projections (us); ratio = path time / auto's path time")
        for (dtype, packed), us in times.items():
            mark = "  <- auto" if (dtype, packed) == chosen else ""
            name = f"{str(dtype).removeprefix('torch.')} {'packed' if packed else 'F.linear'}"
            print(f"  {name:18s} {us:9.1f}  {us / times[chosen]:5.2f}x{mark}")


if __name__ == "__main__":
    main()
