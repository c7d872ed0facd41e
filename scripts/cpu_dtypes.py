"""What this machine's CPU does with float32 and bfloat16: native bf16 instructions or not (the flags
`--mixed-precision auto` reads), and GFLOP/s of the matrix products SmolLM2 and its drafter run, per dtype.

    python scripts/cpu_dtypes.py [--threads 2] [--repeats 3]

Where bf16 is emulated (an AVX2-only CPU), bf16 products run orders of magnitude slower than float32: training
autocast and bf16 benchmarks are then out of reach on that machine, whatever the code does.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hf_dspark.cpu_features import cpu_flags  # noqa: E402
from hf_dspark.training.trainer import bf16_is_fast  # noqa: E402

# (rows, inner, columns): a drafter training step's MLP (1792 block tokens), a target decode step's MLP at 1 and 8
# tokens (plain decoding and a verification)
SHAPES = [(1792, 576, 1536), (1, 576, 1536), (8, 576, 1536)]


def rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int, budget_s: float = 20.0) -> float | None:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    started = time.perf_counter()
    a @ b
    first = time.perf_counter() - started
    if first * repeats > budget_s:  # emulated bf16 can take seconds per product: one timing is enough
        return 2 * m * k * n / first / 1e9
    best = first
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * m * k * n / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags()]
    print(f"CPU flags: {' '.join(flags) or 'none of avx2/avx512/amx'}; native bf16: {bf16_is_fast('cpu')}; "
          f"{args.threads} threads")
    print("product                 float32 GFLOP/s   bfloat16 GFLOP/s   bf16 / f32")
    for m, k, n in SHAPES:
        f32 = rate(m, k, n, torch.float32, args.repeats)
        bf16 = rate(m, k, n, torch.bfloat16, args.repeats)
        print(f"{m:5d} x {k} x {n:<5d}    {f32:12.1f}    {bf16:15.2f}    {bf16 / f32:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
