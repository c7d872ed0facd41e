"""``hf-dspark bench``: rollouts over prompt sets: tau, position-wise acceptance, tokens/s as ratios to plain."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers.hf_argparser import HfArg

from .arguments import UsageError
from .common import OPTIMIZE_HELP, OptimizeMode
from .common import DRAFT_ROUND_HELP, PROMPTS_HELP, SEED_HELP, TARGET_HELP, THREADS_HELP, DraftRound, DType
from .common import require_prompts, setup_target
from .policies import POLICY_HELP, generation_policy

HELP = "rollouts over prompt sets: tau, acceptance, tokens/s vs plain"


@dataclass
class BenchSettings:
    prompts: list[str] = HfArg(help=PROMPTS_HELP)
    drafter: list[str] | None = HfArg(default=None, help="drafter folder(s) or Hub ids (default: the embedded drafter)",
                                      metadata={"nargs": "*"})
    labels: list[str] | None = HfArg(default=None, help="a short name per --drafter", metadata={"nargs": "*"})
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    policies: list[str] = HfArg(default_factory=lambda: ["fixed"], help=(
        "one method each: fixed | fixed=N | threshold=T | scheduler | scheduler=gated (the scheduler with its opt-in "
        "realized gate) | hybrid. " + POLICY_HELP))
    prompt_lookup: int = HfArg(default=0, help="also run transformers' prompt-lookup decoding with N tokens (0: not)",
                               metadata={"bounds": (0, None)})
    draft_round: DraftRound | None = HfArg(default=None, help=DRAFT_ROUND_HELP)
    num_prompts: int = HfArg(default=50, help="prompts per prompt set", metadata={"bounds": (1, None)})
    max_new_tokens: int = HfArg(default=256, help="tokens generated per turn", metadata={"bounds": (1, None)})
    temperature: float = HfArg(default=0.0, help="sampling temperature (0: greedy)", metadata={"bounds": (0, None)})
    first_turn_only: bool = HfArg(default=False, help="roll out only the first turn of multi-turn prompts")
    dtype: DType = HfArg(default="float32", help="weight dtype of target and drafters")
    seed: int = HfArg(default=0, help=SEED_HELP)
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    optimize_target: OptimizeMode = HfArg(default="auto", help=OPTIMIZE_HELP)
    output: str | None = HfArg(default=None, help="write the JSON report here")
    markdown: str | None = HfArg(default=None, help="also write the report as Markdown tables here")


SETTINGS = (BenchSettings,)


def check(settings: BenchSettings) -> None:
    """Every policy spec reads, and the prompts exist."""
    for spec in settings.policies:
        policy_settings(spec)
    if settings.labels and len(settings.labels) != len(settings.drafter or [None]):
        raise UsageError("--labels needs one name per --drafter")
    require_prompts(settings.prompts, "--prompts")


def policy_settings(spec: str) -> dict:
    """``fixed=N`` / ``threshold=T`` / ``scheduler=gated`` / ``hybrid`` -> the drafter settings of that method."""
    name, _, value = spec.partition("=")
    policy = generation_policy(name, "--policies")
    settings = {"verification_policy": policy}
    try:
        if policy == "fixed" and value:
            settings["num_verify_tokens"] = int(value)
        if policy == "threshold":
            settings["confidence_threshold"] = float(value or 0.5)
    except ValueError:
        raise UsageError(f"--policies {spec}: expected a number after '='") from None
    if policy == "threshold" and not 0 <= settings["confidence_threshold"] <= 1:
        raise UsageError(f"--policies {spec}: the threshold must be in [0, 1]")
    if policy == "scheduler" and value:
        if value != "gated":
            raise UsageError(f"--policies {spec}: expected scheduler or scheduler=gated")
        settings["realized_gate"] = True
    return settings


def run(settings: BenchSettings) -> int:
    import hf_dspark  # noqa: F401  (installs the generate() dispatch)

    from ..evaluation import run_rollouts

    target, tokenizer, dtype = setup_target(settings)
    methods, origins = _methods(settings, target, dtype)
    if any(m.get("verification_policy") in ("scheduler", "hybrid") for m in methods.values()):
        from ..generation import sps_width
        from ..profiling import load_or_profile

        load_or_profile(target, max(sps_width(m["drafter"]) for m in methods.values() if "drafter" in m))
    report = run_rollouts(target, tokenizer, None, settings.prompts, methods, num_prompts=settings.num_prompts,
                          max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                          seed=settings.seed, multi_turn=not settings.first_turn_only)
    from ..optimization import optimization_report

    payload = {"settings": asdict(settings), "results": {"drafters": origins, "report": report,
                                                         "target_optimization": optimization_report(target).to_dict()}}
    _write(settings, payload)
    for label, origin in origins.items():
        print(f"{label}: {origin}")
    for group, per_method in sorted(report.items()):
        print(f"{group:16s} " + " | ".join(_cell(name, r) for name, r in per_method.items()))
    return 0


def _methods(settings: BenchSettings, target, dtype) -> tuple[dict, dict]:
    """plain (first plain on the stock linears, the baseline, where the target was optimised), one method per
    (drafter, policy), and prompt lookup when asked; the drafters' origins by label."""
    from ..defaults import load_drafter_for
    from ..optimization import optimization_report

    methods = {"plain_stock": {"assistant": False, "stock_linears": True}} if optimization_report(target).applied else {}
    methods["plain"] = {"assistant": False}
    specs = settings.drafter or [None]
    origins = {}
    for index, spec in enumerate(specs):
        drafter, origin = load_drafter_for(target, spec, dtype=dtype)
        label = settings.labels[index] if settings.labels else ("dspark" if len(specs) == 1 else f"drafter{index}")
        origins[label] = origin
        for policy in settings.policies:
            method = {"assistant": True, "drafter": drafter, **policy_settings(policy)}
            if settings.draft_round is not None:
                method["draft_round"] = settings.draft_round
            methods[f"{label}:{policy}"] = method
    if settings.prompt_lookup:
        methods["prompt_lookup"] = {"prompt_lookup": settings.prompt_lookup}
    return methods, origins


