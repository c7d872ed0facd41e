"""``hf-dspark eval``: accepted length, position-wise acceptance, threshold sweep, calibration and speed against
plain generate(): report.json / report.md / plots, resumable and shardable."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..evaluation.settings import PHASES, EvalSettings
from .arguments import UsageError
from .common import TARGET_HELP, THREADS_HELP, DType, require_prompts, setup_target

HELP = ("evaluation report: tau, position-wise acceptance, threshold sweep, calibration, speed vs plain "
        "(report.json/.md + plots, resumable)")


@dataclass
class EvalJob:
    """Which models, where the report goes, and how the work is split."""

    output: str = field(metadata={"help": "report folder (re-run the same command to resume)"})
    target: str | None = field(default=None, metadata={"help": TARGET_HELP})
    drafter: str | None = field(default=None, metadata={"help": "DSpark drafter folder (default: the embedded "
                                                                "drafter)"})
    ablation: str | None = field(default=None, metadata={"help": "DFlash-ablation drafter folder, or 'none' "
                                                                 "(default: the embedded ablation for the default "
                                                                 "pair)"})
    dtype: DType = field(default="float32", metadata={"help": "weight dtype of target and drafters"})
    threads: int | None = field(default=None, metadata={"help": THREADS_HELP, "bounds": (1, None)})
    concurrency: int = field(default=1, metadata={
        "help": "quality phase: prompts served at once by the batched engine (several times faster on a CPU; the "
                "speed phase always times generate() prompt by prompt)", "bounds": (1, None)})
    num_shards: int | None = field(default=None, metadata={"help": "split the work over N processes (default: "
                                                                   "accelerate's)", "bounds": (1, None)})
    shard_index: int | None = field(default=None, metadata={"help": "this process's shard (0..num-shards-1)",
                                                            "bounds": (0, None)})
    phases: list[str] = field(default_factory=lambda: ["quality", "speed"], metadata={
        "help": "quality: acceptance analyses (whole-block rounds); speed: timed comparison (run it quiet)",
        "choices": PHASES})
    benchmarks: str | None = field(default=None, metadata={"help": "also write the Markdown report here (e.g. "
                                                                   "BENCHMARKS.md)"})
    benchmarks_include: list[str] = field(default_factory=list, metadata={
        "help": "generated reports (e.g. `hf-dspark bench --markdown`) appended to --benchmarks as sections",
        "metavar": "MARKDOWN"})
    render_only: bool = field(default=False, metadata={"help": "run nothing: rewrite report.md and --benchmarks "
                                                               "from OUTPUT/report.json (plots as they are)"})


SETTINGS = (EvalSettings, EvalJob)
# --render-only needs no prompts
DEFAULTS = {"data": None}


def check(settings: EvalSettings, job: EvalJob) -> None:
    """The included reports exist, the shard flags come together, and there are prompts (unless rendering)."""
    from ..evaluation.bench_report import included_markdown

    if job.benchmarks_include and not job.benchmarks:
        raise UsageError("--benchmarks-include needs --benchmarks (the page the reports are appended to)")
    for path in job.benchmarks_include:  # refused now, not after the evaluation has run
        if not Path(path).is_file():
            raise UsageError(f"--benchmarks-include: no such file {path}")
        try:
            included_markdown(path)
        except ValueError as err:
            raise UsageError(f"--benchmarks-include: {err}") from None
    if job.render_only:
        if not (Path(job.output) / "report.json").is_file():
            raise UsageError(f"--render-only: no {Path(job.output) / 'report.json'} (run the evaluation first)")
        return
    if not settings.data:
        raise UsageError("hf-dspark eval needs --data (unless --render-only)")
    if (job.num_shards is None) != (job.shard_index is None):
        raise UsageError("--num-shards and --shard-index go together")
    require_prompts(settings.data, "--data")


def run(settings: EvalSettings, job: EvalJob) -> int:
    if job.render_only:
        return _render(job)
    from ..evaluation.report import run_eval

    target, tokenizer, dtype = setup_target(job)
    drafter, origin, ablation, ablation_origin = _drafters(job, target, dtype)
    description = {"target": job.target or "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)", "drafter": origin,
                   "ablation": ablation_origin, "dtype": job.dtype}
    report = run_eval(target, tokenizer, drafter, job.output, settings, ablation=ablation,
                      num_shards=job.num_shards, shard_index=job.shard_index, description=description,
                      benchmarks_path=job.benchmarks, phases=job.phases, concurrency=job.concurrency,
                      benchmarks_include=job.benchmarks_include)
    for line in _summary_lines(report):
        print(line)
    print(f"wrote {job.output}/report.json, report.md and plots" + (f"; {job.benchmarks}" if job.benchmarks else ""))
    if report["missing"]:
        print(f"incomplete: {len(report['missing'])} units still to run (other shards or --phases): "
              + ", ".join(report["missing"]))
    return 0


def _render(job: EvalJob) -> int:
    """``--render-only``: report.md and --benchmarks rewritten from report.json, nothing run."""
    from ..evaluation.report import write_report

    report = json.loads((Path(job.output) / "report.json").read_text())
    write_report(report, Path(job.output), job.benchmarks, job.benchmarks_include, render_only=True)
    print(f"rewrote {job.output}/report.md" + (f" and {job.benchmarks}" if job.benchmarks else ""))
    return 0


def _drafters(job: EvalJob, target, dtype):
    """The DSpark drafter and the DFlash ablation (the embedded one for the default pair; none with 'none')."""
    from ..defaults import embedded_drafter_path, load_drafter_for

    drafter, origin = load_drafter_for(target, job.drafter, dtype=dtype)
    if job.ablation == "none":
        return drafter, origin, None, None
    path = job.ablation or (embedded_drafter_path("smollm2-135m-instruct-dflash")
                            if job.drafter is None and job.target is None else None)
    ablation, ablation_origin = load_drafter_for(target, str(path), dtype=dtype) if path else (None, None)
    return drafter, origin, ablation, ablation_origin


def _summary_lines(report: dict) -> list[str]:
    """Per temperature: the macro tau of each method (DSpark over DFlash) and the speedups against plain."""
    lines = []
    for t, entry in report["temperatures"].items():
        acc = entry.get("acceptance")
        if acc:
            macro = ", ".join(f"{m} {v['accepted_length']:.2f}" for m, v in acc["macro"].items())
            ratio = acc.get("tau_ratio_dspark_over_dflash", {}).get("macro")
            lines.append(f"T={t}: macro tau {macro}" + (f" (DSpark/DFlash {ratio:.3f}x)" if ratio else ""))
        if entry.get("speed"):
            cells = ", ".join(f"{m} {r['speedup']:.2f}x" for m, r in entry["speed"]["all"].items() if m != "plain")
            lines.append(f"T={t}: speed vs plain: {cells}")
    return lines
