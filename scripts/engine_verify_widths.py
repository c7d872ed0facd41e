"""The engine's verify forward per block width, measured alone: fixed-length engines verifying N drafts (width N + 1)
and the plain engine (width 1), one request at a time, median milliseconds per width.

What the scheduler's prices at one request should come to once the engine has measured them
(``DSparkEngine._sps_table``). SmolLM2-135M + embedded drafter:

    python scripts/engine_verify_widths.py --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine, batching  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup, serve  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 3, 5, 7],
                        help="verified drafts per step (0: the plain engine)")
    parser.add_argument("--repeats", type=int, default=2)
    add_measurement_arguments(parser, num_prompts=4)
    args = parser.parse_args()
    target, _, drafter, prompts = load_measurement_setup(args)
    times: dict[int, list[float]] = {}
    verify = batching.DSparkEngine._verify

    def timed(self, lengths, drafts):
        started = time.perf_counter()
        out = verify(self, lengths, drafts)
        times.setdefault(1 + max(lengths), []).append(time.perf_counter() - started)
        return out

    batching.DSparkEngine._verify = timed
    for _ in range(args.repeats):
        for drafts in args.drafts:
            engine = (DSparkEngine(target, None, method="plain", max_concurrency=1) if drafts == 0 else
                      DSparkEngine(target, drafter, method="fixed", num_verify_tokens=drafts, max_concurrency=1))
            serve(engine, prompts, args.max_new_tokens)
    for width in sorted(times):
        print(f"width {width}: {len(times[width]):4d} steps, median {statistics.median(times[width]) * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
