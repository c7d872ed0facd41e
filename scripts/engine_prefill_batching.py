"""What prefill forwards cost, and what admitting prompts together saves.

``--fit``: times the engine's prefill forward (``DSparkEngine._prefill``) over ``rows`` equal prompts of ``width``
tokens for a grid of shapes (the fastest of three each), fits ``seconds = fixed + a * rows * width + b * rows *
width**2`` by least squares on relative errors and prints the ``PrefillCost`` it implies (the default
``PrefillCost`` comes from this on SmolLM2-135M, bf16, 2 threads).

Then every prompt is admitted (prefilled) by a fresh plain engine, in groups of ``--group-sizes`` prompts at a time
(the engine splits each group into forwards by its ``PrefillCost``), and the total admission time per group size is
reported, with its ratio to the largest group size, over ``--repeats`` rounds that rotate the order. This is what
``admission_hold`` (joiners sharing an admission) can save. SmolLM2-135M, bf16, 2 threads:

    python scripts/engine_prefill_batching.py --fit --group-sizes 64 16 4 1 --repeats 3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from hf_dspark.engine import DSparkEngine
    from hf_dspark.engine import SamplingParams
    from hf_dspark.evaluation.engine_bench import add_measurement_arguments, load_measurement_setup

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[16, 4, 1])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--fit", action="store_true", help="time prefill forwards of a grid of shapes and fit the "
                        "PrefillCost they imply")
    add_measurement_arguments(parser)
    args = parser.parse_args()
    if any(g < 1 for g in args.group_sizes) or args.repeats < 1:
        parser.error("group sizes and repeats must be >= 1")
    target, _, _, prompts = load_measurement_setup(args)
    if args.fit:
        fit(target)
    for size in args.group_sizes:  # warm-up: the first forwards of each shape pay one-off kernel set-up
        engine = DSparkEngine(target, None, policy="plain", seed=0)
        for prompt in prompts[:size]:
            engine.add_request(prompt, SamplingParams(max_new_tokens=args.max_new_tokens))
        engine._admit()
    totals: dict[int, list[float]] = {g: [] for g in args.group_sizes}
    sizes = list(args.group_sizes)
    for repeat in range(args.repeats):
        for size in sizes[repeat % len(sizes):] + sizes[: repeat % len(sizes)]:
            total = 0.0
            for start in range(0, len(prompts), size):
                engine = DSparkEngine(target, None, policy="plain", seed=0)
                for prompt in prompts[start:start + size]:
                    engine.add_request(prompt, SamplingParams(max_new_tokens=args.max_new_tokens))
                started = time.perf_counter()
                engine._admit()
                total += time.perf_counter() - started
            totals[size].append(total)
            print(f"group size {size:3d}: {total:.2f} s for {len(prompts)} prompts", flush=True)
    base = statistics.fmean(totals[max(sizes)])
    for size in sizes:
        mean = statistics.fmean(totals[size])
        forwards = -(-len(prompts) // size)
        print(f"group size {size:3d}: mean {mean:.2f} s (min {min(totals[size]):.2f}), {forwards} forwards, "
              f"{mean / base:.3f}x group size {max(sizes)}")


def fit(target) -> None:
    import torch

    from hf_dspark.engine import DSparkEngine, PrefillCost

    shapes = [(b, w) for b in (1, 2, 4, 8, 16) for w in (16, 64, 128, 256, 512) if b * w <= 4096]
    rows = []
    for rows_, width in shapes:
        times = []
        for _ in range(3):
            engine = DSparkEngine(target, None, policy="plain", seed=0)
            for r in range(rows_):
                engine.add_request([(7 * r + 11 * i) % 1000 + 100 for i in range(width)])
            started = time.perf_counter()
            engine._prefill(list(engine._waiting))
            times.append(time.perf_counter() - started)
        rows.append((rows_, width, min(times)))
        print(f"prefill forward {rows_:2d} x {width:3d}: {1000 * min(times):7.1f} ms", flush=True)
    design = torch.tensor([[1.0, b * w, b * w * w] for b, w, _ in rows], dtype=torch.float64)
    seconds = torch.tensor([s for _, _, s in rows], dtype=torch.float64)
    weights = 1.0 / seconds[:, None]  # relative errors: the small forwards (most joins) count as much as the big ones
    solution = torch.linalg.lstsq(design * weights, seconds[:, None] * weights).solution
    fixed, per_token, per_pair = solution[:, 0].tolist()
    worst = max(abs(float(p) - s) / s for p, s in zip(design @ torch.tensor([fixed, per_token, per_pair],
                                                                               dtype=torch.float64), seconds))
    print(f"fit: {1000 * fixed:.1f} ms per forward + {1000 * per_token:.3f} ms per padded token + "
          f"{1e6 * per_pair:.3f} us per padded token and key (largest misfit {100 * worst:.0f}%)")
    if per_token > 0 and per_pair > 0 and fixed >= 0:
        print(f"  -> PrefillCost(fixed_tokens={fixed / per_token:.0f}, attention_width={per_token / per_pair:.0f}); "
              f"default {PrefillCost()}")
    else:
        print("  -> a coefficient came out negative: the timings are too noisy to fit (run it again, quietly)")


if __name__ == "__main__":
    main()