def _write(settings: BenchSettings, payload: dict) -> None:
    if settings.output:
        Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.output).write_text(json.dumps(payload, indent=2))
    if settings.markdown:
        from ..evaluation.bench_report import render_bench_markdown
        from ..evaluation.report import environment

        Path(settings.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.markdown).write_text(render_bench_markdown(payload, environment()))


def _cell(name: str, result: dict) -> str:
    """``name: 41.2 tok/s x1.31 tau=2.10 [block 80% ...] (draft 4% ...) same=True``."""
    return (f"{name}: {result['tokens_per_s']:.1f} tok/s x{result['speedup']:.2f}"
            + (f" tau={result['accepted_length']:.2f}" if "accepted_length" in result else "")
            + _source_shares(result.get("sources")) + _time_shares(result)
            + (f" same={result['identical_to_baseline']}" if "identical_to_baseline" in result else ""))


def _source_shares(sources: dict | None) -> str:
    """`` [block 12% lookup 30% none 58%]``: where a method's rounds drafted from (empty without rounds)."""
    from ..evaluation.bench_report import round_shares

    if not sources:
        return ""
    return " [" + " ".join(f"{name} {share:.0f}%" for name, share in sorted(round_shares(sources).items())) + "]"


def _time_shares(result: dict) -> str:
    """`` (draft 4% verify 90% loop 6%)``: where a drafting method's seconds went (empty for plain methods)."""
    from ..evaluation.bench_report import TIME_PARTS, time_shares

    spent = time_shares(result)
    if not spent:
        return ""
    return " (" + " ".join(f"{TIME_PARTS[key]} {share:.0f}%" for key, share in spent.items()) + ")"
