"""The statistics and the plot of ``hf-dspark bench-serve``: a policy's throughput against the plain baseline's, from
round-robin repeats (``against_baseline``) or from requests served back to back (``against_baseline_by_request``),
with their standard errors, and the throughput and verification budget against concurrency (``plot_bench``). Pure
functions over numbers and the report; the runs themselves are ``engine_bench``'s."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

from .figures import pyplot, save_figure


def against_baseline(runs: list[float], baseline_runs: list[float]) -> dict:
    """A method's tokens/s runs against the baseline's from the same round-robin repeats: ratio of the fastest runs,
    of the means, and per repeat (run k of each ran back to back, so a drift of a shared machine hits both alike),
    with the geometric mean of those paired ratios and its standard error (``paired_se_factor``: exp of the standard
    error of the mean log ratio, so the geometric mean is known to about x/÷ that factor; None with one repeat). One
    lucky run moves the first; the last two average it out."""
    if len(runs) != len(baseline_runs) or not runs:
        raise ValueError(f"need the same number of runs on both sides, got {len(runs)} and {len(baseline_runs)}")
    paired = [a / b for a, b in zip(runs, baseline_runs)]
    logs = [math.log(r) for r in paired]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else None
    return {"best": max(runs) / max(baseline_runs),
            "mean": statistics.fmean(runs) / statistics.fmean(baseline_runs),
            "paired": paired,
            "paired_geomean": statistics.geometric_mean(paired),
            "paired_se_factor": None if se is None else math.exp(se)}


def _format_ratios(ratios: dict) -> str:
    se = "" if ratios["paired_se_factor"] is None else f", s.e. x/÷{ratios['paired_se_factor']:.3f}"
    return (f"best {ratios['best']:.3f}x, mean {ratios['mean']:.3f}x, paired {ratios['paired_geomean']:.3f}x "
            f"({min(ratios['paired']):.3f}-{max(ratios['paired']):.3f}{se})")


def against_baseline_by_request(tokens: list[int], seconds: list[float], baseline_tokens: list[int],
                                baseline_seconds: list[float], groups: list | None = None, resamples: int = 2000,
                                seed: int = 0) -> dict:
    """A method's requests against the baseline's same requests, each pair served back to back (``bench_interleaved``),
    so a drift of a shared machine hits both sides of a pair alike:

    - ``aggregate``: the ratio of aggregate throughputs, sum(tokens) / sum(seconds) on each side;
    - ``per_request_geomean``: the geometric mean over groups of each group's geometric mean of its pairs' tokens/s
      ratios (with groups of one pair, or all of one size, simply the pairs' geometric mean), and the pairs' range.

    Their standard errors (``aggregate_se_factor``, ``per_request_se_factor``: x/÷ factors) treat ``groups`` (a label
    per pair; default: every pair its own) as the independent units: pairs of the same prompt in several passes share
    that prompt's effect, so they are resampled together. The aggregate's is the spread of its log over ``resamples``
    bootstrap resamples of the groups (None with one group or fewer than two resamples); the per-request one, the
    standard error of the mean of the groups' mean log ratios (None with one group).
    """
    n = len(tokens)
    groups = list(range(n)) if groups is None else list(groups)
    if not n or any(len(v) != n for v in (seconds, baseline_tokens, baseline_seconds, groups)):
        raise ValueError(f"need the same requests on both sides, got {len(tokens)}, {len(seconds)}, "
                         f"{len(baseline_tokens)} and {len(baseline_seconds)} entries and {len(groups)} group labels")
    if min(*seconds, *baseline_seconds) <= 0 or min(*tokens, *baseline_tokens) <= 0:
        raise ValueError("every request needs tokens and a positive time on both sides")
    members: dict = {}
    for i, label in enumerate(groups):
        members.setdefault(label, []).append(i)
    clusters = list(members.values())

    def aggregate(index) -> float:
        return (sum(tokens[i] for i in index) / sum(seconds[i] for i in index)) / (
            sum(baseline_tokens[i] for i in index) / sum(baseline_seconds[i] for i in index))

    rng = random.Random(seed)
    boot = ([math.log(aggregate([i for _ in clusters for i in rng.choice(clusters)])) for _ in range(resamples)]
            if len(clusters) > 1 else [])
    logs = [math.log((t / s) / (bt / bs)) for t, s, bt, bs in zip(tokens, seconds, baseline_tokens, baseline_seconds)]
    means = [statistics.fmean(logs[i] for i in cluster) for cluster in clusters]
    return {"requests": n,
            "groups": len(clusters),
            "aggregate": aggregate(range(n)),
            "aggregate_se_factor": math.exp(statistics.stdev(boot)) if len(boot) > 1 else None,
            "per_request_geomean": math.exp(statistics.fmean(means)),
            "per_request_se_factor": (math.exp(statistics.stdev(means) / math.sqrt(len(means)))
                                      if len(means) > 1 else None),
            "per_request_range": [math.exp(min(logs)), math.exp(max(logs))]}


def _format_request_ratios(ratios: dict) -> str:
    def se(key):
        return "" if ratios[key] is None else f" x/÷{ratios[key]:.3f}"

    low, high = ratios["per_request_range"]
    return (f"aggregate {ratios['aggregate']:.3f}x{se('aggregate_se_factor')}, per request "
            f"{ratios['per_request_geomean']:.3f}x{se('per_request_se_factor')} ({low:.2f}-{high:.2f}), "
            f"{ratios['requests']} pairs of {ratios['groups']} prompts")


def plot_bench(report: dict, path: str | Path) -> Path:
    """Aggregate tokens/s, per-request tokens/s and mean verification budget per step vs concurrency."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, per_c in report["results"].items():
        xs = sorted(int(c) for c in per_c)
        rows = [per_c[str(c)] for c in xs]
        axes[0].plot(xs, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        axes[1].plot(xs, [r["per_request_tokens_per_s"]["mean"] for r in rows], marker="o", label=name)
        axes[2].plot(xs, [r["mean_verify_tokens_per_step"] for r in rows], marker="o", label=name)
    titles = ["aggregate throughput (tokens/s)", "per-request speed (tokens/s, mean)",
              "mean verification budget (draft tokens / step)"]
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    return save_figure(fig, path, dpi=120)


__all__ = ["against_baseline", "against_baseline_by_request", "plot_bench"]
