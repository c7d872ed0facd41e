"""``hf-dspark bench-serve``: a prompt set replayed through the batched engine at several concurrencies."""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from transformers.hf_argparser import HfArg

from ..allocator import BENCH_PRETOUCH_MIB, fix_allocator, pretouch_setting
from .arguments import UsageError
from .common import DRAFT_TREE_HELP, OPTIMIZE_HELP, DraftTree, OptimizeMode
from .common import DRAFTER_HELP, PROMPTS_HELP, SEED_HELP, TARGET_HELP, THREADS_HELP, DType, require_prompts
from .common import device as chosen_device
from .common import setup_target
from .policies import DEFAULT_POLICY, PLAIN, current_spec, engine_spec

if TYPE_CHECKING:
    import torch

HELP = "batched serving: tokens/s and verification budget vs concurrency"
POLICIES_HELP = (
    "plain (the baseline every other policy is compared with) | hybrid (the scheduler plus a prompt lookup per "
    "request; hybrid=SCHEDULE too) | fixed | fixed=N | scheduler | scheduler=padded|prefix|topk; append ',ungated' "
    "(or scheduler=ungated) to turn the realized gate off, ',emitted' to have the gate count emitted tokens "
    "(gate_tokens); append ',hold=H' to any policy to set the engine's admission_hold (0: admit at once), "
    "',prefill=F' to set its PrefillCost fixed_tokens (1e9: each admission in one padded forward), ',tree=T' to set "
    "its draft_tree (chain | auto | always: token trees for greedy requests, e.g. 'hybrid,tree=auto' beside "
    "'hybrid')")


@dataclass
class ServeSettings:
    prompts: list[str] | None = HfArg(default=None, help=PROMPTS_HELP + "; required unless --from-report")
    num_prompts: int = HfArg(default=64, help="prompts replayed (shuffled with --seed)", metadata={"bounds": (1, None)})
    max_new_tokens: int = HfArg(default=256, help="tokens generated per request", metadata={"bounds": (1, None)})
    concurrency: list[int] | None = HfArg(default=None, help="most requests in the batch at once (one run per value; "
                                          "default 1 4 16 64, or 1 with --interleave)", metadata={"bounds": (1, None)})
    policies: list[str] = HfArg(default_factory=lambda: [PLAIN, DEFAULT_POLICY], help=POLICIES_HELP,
                                metadata={"deprecated": ["--methods"]})
    repeats: int = HfArg(default=1, help="run the policies of each concurrency N times (one after the other, "
                         "round-robin, or side by side with --lockstep); keep each policy's fastest run (with "
                         "--interleave: N passes over the prompts, pooled)", metadata={"bounds": (1, None)})
    interleave: bool = HfArg(default=False, help="with --concurrency 1: serve each prompt with every policy back to "
                             "back (one long-lived engine per policy, the first policy rotating) and compare them "
                             "request by request, so the machine's drift cancels in each pair; --repeats passes over "
                             "the prompts")
    lockstep: Literal["all", "pairs"] | None = HfArg(default=None, help=(
        "run each repeat's policies side by side, stepping whichever engine is furthest behind, each policy timed on "
        "its own steps: the machine's drift lands on every policy alike; '--lockstep pairs': each comparison (a "
        "policy and plain, scheduler and fixed) in its own two-engine lockstep (no value: all)"),
        metadata={"nargs": "?", "const": "all"})
    schedule: Literal["padded", "prefix", "topk"] = HfArg(default="padded", help=(
        "budget sharing for 'scheduler' and 'hybrid': Algorithm 1 by width layers (costed as the padded batch), "
        "Algorithm 1 over single entries, or dynamic top-K"))
    sps: str | None = HfArg(default=None, help="SPS profile JSON (default: profile the target, cached)")
    drafter: str | None = HfArg(default=None, help=DRAFTER_HELP)
    draft_tree: DraftTree | None = HfArg(default=None, help=DRAFT_TREE_HELP)
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    dtype: DType = HfArg(default="float32", help="weight dtype of target and drafter")
    device: str = HfArg(default="auto", help="where the models run (auto: cuda if available, else cpu)")
    temperature: float = HfArg(default=0.0, help="0: greedy (outputs checked against plain)",
                               metadata={"bounds": (0, None)})
    top_p: float | None = HfArg(default=None, help="nucleus sampling mass (default: none)",
                                metadata={"bounds": (0, 1)})
    seed: int = HfArg(default=0, help=SEED_HELP)
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    optimize_target: OptimizeMode = HfArg(default="auto", help=OPTIMIZE_HELP)
    no_warmup: bool = HfArg(default=False, help="skip the short warm-up run of each policy")
    dynamic_allocator: bool = HfArg(default=False, help="leave glibc malloc's thresholds adjusting themselves (by "
                                    "default they are pinned: engines run in one process otherwise read a few "
                                    "percent apart by which ran first)")
    pretouch: int | None = HfArg(default=None, help=(
        f"with the thresholds pinned, pre-touch this much heap first (default {BENCH_PRETOUCH_MIB} MiB, room for "
        "three engines' caches at 64 requests; 0: none), so that the page faults of fresh memory do not land on "
        "whichever engine first needs it (each run's count is in the report)"), metadata={"metavar": "MIB"})
    cold_engines: bool = HfArg(default=False, help="start every scheduled run from no timings (a fresh server) "
                               "instead of sharing one policy's measurements across its warm-up and runs (a "
                               "long-lived server)")
    measurements: str | None = HfArg(default=None, help="start the scheduled engines from what an earlier "
                                     "bench-serve report (or an engine measurements file) measured: a server that "
                                     "has learned this machine already")
    output: str | None = HfArg(default=None, help="write the JSON report here (and the plot next to it)")
    plot: str | None = HfArg(default=None, help="PNG path (default: --output with .png; needs 2+ concurrencies)")
    markdown: str | None = HfArg(default=None, help="also write the report as a Markdown table here (BENCHMARKS.md "
                                 "can include it: `hf-dspark eval --render-only --benchmarks-include`)")
    from_report: str | None = HfArg(default=None, help="run nothing: write --markdown from an earlier --output "
                                    "report", metadata={"metavar": "JSON"})


