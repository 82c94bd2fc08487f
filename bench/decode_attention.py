"""Decode attention on CPU: rayapp's C++ kernel (`rayapp.kernels.native`) vs the plain-torch kernel it replaced
(gather the pages, masked `F.scaled_dot_product_attention`), same shapes, same run.

SmolLM2-135M's layout (9 query / 3 KV heads, head_dim 64, 16-token pages, bfloat16). Each call reads another
layer's cache of a 30-layer stack, as a decode step does, so no layer's K/V is still in the CPU caches from the
call before; pages are scattered over the cache as a long-running engine leaves them.

    python bench/decode_attention.py              # torch's default threads
    python bench/decode_attention.py --threads 1  # what a 1-CPU replica gets
"""

from __future__ import annotations

import argparse
import time

import torch

from rayapp.kernels import attention, native

LAYERS, HQ, HKV, D, PAGE = 30, 9, 3, 64, 16
CASES = [(1, 1024), (8, 700), (8, 4096), (32, 1024), (1, 16384)]  # (sequences, tokens each)


def _time(fn, layers: list[tuple[torch.Tensor, torch.Tensor]], args: tuple, rounds: int) -> float:
    for k, v in layers[:3]:
        fn(args[0], k, v, *args[1:])
    start = time.perf_counter()
    for _ in range(rounds):
        for k, v in layers:
            fn(args[0], k, v, *args[1:])
    return (time.perf_counter() - start) / (rounds * len(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the C++ kernel could not be built here (see the warning above)")
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; ms per layer, one decode token per sequence")
    print(f"{'sequences x tokens':>20} {'torch':>9} {'C++':>9} {'torch / C++':>12}")
    for batch, tokens in CASES:
        pages_each = -(-tokens // PAGE)
        num_pages = 2 * batch * pages_each  # half the cache belongs to nobody: pages scattered over all of it
        layers = [
            tuple(torch.randn(num_pages, PAGE, HKV, D, generator=gen).bfloat16() for _ in "kv") for _ in range(LAYERS)
        ]
        table = torch.randperm(num_pages, generator=gen)[: batch * pages_each].view(batch, pages_each)
        q = torch.randn(batch, HQ, D, generator=gen).bfloat16()
        call = (q, table, torch.full((batch,), tokens), D**-0.5)
        ours = _time(native.paged_decode_attention, layers, call, args.rounds)
        with_torch = _time(attention.sdpa_paged_decode_attention, layers, call, args.rounds)
        print(f"{f'{batch} x {tokens}':>20} {with_torch * 1e3:>9.3f} {ours * 1e3:>9.3f} {with_torch / ours:>11.2f}x")


if __name__ == "__main__":
    main()
