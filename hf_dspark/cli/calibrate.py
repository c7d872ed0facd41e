"""``hf-dspark calibrate``: Sequential Temperature Scaling of the confidence head on held-out rollouts."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from transformers.hf_argparser import HfArg

from ..prompts import SAMPLINGS
from .common import DRAFTER_HELP, EXCLUDE_HELP, SEED_HELP, TARGET_HELP, THREADS_HELP, DType, require_prompts
from .common import setup_target

HELP = "Sequential Temperature Scaling of the confidence head (writes the calibrated drafter, sts.json, a plot)"


@dataclass
class CalibrateSettings:
    prompts: list[str] = HfArg(help="calibration prompt .jsonl files or folders (disjoint from train/eval)")
    output: str = HfArg(help="folder for the calibrated drafter, sts.json, plot; finished rollouts are kept in "
                             "OUTPUT/rollouts.partial.jsonl until the end, and a rerun resumes from them")
    drafter: str | None = HfArg(default=None, help=DRAFTER_HELP)
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    exclude: list[str] = HfArg(default_factory=list, help=EXCLUDE_HELP, metadata={"nargs": "*"})
    num_prompts: int = HfArg(default=100, help="prompts rolled out", metadata={"bounds": (1, None)})
    sampling: str = HfArg(default="balanced", help="balanced: the same number of prompts from each set (as far as "
                          "each set allows); shuffled: a uniform sample of all prompts, so big sets dominate",
                          metadata={"choices": SAMPLINGS})
    cv_folds: int = HfArg(default=5, help="report held-out ECE by this many folds over prompts (0: skip)",
                          metadata={"bounds": (0, None)})
    max_new_tokens: int = HfArg(default=128, help="tokens generated per turn", metadata={"bounds": (1, None)})
    temperature: float = HfArg(default=0.0, help="sampling temperature (0: greedy)", metadata={"bounds": (0, None)})
    dtype: DType = HfArg(default="float32", help="weight dtype of target and drafter")
    seed: int = HfArg(default=0, help=SEED_HELP)
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    concurrency: int = HfArg(default=16, help="prompts rolled out at once by the batched engine (1: generate() "
                             "prompt by prompt)", metadata={"bounds": (1, None)})


SETTINGS = (CalibrateSettings,)


def check(settings: CalibrateSettings) -> None:
    require_prompts(settings.prompts, "--prompts")


def run(settings: CalibrateSettings) -> int:
    """Fits the temperatures, writes the calibrated drafter, sts.json, the reliability plot and a report."""
    from ..calibration import ROLLOUT_CHECKPOINT, collect_rollouts, cross_validated_sts, fit_sts
    from ..defaults import load_drafter_for

    target, tokenizer, dtype = setup_target(settings)
    drafter, origin = load_drafter_for(target, settings.drafter, dtype=dtype)
    if drafter.confidence_head is None:
        raise ValueError(f"{origin} has no confidence head to calibrate")
    records = _records(settings)
    drafter.config.confidence_temperatures = None
    output = Path(settings.output)
    checkpoint = output / ROLLOUT_CHECKPOINT  # finished records survive an interruption; a rerun resumes
    key = {"drafter": str(origin), "prompts": [str(p) for p in settings.prompts], "dtype": settings.dtype}
    rollouts = collect_rollouts(target, tokenizer, drafter, records, settings.max_new_tokens, settings.temperature,
                                settings.seed, concurrency=settings.concurrency, checkpoint=checkpoint,
                                checkpoint_key=key)
    fit = fit_sts(rollouts)
    if settings.cv_folds:
        fit["cross_validation"] = cross_validated_sts(rollouts, settings.cv_folds, seed=settings.seed)
    _write(settings, drafter, records, rollouts, fit)
    checkpoint.unlink()  # the report holds every round now
    for line in _fit_lines(fit, settings.cv_folds):
        print(line)
    return 0


def _records(settings: CalibrateSettings) -> list[dict]:
    """The calibration prompts: loaded, the excluded ones dropped, sampled."""
    from ..prompts import excluded_prompt_ids, load_prompts, sample_prompts

    excluded = excluded_prompt_ids(settings.exclude)
    records = [r for r in load_prompts(settings.prompts) if r["id"] not in excluded]
    return sample_prompts(records, settings.num_prompts, settings.sampling, settings.seed)


def _write(settings: CalibrateSettings, drafter, records, rollouts, fit) -> None:
    """The calibrated drafter, sts.json, reliability.png and calibration_report.json in ``settings.output``."""
    from ..calibration import reliability_diagram, write_sts

    output = Path(settings.output)
    output.mkdir(parents=True, exist_ok=True)
    drafter.config.confidence_temperatures = fit["temperatures"]
    drafter.save_pretrained(output)
    write_sts(output, fit, ",".join(sorted({r["set"] for r in records})))
    reliability_diagram(rollouts, fit["temperatures"], output / "reliability.png")
    (output / "calibration_report.json").write_text(json.dumps({
        "fit": fit, "rollouts": rollouts.to_dict(), "prompts": len(records),
        "prompt_ids": [r["id"] for r in records],
        "settings": {"max_new_tokens": settings.max_new_tokens, "temperature": settings.temperature,
                     "dtype": settings.dtype, "seed": settings.seed, "concurrency": settings.concurrency,
                     "sampling": settings.sampling, "cv_folds": settings.cv_folds},
        "sets": dict(sorted(Counter(r["set"] for r in records).items()))}, indent=2))


def _fit_lines(fit: dict, cv_folds: int) -> list[str]:
    """Per position: the temperature, ECE before -> after (held out), AUC and samples."""
    def fmt(x):
        return "n/a" if x is None else f"{x:.4f}"

    heldout = fit.get("cross_validation", {}).get("ece_after") or [None] * len(fit["temperatures"])
    lines = []
    for k, (t, before, after, cv, auc) in enumerate(zip(fit["temperatures"], fit["ece_before"], fit["ece_after"],
                                                        heldout, fit["auc"]), 1):
        cv_text = f" (held out {fmt(cv)})" if cv_folds else ""
        lines.append(f"position {k}: T={t:.3f} ECE {fmt(before)} -> {fmt(after)}{cv_text} AUC {fmt(auc)} "
                     f"n={fit['num_samples'][k-1]}")
    return lines