SETTINGS = (ServeSettings,)
# the policies that share the verification budget by --schedule
SCHEDULED_POLICIES = ("scheduler", "hybrid")
# report settings written under an older name
LEGACY_SETTINGS = {"policies": "methods"}


def check(settings: ServeSettings) -> None:
    """Everything that can be refused before a model loads: the report to render, the policies, the combinations."""
    if settings.from_report:
        _check_render(settings)
        return
    if settings.markdown == settings.output and settings.markdown:
        raise UsageError("--markdown and --output name the same file")
    if not settings.prompts:
        raise UsageError("--prompts is required (or --from-report to render an earlier report)")
    _check_combinations(settings)  # first: these refusals need no torch, reading a policy spec loads the engine
    _check_policies(settings)
    require_prompts(settings.prompts, "--prompts")


def _check_render(settings: ServeSettings) -> None:
    if not settings.markdown:
        raise UsageError("--from-report renders an earlier report: give --markdown, the file to write")
    if not Path(settings.from_report).is_file():
        raise UsageError(f"--from-report: no file {settings.from_report}")


def _check_policies(settings: ServeSettings) -> None:
    """The policies in today's names; each one reads, and with --lockstep pairs each is compared with one."""
    from ..evaluation.engine_bench import lockstep_pairs, parse_policy

    settings.policies = [current_spec(spec, "--policies") for spec in settings.policies]
    scheduled = [spec for spec in settings.policies if spec.split(",")[0].split("=")[0] in SCHEDULED_POLICIES]
    if settings.schedule != ServeSettings.schedule and not scheduled:
        raise UsageError(f"--schedule applies to the {' and '.join(SCHEDULED_POLICIES)} policies only")
    try:
        specs = {spec: parse_policy(spec, settings.schedule) for spec in engine_specs(settings)}
        if settings.lockstep == "pairs":
            lockstep_pairs(specs)
    except ValueError as err:
        raise UsageError(f"--policies: {err}") from None


def engine_specs(settings: ServeSettings) -> list[str]:
    """The policies as the engine's policy specs."""
    return [engine_spec(spec, "--policies") for spec in settings.policies]


def _check_combinations(settings: ServeSettings) -> None:
    if settings.concurrency is None:
        settings.concurrency = [1] if settings.interleave else [1, 4, 16, 64]
    if settings.interleave and settings.concurrency != [1]:
        raise UsageError("--interleave compares the policies request by request, one request at a time: it needs "
                         f"--concurrency 1, got {' '.join(map(str, settings.concurrency))}")
    if settings.interleave and settings.lockstep:
        raise UsageError("--interleave and --lockstep are two ways to interleave the policies: choose one")
    if settings.interleave and settings.cold_engines:
        raise UsageError("--interleave serves every prompt on one long-lived engine per policy; --cold-engines "
                         "starts every run from nothing")
    if settings.measurements and settings.cold_engines:
        raise UsageError("--measurements gives the scheduled engines a start; --cold-engines starts each from "
                         "nothing")
    try:
        pretouch_setting(settings.dynamic_allocator, settings.pretouch)
    except ValueError as err:
        raise UsageError(str(err)) from None


