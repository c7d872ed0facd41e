"""The scheduled engine's own overhead: plain engine vs the scheduled engine with drafting priced out, side by side.

The scheduled engine gets an SPS profile where verifying any draft is prohibitive, so it never drafts (not even a
probe) and decodes exactly like plain; what remains between the two is the scheduled engine's bookkeeping (the
target features it keeps for the drafter, the scheduling decisions). The two engines serve the same prompts side by
side (``bench-serve --lockstep``'s stepping), and each repeat gives the ratio of their speeds over their own steps
(admissions included), and where each engine's time went: prefill (admissions), decisions (``stats.draft_s``:
scheduling and any drafting), verification forwards, and the rest of its steps (bookkeeping).

``--gate``: instead of the prohibitive profile, the scheduled engine runs as ``bench-serve`` runs it (the profiled
SPS, repriced by measured steps) sharing one ``EngineMeasurements`` across repeats, after one learning run (not
counted) in which the realized gate measures drafting at this concurrency; where the gate has ruled drafting out,
this is the overhead of the gate's path (a re-measurement that drafts is reported on its repeat's line). glibc
malloc's thresholds are pinned, and 3 GiB of heap pre-touched, as ``bench-serve`` does (``fix_allocator``) unless
``--dynamic-allocator`` (or ``--pretouch 0``). Each engine's page faults over its own steps are shown.
SmolLM2-135M + embedded drafter:

    python scripts/engine_overhead.py --concurrency 16 --repeats 3 --dtype bfloat16
    python scripts/engine_overhead.py --concurrency 16 --repeats 6 --dtype bfloat16 --gate
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import SamplingParams  # noqa: E402
from hf_dspark.engine.bench import (BENCH_PRETOUCH_MIB, add_measurement_arguments, drafting_steps,  # noqa: E402
                                   fix_allocator, load_measurement_setup, pretouch_setting, run_lockstep,
                                   run_once)
from hf_dspark.engine.measurements import EngineMeasurements  # noqa: E402
from hf_dspark.profiling import BatchedStepsPerSecond, load_or_profile_batched  # noqa: E402
from hf_dspark.scheduling import StepsPerSecond  # noqa: E402


PHASES = ("prefill_s", "draft_s", "verify_s")


def _phases(summary: dict) -> dict[str, float]:
    """One run's seconds by phase: prefill, decisions (and drafting), verification, the rest of its steps."""
    phases = {name: summary[name] for name in PHASES}
    phases["other_s"] = summary["wall_s"] - sum(phases.values())
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gate", action="store_true",
                        help="the profiled SPS and a learned realized gate instead of a prohibitive profile")
    parser.add_argument("--dynamic-allocator", action="store_true",
                        help="leave glibc malloc's thresholds adjusting themselves (bench-serve's option)")
    parser.add_argument("--pretouch", type=int, default=None, metavar="MIB",
                        help=f"heap pre-touched once the thresholds are pinned (bench-serve's option; default "
                             f"{BENCH_PRETOUCH_MIB} MiB, 0: none)")
    add_measurement_arguments(parser)
    args = parser.parse_args()
    pretouch = pretouch_setting(args.dynamic_allocator, args.pretouch)
    allocator = None if pretouch is None else fix_allocator(pretouch=pretouch)
    print(f"allocator: {allocator or 'as the C library sets it'}", flush=True)
    target, _, drafter, prompts = load_measurement_setup(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    sizes = sorted({1 << k for k in range(args.concurrency.bit_length())} | {args.concurrency})
    label = "scheduled, gated" if args.gate else "scheduled, drafting priced out"
    measured = {}
    if args.gate:
        sps = load_or_profile_batched(target, sizes, drafter.config.block_size + 1,
                                      hidden_state_indices=drafter.target_hidden_states_indices())
        specs = {"plain": {"method": "plain"}, label: {"method": "scheduled"}}  # adapt_sps, as bench-serve
        measured[label] = EngineMeasurements()
        learning, _ = run_once(target, drafter, prompts, params, args.concurrency, specs[label], sps,
                               measurements=measured[label])
        print(f"learning run: {learning['tokens_per_s']:.1f} tok/s, {drafting_steps(learning)} drafting steps",
              flush=True)
    else:
        sps = BatchedStepsPerSecond({r: StepsPerSecond([r, 2 * r, 8 * r], [10.0, 1e-3, 1e-4]) for r in sizes})
        specs = {"plain": {"method": "plain"}, label: {"method": "scheduled", "adapt_sps": False}}  # as given
    ratios, gaps = [], {name: [] for name in (*PHASES, "other_s")}
    for repeat in range(args.repeats):
        # bench-serve --lockstep's stepping: the engine furthest behind steps next, each timed on its own steps
        # (admissions included); both do the same work step for step, so they alternate
        runs = run_lockstep(target, drafter, prompts, params, args.concurrency, specs, sps=sps, measured=measured,
                            shift=repeat)
        (plain, _), (scheduled, _) = runs["plain"], runs[label]
        drafted = drafting_steps(scheduled)
        if drafted and not args.gate:
            raise RuntimeError("the scheduled engine drafted: the prohibitive profile did not hold")
        ratios.append(scheduled["tokens_per_s"] / plain["tokens_per_s"])
        mine, base = _phases(scheduled), _phases(plain)
        if not drafted:
            for name in gaps:
                gaps[name].append(mine[name] - base[name])
        engines = "  ".join(
            f"{name} {summary['wall_s']:6.2f} s (" + " ".join(f"{k[:-2]} {v:5.2f}" for k, v in _phases(summary).items())
            + f", {summary['page_faults']} page faults)" for name, (summary, _) in runs.items())
        print(f"repeat {repeat}: {engines}  scheduled / plain speed {ratios[-1]:.4f}"
              + (f"  ({drafted} drafting steps)" if drafted else ""), flush=True)
    logs = [math.log(r) for r in ratios]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    print(f"{label} / plain: geometric mean {math.exp(statistics.fmean(logs)):.4f} "
          f"x/÷ {math.exp(se):.4f} over {len(ratios)} paired repeats")
    if gaps["other_s"]:
        print(f"scheduled - plain seconds per run, mean over the {len(gaps['other_s'])} repeats without drafting: "
              + "  ".join(f"{k[:-2]} {statistics.fmean(v):+.3f}" for k, v in gaps.items()))


if __name__ == "__main__":
    main()
