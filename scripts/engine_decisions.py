"""The batched engine's decisions with every input that depends on timing held fixed: which steps draft, how many
drafts each request verifies, what each step emits, and the outputs.

A scheduled engine decides from the drafts' confidences, the SPS profile, and timings it measures as it runs (the
realized gate, the cost check, the repricing of the profile). Two runs of the same code differ through the timings
alone, so comparing the speed of two versions cannot tell a changed rule from a noisy machine. This script turns the
timing-fed parts off (``realized_gate``, ``cost_aware``, ``adapt_sps``) and prices every step with one given profile;
what is left (confidences, the online survival correction, Algorithm 1, caps, admission) is deterministic, so two
checkouts whose decision rules agree write the same trace and the same digest.

    python scripts/engine_decisions.py --sps PROFILE.json --output new.json
    python scripts/engine_decisions.py --sps PROFILE.json --output old.json --tree /path/to/older/checkout

``--sps``: a batched SPS profile as ``hf_dspark.profiling.load_or_profile_batched`` caches it (the ``curves`` of
``~/.cache/hf_dspark/profiles/sps-batched-*.json``). ``--tree``: a checkout whose ``hf_dspark`` is imported instead
of the installed one, for an older version of the package; its engine must take ``realized_gate``, ``cost_aware``
and ``adapt_sps``, and it must have ``load_default``, ``defaults.load_drafter_for`` and ``prompts.load_prompts``.
``--drafter``: the drafter folder both runs load (default: this checkout's embedded DSpark drafter), so that weights
a checkout embeds differently do not pass for a changed rule; its weights' digest is part of the trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decision_traces import add_arguments, checked_inputs, digest, load_run, weights_digest  # noqa: E402

TIMING_FREE = {"realized_gate": False, "cost_aware": False, "adapt_sps": False}
METHOD = "scheduled"  # the scheduler's engine name in every version of the engine (later ones also read "scheduler")


def decision_trace(target, drafter, prompts: list[list[int]], sps, method: str = METHOD, concurrency: int = 1,
                   max_new_tokens: int = 16) -> dict:
    """Serve ``prompts`` greedily with the engine's ``method`` priced by ``sps`` (a ``BatchedStepsPerSecond``), the
    timing-fed decisions off; returns each step's drafting rows, verified drafts and emitted tokens, the outputs, and
    a digest of the decisions."""
    from hf_dspark.engine import SamplingParams, generate_batch

    try:
        result = generate_batch(target, prompts, drafter, SamplingParams(max_new_tokens=max_new_tokens),
                                method=method, sps=sps, max_concurrency=concurrency, **TIMING_FREE)
    except TypeError as error:  # an engine older than one of TIMING_FREE's settings
        raise SystemExit(f"this engine cannot turn its timing-fed decisions off ({error}); it needs "
                         f"{sorted(TIMING_FREE)}") from error
    stats = result.stats
    trace = {"drafting": list(stats.drafting), "verify_tokens": list(stats.verify_tokens),
             "emitted": list(stats.emitted), "outputs": [output.token_ids for output in result.outputs]}
    trace["decisions_digest"] = digest([trace["drafting"], trace["verify_tokens"], trace["emitted"]])
    trace["outputs_digest"] = digest(trace["outputs"])
    return trace


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "batched SPS profile JSON (with 'curves')", num_prompts=16, max_new_tokens=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--method", default=METHOD,
                        help=f"engine method (default {METHOD!r}, which every version of the engine reads)")
    args = parser.parse_args(argv)
    data, drafter_weights = checked_inputs(parser, args, ("num_prompts", "max_new_tokens", "concurrency", "threads"))
    if "curves" not in data:
        parser.error(f"--sps {args.sps}: not a batched SPS profile (no 'curves')")

    hf_dspark, target, drafter, prompts = load_run(args)
    from hf_dspark.profiling import BatchedStepsPerSecond

    sps = BatchedStepsPerSecond.from_dict({"curves": data["curves"]})
    trace = decision_trace(target, drafter, prompts, sps, args.method, args.concurrency, args.max_new_tokens)
    trace["package"] = str(Path(hf_dspark.__file__).parent)
    trace["drafter_weights_sha256"] = weights_digest(drafter_weights)
    Path(args.output).write_text(json.dumps(trace) + "\n")
    print(f"{trace['package']} (drafter weights {trace['drafter_weights_sha256']}): {len(trace['verify_tokens'])} "
          f"steps, {sum(trace['verify_tokens'])} drafts verified, decisions {trace['decisions_digest']}, "
          f"outputs {trace['outputs_digest']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
