"""The per-round loop reads tensors back to the host only where it must.

Every ``.item()`` / ``.tolist()`` / ``bool()`` / ``int()`` / ``float()`` / ``nonzero()`` / ``.cpu()`` on a CUDA tensor
waits for the GPU to catch up; a round that does several stalls the launch queue several times. On CPU nothing
stalls, but the same calls are made, so counting them here (calls whose first frame outside torch is in the
``hf_dspark`` package) bounds what a GPU round pays. Budgets are per round and per draft source, the worst round of a
greedy generate() on a tiny target, measured and not rounded up: lowering a count means lowering its budget, and a new
read fails here with the call sites listed.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import sys
import time

import pytest
import torch

from hf_dspark.generation import DSparkCandidateGenerator
from tests.helpers import make_drafter, make_target, random_prompts

READS = ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"]
CHEAP_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}

# Host reads in the worst round of each source, per policy (its proposal, then its verdict's bookkeeping), with the
# 1 ms clock below. What they are (the per-site means are in the failure message):
#   every block round, generation.py _stats_lists: the confidences and their logits for the stats lists, stacked and
#     read in one .tolist(). Fixed needs nothing else: it knows its length.
#   a block round's length from a scheduling policy must reach the host to slice the candidates: the planner copies
#     the block's confidences to the host once (hf_dspark.planner: memories, the correction and the SPS table live
#     there, so every later read in the round is of host memory, no GPU sync), then Algorithm 1's admitted count and
#     the lengths' .tolist(), and the online correction's factors(). What the smoothed past confidences predict
#     (Planner._stale_prediction: Algorithm 1 again, its expected round two floats, the pay-off rule one) is
#     computed once per change of a memory, the correction or the table, and reused by the rounds in between.
#   hybrid, every round: prompt_lookup's one .tolist() of (match length, start), then Algorithm 1 over the lookup's
#     confidences, and (once the block has a prediction) its expected rate against the block's; a block round then
#     pays the scheduler's reads on top.
#   the last round (nothing left to draft) reads nothing.
BUDGETS = {
    "fixed": {"block": 1, "none": 0},
    "scheduler": {"block": 12, "none": 0},
    "hybrid": {"block": 15, "lookup": 13},
}


def _caller_site() -> str | None:
    """file:line of the first frame outside torch (and this file), if it is in the hf_dspark package."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None or "/hf_dspark/" not in frame.f_code.co_filename:
        return None
    return f"hf_dspark/{frame.f_code.co_filename.split('/hf_dspark/')[-1]}:{frame.f_lineno} {frame.f_code.co_name}"


@contextlib.contextmanager
def count_host_reads():
    """Yields (reads, starts): every host read from hf_dspark as ``(method, site)`` in call order, and the index into
    ``reads`` at each ``get_candidates`` call (the prefill, then one per round)."""
    reads: list[tuple[str, str]] = []
    starts: list[int] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    original_nonzero = torch.nonzero
    original_get_candidates = DSparkCandidateGenerator.get_candidates

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            site = _caller_site()
            if site is not None:
                reads.append((name, site))
            return fn(*args, **kwargs)
        return wrapper

    def get_candidates(self, *args, **kwargs):
        starts.append(len(reads))
        return original_get_candidates(self, *args, **kwargs)

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, counted(name, fn))
        torch.nonzero = counted("torch.nonzero", original_nonzero)
        DSparkCandidateGenerator.get_candidates = get_candidates
        yield reads, starts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = original_nonzero
        DSparkCandidateGenerator.get_candidates = original_get_candidates


def reads_per_round(target, drafter, prompt, monkeypatch, max_new_tokens: int = 40):
    """[(source, Counter of (method, site))] per round of one DSpark greedy generate()."""
    # The policies decide from measured seconds (drafter time, realized rates): a clock that ticks 1 ms per reading
    # makes the rounds' sources, and so the counts, the same on every run.
    ticks = itertools.count()
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-3)
    target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)  # warm-up
    with count_host_reads() as (reads, starts):
        target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter)
    monkeypatch.undo()
    sources = drafter.last_stats.sources
    assert len(starts) == len(sources) + 1, (len(starts), len(sources))  # the prefill call, then one per round
    bounds = starts[1:] + [len(reads)]
    return [(source, collections.Counter(reads[a:b])) for source, a, b in zip(sources, bounds, bounds[1:])]


def describe(rounds) -> str:
    """Reads per round by source and call site (mean over the source's rounds), for a failure message."""
    lines = []
    for source in sorted({s for s, _ in rounds}):
        mine = [c for s, c in rounds if s == source]
        total = sum(mine, collections.Counter())
        lines.append(f"  {source}: {len(mine)} rounds, max {max(sum(c.values()) for c in mine)} reads/round, "
                     f"mean {sum(total.values()) / len(mine):.2f}")
        for (method, site), n in sorted(total.items(), key=lambda kv: kv[0][1]):
            lines.append(f"    {n / len(mine):5.2f}/round  {method:14s} {site}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=7)
    prompt = random_prompts(1, 8, target.config.vocab_size, seed=1)[0]
    return target, drafter, torch.cat([prompt, prompt[:, :5], prompt], dim=1)  # repeated text: lookup fires in hybrid


@pytest.mark.parametrize("draft_round", ["eager", "static"])
@pytest.mark.parametrize("policy", sorted(BUDGETS))
def test_host_reads_per_round_stay_within_budget(setup, policy, draft_round, monkeypatch):
    """The static round (what a CUDA graph replays) reads nothing back itself: the same budgets hold."""
    target, drafter, prompt = setup
    drafter.generation_config.verification_policy = policy
    drafter.generation_config.draft_round = draft_round
    drafter.generation_config.sps_profile = CHEAP_VERIFY
    try:
        rounds = reads_per_round(target, drafter, prompt, monkeypatch)
    finally:
        drafter.generation_config.verification_policy = "fixed"
        drafter.generation_config.draft_round = "auto"
        del drafter.generation_config.sps_profile
    report = f"host reads from hf_dspark, policy {policy}, {draft_round} round:\n{describe(rounds)}"
    print(report)
    budget = BUDGETS[policy]
    assert {s for s, _ in rounds} <= set(budget), report
    for source, counts in rounds:
        assert sum(counts.values()) <= budget[source], f"a {source} round read {sum(counts.values())} > " \
                                                       f"{budget[source]}\n{report}"
