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
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_decisions import DRAFTER, digest, import_package  # noqa: E402

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
    parser.add_argument("--sps", required=True, help="single-sequence SPS profile JSON")
    parser.add_argument("--output", required=True, help="trace JSON to write")
    parser.add_argument("--tree", help="checkout whose hf_dspark to import (default: the installed package)")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"),
                        help="prompt files or folders (default: ../shared/data/eval)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--tick", type=float, default=0.005, help="seconds the clock advances per read")
    parser.add_argument("--drafter", default=str(DRAFTER),
                        help="drafter folder both versions load (default: this checkout's embedded DSpark drafter)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for flag in ("num_prompts", "max_new_tokens", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not args.tick > 0:
        parser.error("--tick must be > 0")
    sps_path = Path(args.sps)
    if not sps_path.is_file():
        parser.error(f"--sps {args.sps}: no such file")
    drafter_weights = Path(args.drafter) / "model.safetensors"
    if not drafter_weights.is_file():
        parser.error(f"--drafter {args.drafter}: no model.safetensors there")
    data = json.loads(sps_path.read_text())
    profile = data.get("profile", data)
    if "sample_batch_tokens" not in profile:
        parser.error(f"--sps {args.sps}: not a single-sequence SPS profile (no 'sample_batch_tokens')")

    hf_dspark = import_package(args.tree)
    import torch

    from hf_dspark.defaults import load_drafter_for
    from hf_dspark.prompts import load_prompts

    try:
        from hf_dspark.evaluation.engine_bench import encode_prompts
    except ImportError:  # a --tree from before the bench moved out of engine/
        from hf_dspark.engine.bench import encode_prompts

    torch.set_num_threads(args.threads)
    target, tokenizer, _ = hf_dspark.load_default(dtype=torch.float32)
    drafter, _ = load_drafter_for(target, args.drafter, dtype=torch.float32)
    prompts = [ids for _, ids in encode_prompts(tokenizer, load_prompts([args.prompts]), args.num_prompts)]
    traces = [decision_trace(target, drafter, prompts, profile, policy, args.max_new_tokens, args.tick)
              for policy in args.policies]
    result = {"package": str(Path(hf_dspark.__file__).parent),
              "drafter_weights_sha256": hashlib.sha256(drafter_weights.read_bytes()).hexdigest()[:12],
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
