"""Does a step cost more right after a switch between drafting and plain decoding? Step times by transition.

A scheduled engine serves ``--concurrency`` requests while a fixed pattern decides which steps draft (every row with
room drafts on a ``D``, none on a ``P``; the scheduler's own decisions, the realized gate and the admission hold are
off). Steps are grouped by (previous step's side, this step's side): ``PP``, ``PD`` (the first drafting step after
plain ones, which first catches the drafter's context up), ``DD``, ``DP``; each group's median and mean step time are
printed, with the compactions the steps ran. The step-by-step times also show how the machine's speed drifts during
the run. SmolLM2-135M + embedded drafter:

    python scripts/engine_step_transitions.py --concurrency 16 --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine, SamplingParams  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--pattern", default="PPPPDPPPPDDPPPP" * 8,
                        help="D (every row drafts) or P (none does) per step, after two warm-up steps")
    add_measurement_arguments(parser, max_new_tokens=400)
    args = parser.parse_args()
    if not args.pattern or set(args.pattern) - {"D", "P"}:
        parser.error(f"--pattern takes only D and P, got {args.pattern!r}")
    target, _, drafter, prompts = load_measurement_setup(args)
    if len(prompts) < args.concurrency:
        parser.error(f"{len(prompts)} prompts for --concurrency {args.concurrency}")
    most = sum(drafter.config.block_size + 1 if side == "D" else 1 for side in args.pattern) + 2
    if args.max_new_tokens <= most:
        parser.error("--max-new-tokens too small for the pattern: every request must stay active throughout")

    class Patterned(DSparkEngine):
        draft_now = False

        def _drafting_rows(self, caps, capacity, representative=None):
            return [i for i, cap in enumerate(caps) if cap > 0] if self.draft_now else []

    engine = Patterned(target, drafter, method="scheduled", max_concurrency=args.concurrency, realized_gate=False,
                       cost_aware=False, admission_hold=0)
    for prompt in prompts[: args.concurrency]:
        engine.add_request(prompt, SamplingParams(max_new_tokens=args.max_new_tokens))
    engine.step()
    engine.step()
    records, previous = [], "P"
    for side in args.pattern:
        engine.draft_now = side == "D"
        compactions = engine.stats.compactions
        engine.step()
        records.append((previous + side, engine.stats.seconds[-1], engine.stats.compactions - compactions))
        previous = side
    groups: dict[str, list[float]] = {}
    for key, seconds, _ in records:
        groups.setdefault(key, []).append(seconds)
    for key, times in sorted(groups.items()):
        print(f"{key}  steps {len(times):4d}  median {1e3 * statistics.median(times):7.1f} ms  "
              f"mean {1e3 * statistics.fmean(times):7.1f} ms")
    print(f"compactions: {sum(c for _, _, c in records)}")
    print("step times (ms):", " ".join(f"{key}:{1e3 * s:.0f}" for key, s, _ in records))


if __name__ == "__main__":
    main()
