"""``hf-dspark generate``: DSpark-assisted greedy generation next to plain greedy generation."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from .arguments import UsageError
from .common import OPTIMIZE_HELP, OptimizeMode
from .common import DRAFT_ROUND_HELP, DRAFT_TREE_HELP, DRAFTER_HELP, TARGET_HELP, THREADS_HELP, DraftRound, DraftTree
from .common import DType
from .common import setup_target
from .policies import DEFAULT_POLICY, POLICY_HELP, drafter_policy, generation_policy

HELP = "DSpark-assisted greedy generation vs plain generate(): tokens/s, tau"
ROUNDING_NOTE = ("{dtype} rounds near-tied logits differently in a multi-token verification forward than in plain "
                 "decoding's one-token forwards, so the two greedy texts can part at such a tie (float32 gives "
                 "identical output); the speedup compares tokens/s, whatever each run's length")


@dataclass
class GenerateSettings:
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    drafter: str | None = HfArg(default=None, help=DRAFTER_HELP)
    prompt: str = HfArg(default="Write a Python function that checks whether a number is prime.",
                        help="the user message (sent through the chat template); chat text gains about 1.0x on a "
                             "CPU, code, math and repetitive text 1.4-2x")
    max_new_tokens: int = HfArg(default=128, help="tokens to generate", metadata={"bounds": (1, None)})
    dtype: DType = HfArg(default="float32", help="weight dtype of target and drafter")
    policy: str = HfArg(default=DEFAULT_POLICY, help="verification policy: " + POLICY_HELP + " | a registered policy")
    threshold: float | None = HfArg(default=None, help="confidence threshold of --policy threshold "
                                    "(default: the drafter's, 0.5)", metadata={"bounds": (0, 1)})
    draft_round: DraftRound | None = HfArg(default=None, help=DRAFT_ROUND_HELP)
    draft_tree: DraftTree | None = HfArg(default=None, help=DRAFT_TREE_HELP)
    stop: list[str] | None = HfArg(default=None, help="stop strings: both runs end where the text first contains "
                                   "one (as generate(stop_strings=))", metadata={"metavar": "STRING"})
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    optimize_target: OptimizeMode = HfArg(default="auto", help=OPTIMIZE_HELP)
    json: bool = HfArg(default=False, help="print only a JSON summary on stdout (progress on stderr, the text not "
                                  "streamed)")


SETTINGS = (GenerateSettings,)


def check(settings: GenerateSettings) -> None:
    """The policy exists, and --threshold comes with --policy threshold."""
    settings.policy = generation_policy(settings.policy, "--policy")
    if settings.threshold is not None and settings.policy != "threshold":
        raise UsageError("--threshold applies to --policy threshold only")


def run(settings: GenerateSettings) -> int:
    """Prints what it is doing on stderr (loading, the one-time GGUF conversion and SPS profiling), streams the
    DSpark run's text as it is generated (not with --json), runs plain generation, then compares the two."""
    started = time.perf_counter()
    target, tokenizer, drafter, origin, policy = _load(settings)
    messages = [{"role": "user", "content": settings.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    options = dict(max_new_tokens=settings.max_new_tokens, do_sample=False)
    if settings.stop:
        options.update(stop_strings=list(settings.stop), tokenizer=tokenizer)
    from ..optimization import optimization_report, stock_linears

    optimization = optimization_report(target)
    # Plain on the stock linears too where the target was optimised: what a user has without this library.
    runs = [("dspark", {"assistant_model": drafter}), ("plain", {})] + ([("plain_stock", {})] if optimization.applied
                                                                      else [])
    for name, extra in runs:  # warm-up (first-call costs) outside the timed runs
        with stock_linears(target) if name == "plain_stock" else contextlib.nullcontext():
            target.generate(**inputs, **{**options, "max_new_tokens": 4}, **extra)
    _step(f"ready after {time.perf_counter() - started:.0f} s")
    human = sys.stderr if settings.json else sys.stdout
    print(f"target: {settings.target or 'SmolLM2-135M-Instruct'} ({settings.dtype}), {optimization.summary()}; "
          f"drafter: {origin}; verification policy: {policy}", file=human, flush=True)
    results = _timed_runs(target, tokenizer, inputs, options, runs, stream=not settings.json)
    summary = compare(results, drafter.last_stats, settings.dtype)
    summary["text"] = tokenizer.decode(results["dspark"]["ids"], skip_special_tokens=True)
    summary["policy"] = policy
    summary["target_optimization"] = optimization.to_dict()
    if settings.json:
        print(json.dumps(summary))
    else:
        print("\n".join(summary_lines(summary)))
    return 0


def _step(message: str) -> None:
    print(f"[generate] {message}", file=sys.stderr, flush=True)


def _load(settings: GenerateSettings):
    """The target, the drafter set to the policy (the SPS profile made where the policy reads it), and its name."""
    from ..defaults import load_drafter_for

    if settings.target is None:
        from ..target import smollm2_converted

        if not smollm2_converted():
            _step("converting the SmolLM2-135M-Instruct GGUF file to a cached safetensors folder (once, 10-30 s)")
    _step(f"loading the target ({settings.dtype})")
    target, tokenizer, dtype = setup_target(settings)
    drafter, origin = load_drafter_for(target, settings.drafter, dtype=dtype)
    policy = drafter_policy(settings.policy, drafter)
    drafter.generation_config.verification_policy = policy
    if settings.threshold is not None:
        drafter.generation_config.confidence_threshold = settings.threshold
    if settings.draft_round is not None:
        drafter.generation_config.draft_round = settings.draft_round
    if settings.draft_tree is not None:
        drafter.generation_config.draft_tree = settings.draft_tree
    if policy in ("scheduler", "hybrid"):
        _profile(target, drafter)
    return target, tokenizer, drafter, origin, policy


def _profile(target, drafter) -> None:
    from ..generation import sps_width
    from ..profiling import load_or_profile, profile_path

    if not profile_path(target).is_file():
        _step("profiling the target's steps per second by verification width (once per machine, dtype and thread "
              "count; cached)")
    load_or_profile(target, sps_width(drafter))


def _timed_runs(target, tokenizer, inputs, options, runs, stream: bool) -> dict:
    """Each run's new tokens, seconds and tokens/s; the DSpark run streams its text (decoding each accepted chunk
    costs microseconds beside a forward)."""
    from transformers import TextStreamer

    from ..optimization import stock_linears

    results = {}
    prompt_length = inputs["input_ids"].shape[1]
    for name, extra in runs:
        if name == "plain_stock":
            _step("plain greedy generate() on torch's stock linears (the baseline without hf_dspark)")
        streamer = None
        if name == "dspark" and stream:
            print("-" * 60, flush=True)
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        start = time.perf_counter()
        with stock_linears(target) if name == "plain_stock" else contextlib.nullcontext():
            out = target.generate(**inputs, **options, **extra, streamer=streamer)
        elapsed = time.perf_counter() - start
        if streamer is not None:
            print("-" * 60, flush=True)
        if name == "dspark":
            _step("plain greedy generate() for comparison")
        ids = out[0, prompt_length:].tolist()
        results[name] = {"tokens": len(ids), "seconds": elapsed, "tokens_per_s": len(ids) / elapsed, "ids": ids}
    return results


def compare(results: dict, stats, dtype: str) -> dict:
    """The runs without their ids, the DSpark statistics, the speedup as a ratio of tokens/s (per token: runs of
    different lengths compare fairly) and whether the outputs are identical (with why not, in bfloat16)."""
    summary = {name: {k: v for k, v in r.items() if k != "ids"} for name, r in results.items()}
    summary["stats"] = stats.to_dict()
    summary["speedup"] = results["dspark"]["tokens_per_s"] / results["plain"]["tokens_per_s"]
    summary["identical_output"] = results["plain"]["ids"] == results["dspark"]["ids"]
    if "plain_stock" in results:
        stock = results["plain_stock"]
        summary["speedup_vs_stock_plain"] = results["dspark"]["tokens_per_s"] / stock["tokens_per_s"]
        summary["optimized_plain_vs_stock_plain"] = results["plain"]["tokens_per_s"] / stock["tokens_per_s"]
        # Apart from DSpark's own check: prepacked and stock linears round the last bits differently, so a near-tie
        # may part them even in float32, with or without drafting.
        summary["identical_to_stock_plain"] = stock["ids"] == results["dspark"]["ids"]
    if not summary["identical_output"] and dtype != "float32":
        summary["note"] = ROUNDING_NOTE.format(dtype=dtype)
    return summary


def summary_lines(summary: dict) -> list[str]:
    """The comparison as the terminal shows it."""
    plain, dspark, stats = summary["plain"], summary["dspark"], summary["stats"]
    lines = [f"plain greedy : {plain['tokens']} tokens, {plain['tokens_per_s']:.1f} tok/s",
             f"DSpark greedy: {dspark['tokens']} tokens, {dspark['tokens_per_s']:.1f} tok/s, "
             f"accepted length tau={stats['accepted_length']:.2f} over {stats['rounds']} rounds",
             f"speedup {summary['speedup']:.2f}x (tokens/s); identical output: {summary['identical_output']}"]
    if "plain_stock" in summary:
        stock = summary["plain_stock"]
        lines[1:1] = [f"plain greedy, stock linears: {stock['tokens']} tokens, {stock['tokens_per_s']:.1f} tok/s "
                      f"(the optimised target's plain: {summary['optimized_plain_vs_stock_plain']:.2f}x)"]
        lines[-1] = (f"speedup {summary['speedup']:.2f}x over plain on the same target, "
                     f"{summary['speedup_vs_stock_plain']:.2f}x over plain on stock linears (tokens/s); "
                     f"identical output: {summary['identical_output']} (to plain on stock linears: "
                     f"{summary['identical_to_stock_plain']})")
    if "note" in summary:
        lines.append(f"note: {summary['note']}")
    return lines
