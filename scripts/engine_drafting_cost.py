"""What a drafting step of the batched engine costs, by part: the drafter's context catch-up (``flush``), its forward
and left-to-right sampling (``_draft``, of which ``sample_block``), and the verify forward, in ms per drafting step.

Every request drafts and verifies ``--verify`` tokens each step (the engine's fixed-length method), so each step is a
drafting step. Runs alternate between the engine as it is and one whose drafts are made to build their
full-vocabulary logits at once (as they did before ``DSparkDraft.draft_logits`` became lazy), so the two are compared
in the same process, back to back:

    python scripts/engine_drafting_cost.py --dtype bfloat16 --concurrency 16 --verify 1 --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from hf_dspark.engine import DSparkEngine, SamplingParams  # noqa: E402
from hf_dspark.engine.batching import DeferredDrafterContext  # noqa: E402
from hf_dspark.engine.bench import add_measurement_arguments, load_measurement_setup  # noqa: E402
from hf_dspark.modeling_dspark import DSparkDrafter  # noqa: E402

PARTS = (("flush", DeferredDrafterContext, "flush"), ("draft", DSparkEngine, "_draft"),
         ("sample_block", DSparkDrafter, "sample_block"), ("verify", DSparkEngine, "_verify"))


def timed(totals: dict, name: str, fn, eager: list):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        if name == "sample_block" and eager[0]:
            out.draft_logits  # noqa: B018 - building them is the point: the eager variant
        totals[name] += time.perf_counter() - started
        return out
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--verify", type=int, default=1, help="draft tokens verified per step (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    add_measurement_arguments(parser, num_prompts=32)
    args = parser.parse_args()
    if args.verify < 1 or args.repeats < 1 or args.concurrency < 1:
        parser.error("--verify, --repeats and --concurrency must be >= 1")
    target, _, drafter, prompts = load_measurement_setup(args)
    totals: dict[str, float] = collections.defaultdict(float)
    eager = [False]
    for name, owner, attribute in PARTS:
        setattr(owner, attribute, timed(totals, name, getattr(owner, attribute), eager))

    def run(n: int, new_tokens: int) -> tuple[int, float]:
        engine = DSparkEngine(target, drafter, method="fixed", num_verify_tokens=args.verify,
                              max_concurrency=args.concurrency)
        for prompt in prompts[:n]:
            engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens))
        started = time.perf_counter()
        engine.run()
        return sum(1 for d in engine.stats.drafting if d), time.perf_counter() - started

    run(min(4, len(prompts)), 8)  # warm-up
    results = {False: collections.defaultdict(list), True: collections.defaultdict(list)}
    for repeat in range(args.repeats):
        for variant in ((False, True) if repeat % 2 == 0 else (True, False)):
            eager[0] = variant
            totals.clear()
            steps, wall = run(len(prompts), args.max_new_tokens)
            for name, _, _ in PARTS:
                results[variant][name].append(1000 * totals[name] / steps)
            results[variant]["wall"].append(wall)
            print(f"{'eager' if variant else 'lazy '} full-vocabulary logits: {steps} drafting steps, wall {wall:.2f} s, "
                  + ", ".join(f"{name} {1000 * totals[name] / steps:.2f}" for name, _, _ in PARTS) + " ms/step",
                  flush=True)
    for name in [p[0] for p in PARTS] + ["wall"]:
        lazy, eager_ = statistics.median(results[False][name]), statistics.median(results[True][name])
        unit = "s" if name == "wall" else "ms/step"
        print(f"{name:12s} lazy {lazy:8.2f}  eager {eager_:8.2f} {unit}  (lazy/eager {lazy / eager_:.3f}, medians)")


if __name__ == "__main__":
    main()
