"""The scheduled engine's own overhead: plain engine vs the scheduled engine with drafting priced out, side by side.

The scheduled engine gets an SPS profile where verifying any draft is prohibitive, so it never drafts (not even a
probe) and decodes exactly like plain; what remains between the two is the scheduled engine's bookkeeping (the
target features it keeps for the drafter, the scheduling decisions). The two engines serve the same prompts side by
side (``bench-serve --lockstep``'s stepping), and each repeat gives the ratio of their speeds over their own steps
(admissions included).
SmolLM2-135M + embedded drafter:

    python scripts/engine_overhead.py --concurrency 16 --repeats 3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import SamplingParams  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup, run_lockstep  # noqa: E402
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
    specs = {"plain": {"method": "plain"},
             "scheduled, drafting priced out": {"method": "scheduled", "adapt_sps": False}}  # the profile as given
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    ratios = []
    for repeat in range(args.repeats):
        # bench-serve --lockstep's stepping: the engine furthest behind steps next, each timed on its own steps
        # (admissions included); both do the same work step for step, so they alternate
        runs = run_lockstep(target, drafter, prompts, params, args.concurrency, specs, sps=never, shift=repeat)
        (plain, _), (scheduled, _) = runs["plain"], runs["scheduled, drafting priced out"]
        if scheduled["mean_drafting_requests"]:
            raise RuntimeError("the scheduled engine drafted: the prohibitive profile did not hold")
        ratios.append(scheduled["tokens_per_s"] / plain["tokens_per_s"])
        print(f"repeat {repeat}: " + "  ".join(
            f"{name} {summary['wall_s']:6.2f} s (prefill {summary['prefill_s']:5.2f})"
            for name, (summary, _) in runs.items()) + f"  scheduled / plain speed {ratios[-1]:.4f}", flush=True)
    logs = [math.log(r) for r in ratios]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    print(f"scheduled (drafting priced out) / plain: geometric mean {math.exp(statistics.fmean(logs)):.4f} "
          f"x/÷ {math.exp(se):.4f} over {len(ratios)} paired repeats")


if __name__ == "__main__":
    main()
