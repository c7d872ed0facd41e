"""The scheduled engine's own overhead: plain engine vs the scheduled engine with drafting priced out, round-robin.

The scheduled engine gets an SPS profile where verifying any draft is prohibitive, so it never drafts (not even a
probe) and decodes exactly like plain; what remains between the two is the scheduled engine's bookkeeping (the
target features it keeps for the drafter, the scheduling decisions). SmolLM2-135M + embedded drafter:

    python scripts/engine_overhead.py --concurrency 16 --repeats 3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup, serve  # noqa: E402
from hf_dspark.profiling import BatchedStepsPerSecond  # noqa: E402
from hf_dspark.scheduling import StepsPerSecond  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    add_measurement_arguments(parser)
    args = parser.parse_args()
    target, _, drafter, prompts = load_measurement_setup(args)
    sizes = [1 << k for k in range(args.concurrency.bit_length()) if 1 << k <= args.concurrency]
    never = BatchedStepsPerSecond({r: StepsPerSecond([r, 2 * r, 8 * r], [10.0, 1e-3, 1e-4])
                                   for r in sorted(set(sizes) | {args.concurrency})})
    rates: dict[str, list[float]] = {"plain": [], "scheduled, drafting priced out": []}
    for _ in range(args.repeats):
        for name in rates:
            if name == "plain":
                engine = DSparkEngine(target, None, method="plain", max_concurrency=args.concurrency, seed=0)
            else:
                engine = DSparkEngine(target, drafter, method="scheduled", sps=never,
                                      max_concurrency=args.concurrency, seed=0)
            tokens, wall = serve(engine, prompts, args.max_new_tokens)
            if sum(engine.stats.drafting):
                raise RuntimeError("the scheduled engine drafted: the prohibitive profile did not hold")
            rates[name].append(tokens / wall)
            print(f"{name:32s} {rates[name][-1]:7.1f} tok/s", flush=True)
    for name, values in rates.items():
        print(f"{name:32s} mean {statistics.fmean(values):7.1f}  best {max(values):7.1f} tok/s")


if __name__ == "__main__":
    main()
