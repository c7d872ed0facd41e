"""``generate()``'s drafting decisions with every input that depends on timing held fixed: per round, the source that
drafted (block, lookup, none), how many drafts the target verified and accepted, and the outputs.

``target.generate(assistant_model=drafter)`` decides from the drafts' confidences, the SPS profile, and the drafter's
measured time per block (the pay-off rule). This script prices every round with one given profile and runs under a
clock that advances by ``--tick`` seconds each time it is read, so the drafter's measured time is the same in every run
and every version; what is left is deterministic, and two checkouts whose decision rules agree write the same trace
and the same digest (the counterpart of ``scripts/engine_decisions.py`` for the batched engine).

    python scripts/generate_decisions.py --sps PROFILE.json --output new.json
    python scripts/generate_decisions.py --sps PROFILE.json --output old.json --tree /path/to/older/checkout

``--sps``: a single-sequence SPS profile as ``hf_dspark.profiling`` caches it (``~/.cache/hf_dspark/profiles/sps-*.json``,
its ``profile``), or the profile's dict itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decision_traces import add_arguments, checked_inputs, digest, load_run, weights_digest  # noqa: E402

POLICIES = ("hybrid", "scheduler")
# What generate() calls with one drafter and target share (``generation.realized_gate_for``, ``lookup_survival_for``).
SHARED_ESTIMATES = ("_dspark_realized_gates", "_dspark_lookup_survival")


class TickingClock:
    """``time.perf_counter``'s stand-in: each read returns the last value plus ``tick`` seconds."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def decision_trace(target, drafter, prompts: list[list[int]], profile: dict, policy: str, max_new_tokens: int = 32,
                   tick: float = 0.005) -> dict:
    """Greedy ``generate(assistant_model=drafter)`` over ``prompts`` under ``policy`` priced by ``profile`` (an SPS
    profile's dict), reading a ``TickingClock``; each round's source, verified and accepted drafts, and the outputs."""
    import torch

    config = drafter.generation_config
    config.verification_policy, config.sps_profile = policy, profile
    for shared in SHARED_ESTIMATES:  # start them afresh: the trace must not depend on what ran before it
        drafter.__dict__.pop(shared, None)
    rounds, outputs = [], []
    real_clock = time.perf_counter
    time.perf_counter = TickingClock(tick)
    try:
        for ids in prompts:
            with torch.no_grad():
                out = target.generate(torch.tensor([ids]), assistant_model=drafter, max_new_tokens=max_new_tokens,
                                      do_sample=False)
            stats = drafter.last_stats
            rounds.append([list(stats.sources), list(stats.verified), list(stats.accepted)])
            outputs.append(out[0, len(ids):].tolist())
    finally:
        time.perf_counter = real_clock
    trace = {"policy": policy, "rounds": rounds, "outputs": outputs}
    trace["decisions_digest"] = digest(rounds)
    trace["outputs_digest"] = digest(outputs)
    return trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "single-sequence SPS profile JSON", num_prompts=8, max_new_tokens=48)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--tick", type=float, default=0.005, help="seconds the clock advances per read")
    args = parser.parse_args(argv)
    data, drafter_weights = checked_inputs(parser, args, ("num_prompts", "max_new_tokens", "threads"))
    if not args.tick > 0:
        parser.error("--tick must be > 0")
    profile = data.get("profile", data)
    if "sample_batch_tokens" not in profile:
        parser.error(f"--sps {args.sps}: not a single-sequence SPS profile (no 'sample_batch_tokens')")

    hf_dspark, target, drafter, prompts = load_run(args)
    traces = [decision_trace(target, drafter, prompts, profile, policy, args.max_new_tokens, args.tick)
              for policy in args.policies]
    result = {"package": str(Path(hf_dspark.__file__).parent),
              "drafter_weights_sha256": weights_digest(drafter_weights),
              "traces": traces}
    Path(args.output).write_text(json.dumps(result) + "\n")
    for trace in traces:
        sources = [source for prompt in trace["rounds"] for source in prompt[0]]
        print(f"{result['package']} {trace['policy']}: {len(sources)} rounds "
              f"({', '.join(f'{s} {sources.count(s)}' for s in sorted(set(sources)))}), "
              f"decisions {trace['decisions_digest']}, outputs {trace['outputs_digest']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