def run(settings: ServeSettings) -> int:
    """Replays the prompts; writes the JSON report, the Markdown table and the plot where asked."""
    if settings.from_report:
        return _render_report(settings)
    from ..evaluation.engine_bench import bench_interleaved, bench_serve, measurements_from_report
    from ..evaluation.report import environment

    device = chosen_device(settings.device)
    methods = engine_specs(settings)
    target, tokenizer, drafter, origin = _models(settings, methods, device)
    start = measurements_from_report(settings.measurements, methods) if settings.measurements else None
    pretouch = pretouch_setting(settings.dynamic_allocator, settings.pretouch)
    allocator = None if pretouch is None else fix_allocator(pretouch=pretouch)
    print(f"allocator: {allocator or 'as the C library sets it'}", flush=True)
    prompts = _prompts(settings, tokenizer)
    from ..optimization import optimization_report

    print(f"target: {settings.target or 'SmolLM2-135M-Instruct'} ({settings.dtype}, {device}, "
          f"{optimization_report(target).summary()}); drafter: {origin}; "
          f"{len(prompts)} prompts, {settings.max_new_tokens} new tokens", flush=True)
    common = dict(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, top_p=settings.top_p,
                  schedule=settings.schedule, sps=_sps(settings.sps), seed=settings.seed, repeats=settings.repeats,
                  warmup=not settings.no_warmup, measurements=start, log=lambda line: print(line, flush=True))
    ids = [ids for _, ids in prompts]
    if settings.interleave:
        report = bench_interleaved(target, drafter, ids, methods, **common)
    else:
        report = bench_serve(target, drafter, ids, methods, settings.concurrency,
                             share_measurements=not settings.cold_engines, lockstep=settings.lockstep or False,
                             **common)
    from ..optimization import optimization_report

    recorded = {**asdict(settings), "device": str(device), "drafter_origin": origin, "allocator": allocator,
                "prompt_ids": [i for i, _ in prompts],
                "target_optimization": optimization_report(target).to_dict()}
    _write(settings, {"settings": recorded, "environment": environment(), **report}, report)
    return 0


def _models(settings: ServeSettings, methods: list[str], device: torch.device):
    """The target on ``device``, and the drafter where a method drafts."""
    from ..defaults import load_drafter_for

    from ..optimization import optimize_target

    target, tokenizer, dtype = setup_target(settings)
    if device.type != "cpu":
        optimize_target(target, "off")  # oneDNN packing is for CPU forwards
    target = target.to(device)
    drafter, origin = None, None
    if any(not m.startswith("plain") for m in methods):
        drafter, origin = load_drafter_for(target, settings.drafter, dtype=dtype)
        drafter = drafter.to(device)
        if settings.draft_tree is not None:
            drafter.generation_config.draft_tree = settings.draft_tree
    return target, tokenizer, drafter, origin


def _prompts(settings: ServeSettings, tokenizer) -> list:
    from ..evaluation.engine_bench import encode_prompts
    from ..prompts import load_prompts

    return encode_prompts(tokenizer, load_prompts(settings.prompts), settings.num_prompts, settings.seed)


def _sps(path: str | None):
    """The SPS curve of ``--sps`` (single-sequence or batched; None: the engines profile the target)."""
    if path is None:
        return None
    from ..profiling import BatchedStepsPerSecond
    from ..scheduling import StepsPerSecond

    data = json.loads(Path(path).read_text())
    data = data.get("profile", data)  # hf-dspark profile's cache file wraps the curve
    return BatchedStepsPerSecond.from_dict(data) if "curves" in data else StepsPerSecond.from_dict(data)


def _write(settings: ServeSettings, payload: dict, report: dict) -> None:
    from ..evaluation.engine_bench import plot_bench

    if settings.output:
        Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.output).write_text(json.dumps(payload, indent=2))
    if settings.markdown:
        from ..evaluation.bench_report import render_serve_markdown

        Path(settings.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.markdown).write_text(render_serve_markdown(payload, payload["environment"]))
    plot = settings.plot or (str(Path(settings.output).with_suffix(".png")) if settings.output else None)
    if plot and len(settings.concurrency) > 1:
        print(f"plot: {plot_bench(report, plot)}")
    elif settings.plot:
        print(f"no plot: {settings.plot} would show one concurrency; the plot needs 2 or more")


def _render_report(settings: ServeSettings) -> int:
    """``--from-report JSON --markdown MD``: the Markdown of an earlier report, nothing run."""
    from ..evaluation.bench_report import render_serve_markdown

    path = Path(settings.from_report)
    payload = json.loads(path.read_text())
    if "settings" not in payload or "results" not in payload:
        raise UsageError(f"--from-report: {path} is not a bench-serve report (no 'settings' and 'results')")
    env = payload.get("environment") or {"command": serve_command(payload["settings"])}
    Path(settings.markdown).parent.mkdir(parents=True, exist_ok=True)
    Path(settings.markdown).write_text(render_serve_markdown(payload, env))
    print(f"markdown: {settings.markdown}")
    return 0


def serve_command(recorded: dict) -> str:
    """The ``hf-dspark bench-serve`` command line that a report's settings record (options left at their default
    omitted): what a report written without its command names as its command."""
    from . import build_parser, subparser

    parts = ["hf-dspark", "bench-serve"]
    for action in subparser(build_parser(), "bench-serve")._actions:
        if not action.option_strings or action.dest in ("help", "verbose", "output", "plot", "markdown",
                                                        "from_report"):
            continue
        value = recorded.get(action.dest, recorded.get(LEGACY_SETTINGS.get(action.dest), action.default))
        if value is None or value == action.default or value is False:
            continue
        parts += _flag_and_value(action, value)
    for name in ("output", "plot"):
        if recorded.get(name):
            parts += [f"--{name}", recorded[name]]
    return shlex.join(parts)


def _flag_and_value(action, value) -> list[str]:
    flag = action.option_strings[0]
    if value is True or (action.const is not None and value == action.const):
        return [flag]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, str(value)]
