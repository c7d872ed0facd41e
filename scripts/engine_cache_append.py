"""What appending to the target cache in place saves: the plain engine with its in-place append (``_GrowingLayer``)
against the same engine appending by concatenation (transformers' ``DynamicLayer.update``: a fresh copy of every
layer's keys and values each step), round-robin, paired: tokens per second of whole runs, and decode steps per
second (prefill left out, as it does not append). Outputs are the same either way (checked). SmolLM2-135M:

    python scripts/engine_cache_append.py --concurrency 16 64 --repeats 6 --dtype bfloat16

``--concatenation-only`` times just what a step's concatenation copies, for SmolLM2-135M's 30 layers (3 key/value
heads of 64, keys and values) at ``rows x columns`` shapes, ten passes each, in a fresh process (the first passes
page-fault on fresh allocations):

    python scripts/engine_cache_append.py --concatenation-only --shapes 16x209 64x200 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers.cache_utils import DynamicLayer  # noqa: E402

from hf_dspark.engine import DSparkEngine  # noqa: E402
from hf_dspark.engine import batching  # noqa: E402
from hf_dspark.engine.bench import _format_ratios, add_measurement_arguments, against_baseline  # noqa: E402
from hf_dspark.engine.bench import load_measurement_setup, serve  # noqa: E402


@contextlib.contextmanager
def concatenating():
    """The engine's cache layers append as ``DynamicLayer`` does, for the comparison."""
    inplace = batching._GrowingLayer.update
    batching._GrowingLayer.update = DynamicLayer.update
    try:
        yield
    finally:
        batching._GrowingLayer.update = inplace


def concatenation_only(args) -> None:
    import time

    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for shape in args.shapes:
        rows, _, columns = shape.partition("x")
        if not (rows.isdigit() and columns.isdigit()):
            raise SystemExit(f"--shapes: expected ROWSxCOLUMNS, got {shape!r}")
        layers = [torch.randn(int(rows), 3, int(columns), 64, dtype=dtype) for _ in range(2 * 30)]
        column = torch.randn(int(rows), 3, 1, 64, dtype=dtype)
        times = []
        for _ in range(10):
            started = time.perf_counter()
            layers = [torch.cat([t, column], dim=-2) for t in layers]
            times.append(time.perf_counter() - started)
        print(f"{shape}: one step's concatenation {1000 * min(times):.1f} ms (fastest of 10), median "
              f"{1000 * sorted(times)[5]:.1f} ms, first pass {1000 * times[0]:.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--concatenation-only", action="store_true",
                        help="time only the per-step concatenation of a cache of each --shapes")
    parser.add_argument("--shapes", nargs="+", default=["16x209", "64x200"], help="ROWSxCOLUMNS")
    add_measurement_arguments(parser)
    args = parser.parse_args()
    if args.concatenation_only:
        concatenation_only(args)
        return
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 (the ratio is paired)")
    target, _, _, prompts = load_measurement_setup(args)
    modes = {"in place": contextlib.nullcontext, "concatenation": concatenating}
    for concurrency in args.concurrency:
        rates: dict[str, list[float]] = {name: [] for name in modes}
        step_rates: dict[str, list[float]] = {name: [] for name in modes}
        outputs: dict[str, list] = {}
        names = list(modes)
        for repeat in range(args.repeats):
            for name in names[repeat % 2:] + names[: repeat % 2]:  # alternate which runs first
                engine = DSparkEngine(target, None, method="plain", max_concurrency=concurrency, seed=0)
                with modes[name]():
                    tokens, wall = serve(engine, prompts, args.max_new_tokens)
                rates[name].append(tokens / wall)
                step_rates[name].append(engine.stats.steps / sum(engine.stats.seconds))
                outputs.setdefault(name, {k: o.token_ids for k, o in engine.outputs.items()})
                print(f"c={concurrency:<3d} {name:14s} {rates[name][-1]:7.1f} tok/s, "
                      f"{1000 / step_rates[name][-1]:6.1f} ms per decode step", flush=True)
        if outputs["in place"] != outputs["concatenation"]:
            raise RuntimeError("in-place append changed the outputs")
        ratios = against_baseline(rates["in place"], rates["concatenation"])
        print(f"c={concurrency:<3d} in place vs concatenation, tokens/s: {_format_ratios(ratios)}", flush=True)
        ratios = against_baseline(step_rates["in place"], step_rates["concatenation"])
        print(f"c={concurrency:<3d} in place vs concatenation, decode steps/s: {_format_ratios(ratios)}", flush=True)


if __name__ == "__main__":
    main()
