"""The scheduled engine's own overhead: plain engine vs the scheduled engine with drafting priced out, side by side.

The scheduled engine gets an SPS profile where verifying any draft is prohibitive, so it never drafts (not even a
probe) and decodes exactly like plain; what remains between the two is the scheduled engine's bookkeeping (the
target features it keeps for the drafter, the scheduling decisions). The two engines serve the same prompts side by
side, one step of each in turn, and each repeat gives the ratio of their own times (admissions and steps).
SmolLM2-135M + embedded drafter:

    python scripts/engine_overhead.py --concurrency 16 --repeats 3 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine, SamplingParams  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup  # noqa: E402
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
    names = ["plain", "scheduled, drafting priced out"]
    ratios = []
    for repeat in range(args.repeats):
        engines = {
            names[0]: DSparkEngine(target, None, method="plain", max_concurrency=args.concurrency, seed=0),
            names[1]: DSparkEngine(target, drafter, method="scheduled", sps=never, max_concurrency=args.concurrency,
                                   seed=0),
        }
        engines[names[1]]._profiled_table(args.concurrency)  # the profile's table is not part of any step
        for engine in engines.values():
            for prompt in prompts:
                engine.add_request(prompt, SamplingParams(max_new_tokens=args.max_new_tokens))
        # Both engines do the same work step for step; one step of each in turn (the first alternates by repeat), so
        # a drift of the shared machine lands on both alike. Each is timed on its own steps and admissions.
        order = names if repeat % 2 == 0 else names[::-1]
        while any(engine.has_unfinished() for engine in engines.values()):
            for name in order:
                if engines[name].has_unfinished():
                    engines[name].step()
        if sum(engines[names[1]].stats.drafting):
            raise RuntimeError("the scheduled engine drafted: the prohibitive profile did not hold")
        seconds = {name: e.stats.prefill_s + sum(e.stats.seconds) for name, e in engines.items()}
        ratios.append(seconds[names[0]] / seconds[names[1]])
        print(f"repeat {repeat}: " + "  ".join(
            f"{name} {seconds[name]:6.2f} s (prefill {engines[name].stats.prefill_s:5.2f})" for name in names)
            + f"  scheduled / plain speed {ratios[-1]:.4f}", flush=True)
    logs = [math.log(r) for r in ratios]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    print(f"scheduled (drafting priced out) / plain: geometric mean {math.exp(statistics.fmean(logs)):.4f} "
          f"x/÷ {math.exp(se):.4f} over {len(ratios)} paired repeats")


if __name__ == "__main__":
    main()
