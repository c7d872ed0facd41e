"""What a prefill forward costs beyond its tokens: the engine's admission of the same prompts in groups of each size.

Every prompt is admitted (prefilled) by a fresh plain engine, in groups of ``--group-sizes`` prompts at a time, and
the total admission time per group size is reported, with its ratio to the largest group size, over ``--repeats``
rounds that rotate the order. Grouping changes only how many prefill forwards carry the same prompt tokens, so the
difference is the fixed price of a forward (the basis of ``hf_dspark.engine.batching.ADMISSION_HOLD``).
SmolLM2-135M, bf16, 2 threads:

    python scripts/engine_prefill_batching.py --group-sizes 16 4 1 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    from hf_dspark.engine import DSparkEngine
    from hf_dspark.engine.batching import SamplingParams
    from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[16, 4, 1])
    parser.add_argument("--repeats", type=int, default=2)
    add_measurement_arguments(parser)
    args = parser.parse_args()
    if any(g < 1 for g in args.group_sizes) or args.repeats < 1:
        parser.error("group sizes and repeats must be >= 1")
    target, _, _, prompts = load_measurement_setup(args)
    for size in args.group_sizes:  # warm-up: the first forwards of each shape pay one-off kernel set-up
        engine = DSparkEngine(target, None, method="plain", seed=0)
        for prompt in prompts[:size]:
            engine.add_request(prompt, SamplingParams(max_new_tokens=args.max_new_tokens))
        engine._admit()
    totals: dict[int, list[float]] = {g: [] for g in args.group_sizes}
    sizes = list(args.group_sizes)
    for repeat in range(args.repeats):
        for size in sizes[repeat % len(sizes):] + sizes[: repeat % len(sizes)]:
            total = 0.0
            for start in range(0, len(prompts), size):
                engine = DSparkEngine(target, None, method="plain", seed=0)
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


if __name__ == "__main__":
    main()
