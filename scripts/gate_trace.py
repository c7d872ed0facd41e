"""Trace the batched engine's drafting decisions during an ``hf-dspark bench-serve`` run.

Runs bench-serve with the given arguments and prints one line for every step in which a scheduled engine drafts:
the batch size, the rows drafting, the realized gate's verdict, and the rates it compared (``compared_rates``:
drafting against plain tokens per second at that batch size), with the round numbers behind them. It shows why the
gate let drafting run where a whole run then lost (session 30: at 16 requests its per-step rates said drafting
won while the runs that drafted were slower). It also prints, for every engine that drafts (scheduled or fixed),
each step's tokens counted both ways (``STEP`` lines: emitted, and ``batch_progress``, the realized gate's default
count), for the steps whose rows stay the same through the step (no admission).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/gate_trace.py --prompts ../shared/data/eval \
        --drafter hf_dspark/drafters/smollm2-135m-instruct-dspark --num-prompts 64 --max-new-tokens 32 \
        --dtype bfloat16 --threads 2 --concurrency 16 --lockstep pairs --methods plain scheduled --repeats 8 \
        --measurements reports/bench-serve-smollm2-bf16-epyc-s29-pairs.json --output /tmp/trace.json
"""

from __future__ import annotations

import math
import sys
import time

from hf_dspark.cli import main
from hf_dspark.engine import batching, batch_progress


def traced(drafting_rows):
    def wrapper(self, caps, capacity, representative=None):
        gate = self.measurements
        rows = len(caps)
        if representative is None:
            representative = self._representative()
        verdict = None
        if self.realized_gate:
            candidates = [i for i, cap in enumerate(caps) if cap > 0]
            verdict = gate.drafting_verdict(rows, self.explore_interval, self.max_explore_interval,
                                            self.explore_budget, representative, self._catch_up(candidates))
        chosen = drafting_rows(self, caps, capacity, representative)
        if chosen:
            drafting, plain = gate.compared_rates(rows) if self.realized_gate else (None, None)
            print(f"DRAFT R={rows} rows={len(chosen)} verdict={verdict} "
                  f"since={gate.steps_since.get((rows, True), 0)} compared=({drafting}, {plain}) "
                  f"plain_rounds={list(gate.round_numbers.get((rows, False), []))[-4:]} "
                  f"drafting_rounds={list(gate.round_numbers.get((rows, True), []))[-3:]} "
                  f"gate_tokens={self.gate_tokens}", flush=True)
        return chosen

    return wrapper


def counted(step):
    """A drafting engine's steps, tokens counted both ways (``gate_tokens``), with their seconds:
    ``STEP R=.. drafted=.. emitted=.. progress=.. seconds=..``."""

    def wrapper(self):
        free = (self.max_concurrency or math.inf) - self.num_active
        if self.method == "plain" or not self._rows or (self._waiting and free > 0):
            return step(self)  # a step that may admit: its rows change under it
        left = {r.request_id: r.remaining for r in self._rows}
        started = time.perf_counter()
        events = step(self)
        seconds = time.perf_counter() - started
        new = {e.request_id: len(e.token_ids) for e in events if e.request_id in left}
        progress = batch_progress(list(left.values()), [new[k] for k in left])
        print(f"STEP R={len(left)} drafted={bool(self.stats.drafting[-1])} emitted={sum(new.values())} "
              f"progress={progress} seconds={seconds:.4f}", flush=True)
        return events

    return wrapper


if __name__ == "__main__":
    batching.DSparkEngine._drafting_rows = traced(batching.DSparkEngine._drafting_rows)
    batching.DSparkEngine.step = counted(batching.DSparkEngine.step)
    sys.exit(main(["bench-serve", *sys.argv[1:]]))
