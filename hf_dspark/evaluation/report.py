"""``hf-dspark eval``: the paper's analyses over prompt sets, resumable per (temperature, prompt set), shardable.

Two phases per unit of work (one temperature x one prompt set):

- *quality*: the DSpark drafter and the DFlash ablation (if given) verify their WHOLE block every round on the
  first ``num_prompts`` prompts, so every position's acceptance is observed. Accepted length, position-wise
  acceptance, the static-threshold sweep and calibration all come from these rounds.
- *speed*: on the first ``speed_prompts`` prompts, plain ``generate()`` and every accelerated method run
  interleaved prompt by prompt; speed is reported as tokens/s ratios to plain in the same run.

Each finished unit is written to ``<output>/units/<unit>.json`` (a rerun skips it). Units are dealt round-robin to
``num_shards`` processes (``accelerate launch`` sets them); once every unit exists, ``report.json``, ``report.md``
and the PNG plots are written.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..calibration import reliability_diagram
from ..prompts import DOMAINS, load_prompts
from . import metrics
from .bench_report import included_markdown
from .figures import pyplot, save_figure
from .rollouts import MethodResult, batched_rollouts, rollout_record, summarise
from .settings import PHASES, EvalSettings

SCHEMA = "hf-dspark-eval-v1"
TRANSFORMERS_DFLASH_REASON = (
    "transformers' built-in DFlash path (generation_config.speculation_type='dflash') needs a drafter class with "
    "its noise_embeds/context_hidden_states forward and DFlashCache; no such checkpoint exists for this target")


def unit_name(phase: str, temperature: float, prompt_set: str) -> str:
    return f"{phase}-t{temperature:g}-{prompt_set}"


def _units(settings: EvalSettings, sets: list[str], phases=PHASES) -> list[tuple[str, float, str]]:
    speed_temps = settings.speed_temperatures if settings.speed_temperatures is not None else settings.temperatures
    temps = {"quality": settings.temperatures, "speed": speed_temps if settings.speed_prompts else []}
    return [(phase, t, s) for phase in phases for t in temps[phase] for s in sets]


def _quality_methods(drafter, ablation) -> dict[str, dict]:
    full_block = {"assistant": True, "verification_policy": "fixed", "num_verify_tokens": None}
    methods = {"dspark": {**full_block, "drafter": drafter}}
    if ablation is not None:
        methods["dflash"] = {**full_block, "drafter": ablation}
    return methods


def _speed_methods(drafter, ablation, settings: EvalSettings) -> dict[str, dict]:
    methods = {"plain": {"assistant": False},
               "dspark:fixed": {"assistant": True, "drafter": drafter, "verification_policy": "fixed",
                                "num_verify_tokens": None}}
    if drafter.confidence_head is not None:
        methods["dspark:threshold"] = {"assistant": True, "drafter": drafter, "verification_policy": "threshold",
                                       "confidence_threshold": settings.speed_threshold}
        if settings.scheduler:
            methods["dspark:scheduler"] = {"assistant": True, "drafter": drafter, "verification_policy": "scheduler"}
            methods["dspark:hybrid"] = {"assistant": True, "drafter": drafter, "verification_policy": "hybrid"}
    if ablation is not None:
        methods["dflash:fixed"] = {"assistant": True, "drafter": ablation, "verification_policy": "fixed",
                                   "num_verify_tokens": None}
    if settings.prompt_lookup:
        methods["prompt_lookup"] = {"prompt_lookup": settings.prompt_lookup}
    return methods


def run_unit(target, tokenizer, drafter, ablation, records: list[dict], phase: str, temperature: float,
             settings: EvalSettings, progress: bool = True, desc: str = "", concurrency: int = 1) -> dict:
    """One phase on one prompt set at one temperature; results per method and domain (raw rounds kept).

    ``concurrency`` > 1 runs the quality phase through the batched engine (same per-round events, several times
    faster on a CPU); the speed phase always times ``generate()`` prompt by prompt."""
    from tqdm.auto import tqdm

    if phase == "quality":
        methods, chosen = _quality_methods(drafter, ablation), records[: settings.num_prompts]
    else:
        methods, chosen = _speed_methods(drafter, ablation, settings), records[: settings.speed_prompts]
    batched = phase == "quality" and concurrency > 1
    if batched:
        per_record = batched_rollouts(target, tokenizer, chosen, methods, settings.max_new_tokens, temperature,
                                      settings.seed, settings.multi_turn, concurrency, progress, desc or phase)
    else:
        per_record = (rollout_record(target, tokenizer, record, methods, drafter, settings.max_new_tokens,
                                     temperature, settings.seed * 1_000_003 + index, settings.multi_turn)
                      for index, record in enumerate(tqdm(chosen, desc=desc or phase, unit="prompt",
                                                          disable=not progress)))
    results: dict[str, dict[str, MethodResult]] = {}
    for record, per_method in zip(chosen, per_record):
        for name, result in per_method.items():
            results.setdefault(name, {}).setdefault(record["domain"], MethodResult()).merge(result)
    return {"phase": phase, "temperature": temperature, "set": records[0]["set"], "prompts": len(chosen),
            "concurrency": concurrency if batched else 1,
            "results": {m: {d: r.to_dict() for d, r in per.items()} for m, per in results.items()}}


def run_eval(target, tokenizer, drafter, output_dir: str | Path, settings: EvalSettings, ablation=None,
             num_shards: int | None = None, shard_index: int | None = None, progress: bool = True,
             description: dict | None = None, benchmarks_path: str | Path | None = None,
             phases=PHASES, concurrency: int = 1, benchmarks_include=()) -> dict:
    """Run this shard's units of ``phases`` (skipping finished ones), then write the report from every unit present
    (``report["missing"]`` lists the units still to run, by any shard or a later ``phases`` choice).
    ``benchmarks_include``: Markdown reports (``hf-dspark bench --markdown``) appended to ``benchmarks_path``."""
    num_shards, shard_index = _shard(num_shards, shard_index)
    output = Path(output_dir)
    (output / "units").mkdir(parents=True, exist_ok=True)
    by_set: dict[str, list[dict]] = {}
    for r in load_prompts(settings.data):
        by_set.setdefault(r["set"], []).append(r)
    _pin_settings(output / "settings.json", settings, sorted(by_set), write=shard_index == 0)
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    if ("speed" in phases and settings.scheduler and drafter.confidence_head is not None
            and getattr(drafter.generation_config, "sps_profile", None) is None):
        from ..generation import sps_width
        from ..profiling import load_or_profile

        load_or_profile(target, sps_width(drafter))  # profile before the clock runs, not inside a rollout
    todo = _units(settings, sorted(by_set), phases)
    ran = 0
    for i, (phase, temperature, prompt_set) in enumerate(todo):
        name = unit_name(phase, temperature, prompt_set)
        path = output / "units" / f"{name}.json"
        if i % num_shards != shard_index or path.is_file():
            continue
        result = run_unit(target, tokenizer, drafter, ablation, by_set[prompt_set], phase, temperature, settings,
                          progress, desc=f"{name} [{i + 1}/{len(todo)}]", concurrency=concurrency)
        _write_unit(path, result, shard_index)
        ran += 1
    missing = [unit_name(*u) for u in _units(settings, sorted(by_set))
               if not (output / "units" / f"{unit_name(*u)}.json").is_file()]
    report = build_report(output, settings, drafter, ablation, description or {})
    if not ran:
        _keep_measured_environment(report, output / "report.json")
    report["missing"] = missing
    write_report(report, output, benchmarks_path, benchmarks_include)
    return report


def _shard(num_shards: int | None, shard_index: int | None) -> tuple[int, int]:
    """This process's ``(num_shards, shard_index)``: the given ones, else ``accelerate``'s, checked."""
    if num_shards is None or shard_index is None:
        from accelerate import PartialState

        state = PartialState()
        num_shards, shard_index = state.num_processes, state.process_index
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    return num_shards, shard_index


def _pin_settings(path: Path, settings: EvalSettings, sets: list[str], write: bool) -> None:
    """Check ``settings`` and the prompt ``sets`` against those an output folder was started with (``path``); with
    none recorded yet, record them when ``write`` (shard 0)."""
    pinned = {"settings": asdict(settings), "sets": sets}
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous["settings"] != pinned["settings"] or previous["sets"] != pinned["sets"]:
            raise ValueError(f"{path.parent} holds an evaluation with other settings; use a new --output folder")
    elif write:
        path.write_text(json.dumps(pinned, indent=2))


def _write_unit(path: Path, result: dict, shard_index: int) -> None:
    """Write a finished unit through a temporary file, so that a unit is either complete or absent."""
    tmp = path.with_suffix(f".{shard_index}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def _keep_measured_environment(report: dict, previous: Path) -> None:
    """For a report only re-rendered (no unit ran): the numbers come from the run that measured them, so that run's
    machine, versions and date (from ``previous``, its ``report.json``) stay; the command is this one (it regenerates
    the page)."""
    if not previous.is_file():
        return
    measured = json.loads(previous.read_text()).get("environment")
    if measured:
        report["environment"] = {**measured, "command": report["environment"]["command"]}


# ----------------------------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------------------------
def _merge(results) -> MethodResult:
    total = MethodResult()
    for r in results:
        total.merge(r)
    return total


def _load_units(output: Path) -> list[dict]:
    units = []
    for path in sorted((output / "units").glob("*.json")):
        unit = json.loads(path.read_text())
        unit["results"] = {m: {d: MethodResult.from_dict(r) for d, r in per.items()}
                           for m, per in unit["results"].items()}
        units.append(unit)
    return units


def _group(units: list[dict], phase: str) -> dict[str, dict[str, dict[str, MethodResult]]]:
    """{"sets": {set: {method: MR}}, "domains": {domain: {method: MR}}, "all": {method: MR}}."""
    sets, domains, overall = {}, {}, {}
    for unit in (u for u in units if u["phase"] == phase):
        for method, per_domain in unit["results"].items():
            for domain, result in per_domain.items():
                for bucket in (sets.setdefault(unit["set"], {}), domains.setdefault(domain, {}), overall):
                    bucket.setdefault(method, MethodResult()).merge(result)
    return {"sets": sets, "domains": domains, "all": overall}


def _macro(per_set: dict[str, dict], method: str, key: str) -> float | None:
    values = [s[method][key] for s in per_set.values() if method in s and s[method].get(key) is not None]
    return sum(values) / len(values) if values else None


def build_report(output: Path, settings: EvalSettings, drafter, ablation, description: dict) -> dict:
    units = _load_units(output)
    temperatures = sorted({u["temperature"] for u in units})
    temps = {str(t): {} for t in temperatures}
    calibrated = getattr(drafter.config, "confidence_temperatures", None)
    for t in temperatures:
        entry = temps[str(t)]
        at_t = [u for u in units if u["temperature"] == t]
        quality = _group(at_t, "quality")
        if quality["all"]:
            acceptance = {
                "sets": {s: summarise(m) for s, m in sorted(quality["sets"].items())},
                "domains": {d: summarise(m) for d, m in sorted(quality["domains"].items(), key=lambda x: DOMAINS.index(x[0]))},
                "all": summarise(quality["all"]),
            }
            methods = list(quality["all"])
            acceptance["macro"] = {m: {"accepted_length": _macro(acceptance["sets"], m, "accepted_length"),
                                       "acceptance_rate": _macro(acceptance["sets"], m, "acceptance_rate")}
                                   for m in methods}
            if "dflash" in methods:
                ratio = {s: v["dspark"]["accepted_length"] / v["dflash"]["accepted_length"]
                         for s, v in acceptance["sets"].items() if "dflash" in v and "dspark" in v}
                acceptance["tau_ratio_dspark_over_dflash"] = {
                    "sets": ratio, "macro": acceptance["macro"]["dspark"]["accepted_length"]
                    / acceptance["macro"]["dflash"]["accepted_length"]}
            entry["acceptance"] = acceptance
            dspark_rounds = {"all": quality["all"]["dspark"],
                             **{f"domain/{d}": m["dspark"] for d, m in quality["domains"].items()}}
            if any(r.confidence_logits and r.confidence_logits[0] for r in dspark_rounds.values()):
                entry["threshold_sweep"] = {
                    group: {"raw": metrics.threshold_sweep(r.confidence_logits, r.verified, r.accepted,
                                                           settings.thresholds),
                            **({"calibrated": metrics.threshold_sweep(r.confidence_logits, r.verified, r.accepted,
                                                                      settings.thresholds, calibrated)}
                               if calibrated else {})}
                    for group, r in dspark_rounds.items()}
                r = quality["all"]["dspark"]
                entry["calibration"] = metrics.calibration_metrics(r.confidence_logits, r.verified, r.accepted,
                                                                   calibrated)
                entry["calibration"]["temperatures"] = calibrated
        speed = _group(at_t, "speed")
        if speed["all"]:
            entry["speed"] = {
                "sets": {s: summarise(m, "plain") for s, m in sorted(speed["sets"].items())},
                "domains": {d: summarise(m, "plain") for d, m in sorted(speed["domains"].items())},
                "all": summarise(speed["all"], "plain"),
                "not_run": {"transformers_dflash": TRANSFORMERS_DFLASH_REASON},
            }
    return {
        "schema": SCHEMA,
        "settings": asdict(settings),
        "models": {"block_size": drafter.config.block_size, "calibrated": bool(calibrated),
                   "sequential_head": drafter.config.sequential_head,
                   "ablation_sequential_head": None if ablation is None else ablation.config.sequential_head,
                   **description},
        "environment": environment(),
        "temperatures": temps,
    }


def environment() -> dict:
    import transformers

    from .. import __version__

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "hf_dspark": __version__, "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": invocation()}


def invocation() -> str | None:
    """This process's command line as ``hf-dspark ...`` (what a report names as the command that wrote it)."""
    return " ".join(shlex.quote(a) for a in ["hf-dspark", *sys.argv[1:]]) if sys.argv else None


