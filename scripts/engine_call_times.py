"""Where the engine's time goes: total and per-call wall time of its main methods, plain vs scheduled.

Wraps the engine's step phases (admission and prefill, drafting, context catch-up, verification, cache row copies,
compaction, scheduling decisions) with timers and serves the same prompts with each method once, one after the other.
A fresh scheduled engine learns as it goes (its first steps at a batch size draft to measure), as a new server would.
SmolLM2-135M + embedded drafter:

    python scripts/engine_call_times.py --concurrency 16 --dtype bfloat16
    python scripts/engine_call_times.py --concurrency 1 --methods fixed scheduled   # decisions' cost at one request
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine, batching  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup, serve  # noqa: E402

TIMED = {
    batching.DSparkEngine: ["step", "_admit", "_prefill", "_drafting_rows", "_draft", "_verification_lengths",
                            "_verify", "_sps_table", "_stale_confidences"],
    batching.RaggedBatchCache: ["append_rows", "select_rows", "commit", "compact"],
    batching.DeferredDrafterContext: ["defer", "flush", "append_rows", "select_rows", "compact"],
}


def instrument(timers: dict[str, list]) -> None:
    """Replace each timed method by a wrapper adding its calls and seconds to ``timers[Class.method]``."""
    for cls, names in TIMED.items():
        for name in names:
            original = getattr(cls, name)

            @functools.wraps(original)
            def timed(*args, _original=original, _key=f"{cls.__name__}.{name}", **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    entry = timers.setdefault(_key, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - started

            setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--methods", nargs="+", default=["plain", "scheduled"], choices=("plain", "fixed", "scheduled"))
    add_measurement_arguments(parser)
    args = parser.parse_args()
    target, _, drafter, prompts = load_measurement_setup(args)
    timers: dict[str, list] = {}
    instrument(timers)
    for method in args.methods:
        engine = DSparkEngine(target, drafter if method != "plain" else None, method=method,
                              max_concurrency=args.concurrency, seed=0)
        if method == "scheduled":
            engine._profiled_table(args.concurrency)  # the SPS profile (cached after its first run) is not timed
        timers.clear()
        tokens, wall = serve(engine, prompts, args.max_new_tokens)
        print(f"{method}: {tokens / wall:.1f} tok/s, wall {wall:.2f} s, {len(engine.stats.active)} steps, "
              f"{sum(1 for d in engine.stats.drafting if d)} drafting")
        for key, (calls, seconds) in sorted(timers.items(), key=lambda item: -item[1][1]):
            print(f"   {key:40s} calls {calls:5d}  total {seconds * 1000:9.1f} ms  per call {seconds / calls * 1000:8.2f} ms")
        # What a step spends outside the forwards (drafter, context catch-up, verify): decisions and bookkeeping
        forwards = sum(timers.get(key, [0, 0.0])[1] for key in
                       ("DSparkEngine._draft", "DeferredDrafterContext.flush", "DSparkEngine._verify"))
        steps, step_s = timers.get("DSparkEngine.step", [0, 0.0])
        admit_s = timers.get("DSparkEngine._admit", [0, 0.0])[1]
        if steps:
            print(f"   outside the forwards and admission: {(step_s - admit_s - forwards) / steps * 1000:.2f} ms per step")


if __name__ == "__main__":
    main()
