"""The Triton retrieval kernels (rayapp.kernels.triton) on a machine without a GPU: how long each takes
to compile for CUDA and ROCm targets, and their answers under Triton's interpreter against rayapp's
references. The interpreter is not a speed measure; on CPU, rayapp's engine and the vLLM plugin keep
the PyTorch and C++ kernels of rayapp.kernels.retrieval.

    PYTHONPATH=. python bench/triton_kernels.py
    PYTHONPATH=. python bench/sparse_attention.py --kernels triton    # this report, then the run asked for

Shapes are SmolLM2-135M's (9 query / 3 KV heads of 64), bfloat16, 16-token pages.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

HQ, HKV, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16


def report_compile_times() -> None:
    """Seconds per kernel and target for ``compile_for`` (a fresh compile, not Triton's cache)."""
    from triton.backends.compiler import GPUTarget

    from rayapp.kernels.triton import compile_for

    targets = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)]
    print("\n## Ahead-of-time compile, SmolLM2 shape, bfloat16 (seconds; binary KB)")
    print(f"{'target':<14} {'score_blocks':>14} {'decode_split':>14} {'merge_splits':>14} {'total s':>8}")
    for target in targets:
        compiled = compile_for(target, dtype=torch.bfloat16, head_dim=HEAD_DIM, group=HQ // HKV, page_size=PAGE_SIZE)
        cells = [f"{c.seconds:6.2f}; {len(c.binary) // 1024:>4}" for c in compiled]
        name = f"{target.backend} {target.arch}"
        print(f"{name:<14} " + " ".join(f"{c:>14}" for c in cells) + f" {sum(c.seconds for c in compiled):>8.2f}")


def interpreter_check() -> None:
    """Runs in a child started with TRITON_INTERPRET=1: max |error| against the ``ref_*`` loops."""
    from rayapp.kernels import retrieval
    from rayapp.kernels.triton import interpreting, score_blocks, sparse_decode_attention

    assert interpreting(), "TRITON_INTERPRET=1 must be set before triton is imported"
    gen = torch.Generator().manual_seed(0)
    batch, listed, pages = 2, 32, 96
    print(f"{'kernel':<34} {'dtype':>9} {'max |err|':>10} {'interpreter s':>14}")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # vLLM 0.32's layout: [num_blocks, H, block_size, 2 * D], K and V its channel halves.
        kv = torch.randn(pages, HKV, PAGE_SIZE, 2 * HEAD_DIM, generator=gen).to(dtype)
        k_cache, v_cache = kv.transpose(1, 2).split(HEAD_DIM, -1)
        q = torch.randn(batch, HQ, HEAD_DIM, generator=gen).to(dtype)
        table = torch.randint(0, pages, (batch, HKV, listed), generator=gen)
        lens = torch.full((batch, listed), PAGE_SIZE)
        lens[0, -1], lens[1, -4:] = 5, torch.tensor([9, 0, 0, 0])  # partial last pages, padding
        start = time.perf_counter()
        got = sparse_decode_attention(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, pages_per_split=8)
        seconds = time.perf_counter() - start
        want = retrieval.ref_sparse_decode_attention(q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5)
        err = (got.float() - want.float()).abs().max().item()
        name = f"sparse_decode {listed} pages/head"
        print(f"{name:<34} {str(dtype).removeprefix('torch.'):>9} {err:>10.2e} {seconds:>14.2f}")
    q = torch.randn(batch, HQ, HEAD_DIM, generator=gen)
    for kind, rows in (("mean", 1), ("minmax", 1), ("multimean", 4)):
        keys = torch.randn(batch * 48, 128, HKV, HEAD_DIM, generator=gen)
        reps = retrieval.block_representation(keys, kind, rows).view(batch, 48, HKV, -1, HEAD_DIM)
        start = time.perf_counter()
        got = score_blocks(q, reps, kind)
        seconds = time.perf_counter() - start
        err = (got - retrieval.ref_score_blocks(q, reps, kind)).abs().max().item()
        print(f"{'score_blocks ' + kind + ', 48 blocks':<34} {'float32':>9} {err:>10.2e} {seconds:>14.2f}")


def run() -> None:
    """The whole report: compile times here, the interpreter check in a child process (Triton picks
    interpreted or compiled as it is imported, and this process compiles)."""
    import triton

    print(f"\n# Triton {triton.__version__} retrieval kernels (rayapp.kernels.triton), no GPU needed")
    report_compile_times()
    print("\n## Under TRITON_INTERPRET=1 against rayapp.kernels.retrieval's references (correctness, not speed)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.stdout.flush()  # the child writes to the same stdout
    subprocess.run([sys.executable, __file__, "--interpreter-check"], env=env, check=True)
    print(
        "\nOn CPU the engine and the vLLM plugin keep rayapp.kernels.retrieval (PyTorch and C++); "
        "the Triton kernels' speed is a GPU measure, not taken here."
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interpreter-check", action="store_true", help=argparse.SUPPRESS)
    if parser.parse_args().interpreter_check:
        interpreter_check()
    else:
        run()
