"""``hf-dspark bench``: rollouts over prompt sets: tau, position-wise acceptance, tokens/s as ratios to plain."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers.hf_argparser import HfArg

from .arguments import UsageError
from .common import OPTIMIZE_HELP, OptimizeMode
from .common import DRAFT_ROUND_HELP, PROMPTS_HELP, SEED_HELP, TARGET_HELP, THREADS_HELP, DraftRound, DType
from .common import DRAFT_TREE_HELP, DRAFT_TREES
from .common import require_prompts, setup_target
from .policies import DEFAULT_POLICY, POLICY_HELP, drafter_policy, generation_policy

HELP = "rollouts over prompt sets: tau, acceptance, tokens/s vs plain"


@dataclass
class BenchSettings:
    prompts: list[str] = HfArg(help=PROMPTS_HELP)
    drafter: list[str] | None = HfArg(default=None, help="drafter folder(s) or Hub ids (default: the embedded drafter)",
                                      metadata={"nargs": "*"})
    labels: list[str] | None = HfArg(default=None, help="a short name per --drafter", metadata={"nargs": "*"})
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    policies: list[str] = HfArg(default_factory=lambda: [DEFAULT_POLICY], help=(
        "one method each per drafter, next to plain: hybrid | fixed | fixed=N | threshold=T | scheduler | "
        "scheduler=gated (the scheduler with its opt-in realized gate). " + POLICY_HELP))
    prompt_lookup: int = HfArg(default=0, help="also run transformers' prompt-lookup decoding with N tokens (0: not)",
                               metadata={"bounds": (0, None)})
    draft_round: DraftRound | None = HfArg(default=None, help=DRAFT_ROUND_HELP)
    draft_tree: list[str] | None = HfArg(default=None, help=DRAFT_TREE_HELP + "; several: one method per setting "
                                         "(named <drafter>:<policy>:tree=<setting>)",
                                         metadata={"nargs": "+", "choices": DRAFT_TREES})
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
    json: bool = HfArg(default=False, help="print the JSON report (what --output writes) on stdout instead of the "
                       "tables")


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
    """Runs every method over the prompt sets, writes --output / --markdown where asked and prints the report's
    tables (the JSON report with --json)."""
    from ..evaluation import run_rollouts
    from ..evaluation.report import environment

    target, tokenizer, dtype = setup_target(settings)
    methods, origins = _methods(settings, target, dtype)
    if any(m.get("verification_policy") in ("scheduler", "hybrid") for m in methods.values()):
        from ..generation import sps_width
        from ..profiling import load_or_profile

        sps = load_or_profile(target, max(sps_width(m["drafter"]) for m in methods.values() if "drafter" in m))
        # every method prices its rounds with this profile, measured before the clock runs: a profile re-measured
        # inside a timed rollout would bill that rollout for the measurement
        for method in methods.values():
            if method.get("verification_policy") in ("scheduler", "hybrid"):
                method["sps_profile"] = sps.to_dict()
    report = run_rollouts(target, tokenizer, None, settings.prompts, methods, num_prompts=settings.num_prompts,
                          max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                          seed=settings.seed, multi_turn=not settings.first_turn_only)
    from ..optimization import optimization_report

    payload = {"settings": asdict(settings), "results": {"drafters": origins, "report": report,
                                                         "target_optimization": optimization_report(target).to_dict()}}
    machine = environment()
    _write(settings, payload, machine)
    print(json.dumps(payload) if settings.json else terminal_tables(payload, machine))
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
            policy = drafter_policy(policy, drafter)
            method = {"assistant": True, "drafter": drafter, **policy_settings(policy)}
            if settings.draft_round is not None:
                method["draft_round"] = settings.draft_round
            trees = settings.draft_tree or [None]
            for tree in trees:
                name = f"{label}:{policy}" if len(trees) == 1 else f"{label}:{policy}:tree={tree}"
                methods[name] = method if tree is None else {**method, "draft_tree": tree}
    if settings.prompt_lookup:
        methods["prompt_lookup"] = {"prompt_lookup": settings.prompt_lookup}
    return methods, origins


def _write(settings: BenchSettings, payload: dict, machine: dict) -> None:
    from ..evaluation.bench_report import render_bench_markdown

    if settings.output:
        Path(settings.output).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.output).write_text(json.dumps(payload, indent=2))
    if settings.markdown:
        Path(settings.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(settings.markdown).write_text(render_bench_markdown(payload, machine))


def terminal_tables(payload: dict, machine: dict) -> str:
    """The report as ``--markdown`` writes it, less the first line's "generated by" marker (a file's, not a
    terminal's)."""
    from ..evaluation.bench_report import render_bench_markdown

    return render_bench_markdown(payload, machine).split("\n", 1)[1].rstrip("\n")
