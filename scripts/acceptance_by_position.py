"""Draft acceptance by position in the response: how often the first draft token of a round is accepted, by how
many tokens the response had before that round.

Every request drafts and verifies ``--verify`` tokens each round (the engine's fixed-length method), so each round
is a sample of the drafter at that point of its response. The realized gate (``DSparkEngine._representative``) keeps
the rounds at a response's first step out of the few that measure drafting, because this table shows them
accepted about twice as often as later ones:

    python scripts/acceptance_by_position.py --dtype bfloat16 --concurrency 16     # SmolLM2 + embedded drafter
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import SamplingParams, generate_batch  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup  # noqa: E402

BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24)  # response tokens before the round: 1 is the first step after the prompt


def bucket(tokens: int) -> int:
    return max(b for b in BUCKETS if b <= tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--verify", type=int, default=3, help="draft tokens verified per round (default 3)")
    add_measurement_arguments(parser)
    args = parser.parse_args()
    if args.verify < 1:
        parser.error("--verify must be >= 1")
    target, _, drafter, prompts = load_measurement_setup(args)
    result = generate_batch(target, prompts, drafter, SamplingParams(max_new_tokens=args.max_new_tokens),
                            method="fixed", num_verify_tokens=args.verify, max_concurrency=args.concurrency, seed=0)
    table = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0])  # rounds, first accepted, accepted, confidence, n
    for output in result.outputs:
        stats, before = output.stats, 1  # the prefill emitted the response's first token
        for verified, accepted, confidences in zip(stats.verified, stats.accepted, stats.confidences):
            if verified:
                row = table[bucket(before)]
                row[0] += 1
                row[1] += accepted >= 1
                row[2] += accepted
                if confidences:
                    row[3] += confidences[0]
                    row[4] += 1
            before += accepted + 1
    print(f"{'tokens before':>14s} {'rounds':>7s} {'first accepted':>15s} {'accepted / round':>17s} "
          f"{'first confidence':>17s}")
    for b in sorted(table):
        rounds, first, accepted, confidence, n = table[b]
        label = f"{b}" if b == BUCKETS[-1] or b + 1 == BUCKETS[BUCKETS.index(b) + 1] else \
            f"{b}-{BUCKETS[BUCKETS.index(b) + 1] - 1}"
        label = label + "+" if b == BUCKETS[-1] else label
        print(f"{label:>14s} {rounds:7d} {first / rounds:15.2f} {accepted / rounds:17.2f} "
              f"{(confidence / n if n else float('nan')):17.2f}")


if __name__ == "__main__":
    main()
