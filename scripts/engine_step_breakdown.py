"""Per-step breakdown of the batched engine: plain vs scheduled DSpark at one concurrency, round-robin.

For each run: aggregate tokens/s, time spent admitting (prefill), and per (batch size R, drafted or not) the number of
steps, their mean time without admission, tokens per step and tokens/s; for the scheduled engine also the realized
gate's view (tokens/s over its window per side) at R = concurrency. The scheduled runs share one
``EngineMeasurements`` (as bench-serve does), so later runs start from what earlier ones measured.

    python scripts/engine_step_breakdown.py --concurrency 4 --repeats 2     # SmolLM2 + embedded drafter, fp32 (--dtype bfloat16)
"""

from __future__ import annotations

import argparse
import collections
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine, EngineMeasurements, SamplingParams  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup  # noqa: E402


def run(target, drafter, prompts, concurrency: int, method: str, measurements, max_new_tokens: int) -> None:
    engine = DSparkEngine(target, None if method == "plain" else drafter, method=method, max_concurrency=concurrency,
                          seed=0, **({"adapt_sps": True, "measurements": measurements} if method != "plain" else {}))
    admit, admitted = engine._admit, [0.0]

    def timed_admit():
        started = time.perf_counter()
        events = admit()
        admitted[0] = time.perf_counter() - started
        return events

    engine._admit = timed_admit
    step, steps = engine.step, []

    def timed_step():
        started = time.perf_counter()
        events = step()
        seconds = time.perf_counter() - started
        if engine.stats.active:
            steps.append((engine.stats.active[-1], engine.stats.drafting[-1] > 0, seconds - admitted[0],
                          engine.stats.emitted[-1], admitted[0]))
        admitted[0] = 0.0
        return events

    engine.step = timed_step
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for prompt in prompts:
        engine.add_request(prompt, params)
    started = time.perf_counter()
    for _ in engine.stream():
        pass
    wall = time.perf_counter() - started
    tokens = sum(len(o.token_ids) for o in engine.outputs.values())
    print(f"{method}: {tokens / wall:.1f} tok/s, wall {wall:.1f} s, admitting {sum(s[4] for s in steps):.1f} s",
          flush=True)
    groups = collections.defaultdict(lambda: [0, 0.0, 0])
    for rows, drafted, seconds, emitted, _ in steps:
        group = groups[(rows, drafted)]
        group[0], group[1], group[2] = group[0] + 1, group[1] + seconds, group[2] + emitted
    for (rows, drafted), (count, seconds, emitted) in sorted(groups.items()):
        if count >= 3:
            print(f"   R={rows:<3d} {'drafting' if drafted else 'plain   '}: {count:4d} steps, "
                  f"{1000 * seconds / count:6.1f} ms, {emitted / count:5.2f} tok/step, {emitted / seconds:6.1f} tok/s")
    if method != "plain":
        for drafted in (False, True):
            rate = measurements.realized_rate(concurrency, drafted)
            if rate is not None:
                print(f"   gate's view at R={concurrency}, {'drafting' if drafted else 'plain'}: {rate:.1f} tok/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    add_measurement_arguments(parser, dtype="float32")
    args = parser.parse_args()
    target, _, drafter, prompts = load_measurement_setup(args)
    measurements = EngineMeasurements()
    for repeat in range(args.repeats):
        print(f"-- round {repeat + 1}", flush=True)
        for method in ("plain", "scheduled"):
            run(target, drafter, prompts, args.concurrency, method, measurements, args.max_new_tokens)


if __name__ == "__main__":
    main()