# ----------------------------------------------------------------------------------------------------------------
# Writing: JSON, Markdown, plots
# ----------------------------------------------------------------------------------------------------------------
def write_report(report: dict, output: Path, markdown_path: Path | None = None, include=(),
                 render_only: bool = False) -> dict[str, Path]:
    """``report.json``, the plots and ``report.md`` in ``output``; with ``markdown_path`` the same Markdown there
    too, followed by the ``include``d generated reports (``included_markdown``). ``render_only`` rewrites the
    Markdown alone, linking the plots already in ``output`` (a report read back from its ``report.json``)."""
    output = Path(output)
    extra = [included_markdown(path) for path in include]  # read before anything is written
    if render_only:
        plots = {path.stem: path for path in sorted(output.glob("*.png"))}
        files = dict(plots)
    else:
        (output / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        plots = write_plots(report, output)
        files = {"json": output / "report.json", **plots}
    md = output / "report.md"
    md.write_text(render_markdown(report, plots, md.parent), encoding="utf-8")
    files["markdown"] = md
    if markdown_path is not None:
        markdown_path = Path(markdown_path)
        text = render_markdown(report, plots, markdown_path.parent)
        if extra:
            intro = (f"The sections below are other generated reports (each names its own command), appended by "
                     f"`{invocation()}`.\n")
            text = text.rstrip("\n") + "\n\n" + intro + "\n" + "\n".join(extra)
        markdown_path.write_text(text, encoding="utf-8")
        files["benchmarks"] = markdown_path
    return files


def _fmt(x, digits=2, suffix=""):
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def render_markdown(report: dict, plots: dict[str, Path], base: Path) -> str:
    """The report as Markdown: its header, then per temperature a section each for accepted length and
    position-wise acceptance, the threshold sweep, calibration and speed (with the ``plots``, linked relative to
    ``base``)."""
    lines = _header_lines(report)
    if report.get("missing"):
        phases = " ".join(p for p in PHASES if any(name.startswith(f"{p}-") for name in report["missing"]))
        lines += [f"**Incomplete**: {len(report['missing'])} units not run yet: {', '.join(report['missing'])}. "
                  f"Re-run the command with `--phases {phases}` to finish them.", ""]
    for t, entry in report["temperatures"].items():
        lines += [f"## Temperature {t}", ""]
        if entry.get("acceptance"):
            lines += _acceptance_lines(entry["acceptance"], report["models"]["block_size"])
            lines += _section_end(plots, f"position_acceptance_t{t}", "position-wise acceptance", base)
        if entry.get("threshold_sweep"):
            lines += _threshold_sweep_lines(entry["threshold_sweep"])
            lines += _section_end(plots, f"threshold_sweep_t{t}", "threshold sweep", base)
        if entry.get("calibration"):
            lines += _calibration_lines(entry["calibration"])
            lines += _section_end(plots, f"reliability_t{t}", "reliability", base)
        if entry.get("speed"):
            lines += _speed_lines(entry["speed"])
            lines += _section_end(plots, f"speed_t{t}", "speed", base)
    return "\n".join(lines) + "\n"


def _header_lines(report: dict) -> list[str]:
    """Title, models, prompts, machine, versions, command and the definitions of the report's measures."""
    env, models, s = report["environment"], report["models"], report["settings"]
    return [
        "<!-- generated by `hf-dspark eval`; do not edit by hand -->",
        "# DSpark evaluation report", "",
        f"- Target: {models.get('target', '?')}; DSpark drafter: {models.get('drafter', '?')}"
        + (f"; DFlash ablation: {models['ablation']}" if models.get("ablation") else ""),
        f"- Block size g = {models['block_size']}, sequential head `{models['sequential_head']}`, "
        f"calibrated (STS): {models['calibrated']}; dtype {models.get('dtype', '?')}",
        f"- Prompts: {', '.join(s['data'])}; {s['num_prompts']} per set for acceptance, {s['speed_prompts']} per set "
        f"for speed; up to {s['max_new_tokens']} new tokens; multi-turn: {s['multi_turn']}",
        f"- Machine: {env['cpu']} ({env['cpu_count']} cores, {env['torch_threads']} torch threads), "
        f"{env['platform']}; CUDA: {env['cuda']}",
        f"- Versions: python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"hf-dspark {env['hf_dspark']}; run {env['date']}",
        f"- Command: `{env['command']}`", "",
        "Definitions (as the paper): accepted length tau = tokens emitted per target forward, bonus token included, "
        "with the whole block verified every round; position-wise acceptance = P(draft k accepted | drafts 1..k-1 "
        "accepted); speed = tokens/s ratio to plain `generate()` on the same prompts in the same run.", "",
    ]


def _section_end(plots: dict[str, Path], key: str, alt: str, base: Path) -> list[str]:
    """A section's closing lines: its plot ``plots[key]`` (linked relative to ``base``) if there is one, then a blank
    line."""
    figure = ["", f"![{alt}]({os.path.relpath(plots[key], base)})"] if key in plots else []
    return figure + [""]


def _acceptance_lines(acc: dict, block_size: int) -> list[str]:
    """Accepted length tau per prompt set and domain (with DSpark over DFlash where the ablation ran), then
    position-wise conditional acceptance per method and domain."""
    methods = list(acc["all"])
    ratio = acc.get("tau_ratio_dspark_over_dflash", {})
    lines = ["### Accepted length tau", "", "| group | " + " | ".join(methods)
             + (" | DSpark / DFlash |" if "tau_ratio_dspark_over_dflash" in acc else " |"),
             "|---|" + "---|" * (len(methods) + ("tau_ratio_dspark_over_dflash" in acc))]
    rows = [(f"set: {k}", v, ratio.get("sets", {}).get(k)) for k, v in acc["sets"].items()]
    rows += [(f"domain: {k}", v, None) for k, v in acc["domains"].items()]
    for name, per, r in rows:
        cells = [_fmt(per.get(m, {}).get("accepted_length")) for m in methods]
        lines.append(f"| {name} | " + " | ".join(cells) + ((f" | {_fmt(r)}x |" if r else " | - |") if ratio else " |"))
    cells = [_fmt(acc["macro"][m]["accepted_length"]) for m in methods]
    lines.append("| **macro over sets** | " + " | ".join(cells)
                 + (f" | **{_fmt(ratio.get('macro'))}x** |" if ratio else " |"))
    lines += ["", "### Position-wise conditional acceptance", "",
              "| method | group | " + " | ".join(f"k={k}" for k in range(1, block_size + 1)) + " |",
              "|---|---|" + "---|" * block_size]
    for group, per in [("all", acc["all"]), *((f"domain: {d}", v) for d, v in acc["domains"].items())]:
        for m in methods:
            pa = per.get(m, {}).get("position_acceptance") or []
            lines.append(f"| {m} | {group} | " + " | ".join(_fmt(x) for x in pa) + " |")
    return lines


def _threshold_sweep_lines(sweep: dict) -> list[str]:
    """Per group and static threshold: drafts verified and accepted per round, acceptance rate and tau (calibrated
    confidences where the sweep has them)."""
    kind = "calibrated" if "calibrated" in sweep["all"] else "raw"
    lines = [f"### Static confidence-threshold sweep ({kind} confidences, whole-block rounds replayed)", "",
             "| group | threshold | verified / round | accepted / round | acceptance rate | tau |",
             "|---|---|---|---|---|---|"]
    for group, rows in sweep.items():
        for row in rows[kind]:
            lines.append(f"| {group} | {row['threshold']:g} | {_fmt(row['verified_per_round'])} | "
                         f"{_fmt(row['accepted_per_round'])} | {_fmt(row['acceptance_rate'], 3)} | "
                         f"{_fmt(row['accepted_length'])} |")
    return lines


def _calibration_lines(cal: dict) -> list[str]:
    """Per draft position: samples, ECE before and after STS, ROC-AUC."""
    lines = ["### Calibration of the prefix survival a_k", "",
             "| k | samples | ECE raw | ECE after STS | ROC-AUC |", "|---|---|---|---|---|"]
    for k, (n, e0, e1, auc) in enumerate(zip(cal["num_samples"], cal["ece_raw"], cal["ece_calibrated"],
                                             cal["auc"]), 1):
        lines.append(f"| {k} | {n} | {_fmt(e0, 4)} | {_fmt(e1, 4)} | {_fmt(auc, 3)} |")
    return lines


def _speed_lines(speed: dict) -> list[str]:
    """Tokens/s per method and group, each with its ratio to plain ``generate()`` (and tau), then the methods not
    run and why."""
    methods = list(speed["all"])
    lines = ["### Speed (tokens/s, ratio to plain generate() in the same run)", "",
             "| group | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for name, per in [*((f"set: {k}", v) for k, v in speed["sets"].items()),
                      *((f"domain: {k}", v) for k, v in speed["domains"].items()), ("all", speed["all"])]:
        cells = []
        for m in methods:
            r = per.get(m)
            cells.append("-" if r is None else f"{r['tokens_per_s']:.1f} ({_fmt(r['speedup'])}x"
                         + (f", tau {r['accepted_length']:.2f})" if r.get("accepted_length") else ")"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for method, reason in speed.get("not_run", {}).items():
        lines.append(f"\nNot run: {method}: {reason}.")
    return lines


def write_plots(report: dict, output: Path) -> dict[str, Path]:
    """The report's PNG plots in ``output``, per temperature: position-wise acceptance, the threshold sweep, the
    reliability diagram and speed, each where the report has its section; returns ``{name: path}``."""
    plt = pyplot()
    plots: dict[str, Path] = {}
    for t, entry in report["temperatures"].items():
        if entry.get("acceptance"):
            plots[f"position_acceptance_t{t}"] = _plot_position_acceptance(
                plt, entry["acceptance"], t, report["models"]["block_size"], output / f"position_acceptance_t{t}.png")
        if entry.get("threshold_sweep"):
            plots[f"threshold_sweep_t{t}"] = _plot_threshold_sweep(plt, entry["threshold_sweep"], t,
                                                                   output / f"threshold_sweep_t{t}.png")
        if entry.get("calibration"):
            plots[f"reliability_t{t}"] = _plot_reliability(output, t, entry["calibration"]["temperatures"])
        if entry.get("speed"):
            plots[f"speed_t{t}"] = _plot_speed(plt, entry["speed"], t, output / f"speed_t{t}.png")
    return plots


def _plot_position_acceptance(plt, acc: dict, t: str, g: int, path: Path) -> Path:
    """P(accept k | 1..k-1 accepted) against k, one panel per domain (or one for all), a line per method."""
    groups = list(acc["domains"].items()) or [("all", acc["all"])]
    fig, axes = plt.subplots(1, len(groups), figsize=(3.6 * len(groups), 3), sharey=True, squeeze=False)
    for ax, (domain, per) in zip(axes[0], groups):
        for method, r in per.items():
            ys = r.get("position_acceptance") or []
            ax.plot(range(1, len(ys) + 1), [float("nan") if y is None else y for y in ys], marker="o",
                    label=method)
        ax.set_title(f"{domain} (T={t})")
        ax.set_xlabel("draft position k")
        ax.set_xticks(range(1, g + 1))
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("P(accept k | 1..k-1 accepted)")
    axes[0][0].legend()
    return save_figure(fig, path, dpi=110)


def _plot_threshold_sweep(plt, sweep: dict, t: str, path: Path) -> Path:
    """Drafts verified and accepted per round (left) and the acceptance rate (right) against the static threshold,
    per group."""
    kind = "calibrated" if "calibrated" in sweep["all"] else "raw"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))
    for group, rows in sweep.items():
        xs = [r["threshold"] for r in rows[kind]]
        ax1.plot(xs, [r["verified_per_round"] for r in rows[kind]], marker=".", label=f"{group} verified")
        ax1.plot(xs, [r["accepted_per_round"] for r in rows[kind]], ls="--", label=f"{group} accepted")
        ax2.plot(xs, [float("nan") if r["acceptance_rate"] is None else r["acceptance_rate"]
                      for r in rows[kind]], marker=".", label=group)
    ax1.set_xlabel("confidence threshold")
    ax1.set_ylabel("tokens per round")
    ax2.set_xlabel("confidence threshold")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    ax1.legend(fontsize=6)
    ax2.legend(fontsize=6)
    fig.suptitle(f"static threshold sweep (T={t}, {kind} confidences)")
    return save_figure(fig, path, dpi=110)


def _plot_reliability(output: Path, t: str, temperatures: list[float] | None) -> Path:
    """The reliability diagram (``calibration.reliability_diagram``) of the DSpark drafter's quality rounds at
    temperature ``t``, read back from the units in ``output``."""
    units = _load_units(output)
    r = _merge(result for u in units if u["phase"] == "quality" and str(u["temperature"]) == t
               for result in u["results"].get("dspark", {}).values())
    return reliability_diagram(metrics.rounds_with_confidences(r.confidence_logits, r.verified, r.accepted),
                               temperatures, output / f"reliability_t{t}.png")


def _plot_speed(plt, speed: dict, t: str, path: Path) -> Path:
    """Each accelerated method's speedup over plain ``generate()``, bars per domain and for all prompts."""
    groups = list(speed["domains"].items()) + [("all", speed["all"])]
    methods = [m for m in speed["all"] if m != "plain"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(groups) * max(1, len(methods)) / 3, 3))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        ax.bar([j + i * width for j in range(len(groups))],
               [per.get(m, {}).get("speedup") or 0.0 for _, per in groups], width, label=m)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], [name for name, _ in groups])
    ax.set_ylabel("speedup vs plain generate()")
    ax.set_title(f"speed (T={t})")
    ax.legend(fontsize=6)
    return save_figure(fig, path, dpi=110)
