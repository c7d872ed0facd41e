"""``hf-dspark``: command-line entry point.

Errors print as one line (``hf-dspark: error: ...``) unless ``--debug`` is given; the exit status is 2 for bad
input (``UsageError``: empty prompt files or data folders, a missing local folder), like argparse's own usage
errors, and 1 for a failure while running.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from .prompts import SAMPLINGS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXCLUDE_HELP = ("prompts to skip: regenerated data folders, calibrated drafter folders (their calibration prompts) "
                "or text files of prompt ids, one per line")


class UsageError(Exception):
    """Bad command-line input, found before any model loads: exit status 2."""


# arguments naming a model folder or Hub repo id
MODEL_ARGUMENTS = ("target", "drafter", "init_drafter", "ablation")
# generation.DRAFT_ROUNDS, spelled out so that building the parser does not import transformers (a test keeps them equal)
DRAFT_ROUNDS = ("auto", "eager", "static", "graph")
DRAFT_ROUND_HELP = ("how a drafting round runs: auto (default: a CUDA graph on CUDA where the round allows it, else "
                    "eager) | eager | static (the graph's fixed-shape round run eagerly) | graph")


def _looks_like_path(value: str) -> bool:
    """A local path rather than a Hub repo id (``name`` or ``namespace/name``: at most one ``/``)."""
    separators = tuple({"/", os.sep} | ({os.altsep} if os.altsep else set()))
    return (value.startswith((".", "~", *separators)) or value.endswith(separators) or value.count("/") > 1
            or any(sep in value for sep in separators if sep != "/"))


def _model_path(value: str, name: str) -> str:
    """A model argument as the loaders get it: a local path with ``~`` expanded, refused when it does not exist (the
    Hub would only say that it is not a valid repo id); anything else unchanged."""
    if not _looks_like_path(value):
        return value
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        raise UsageError(f"--{name.replace('_', '-')}: no such folder: {value}")
    return path


def _check_model_paths(args) -> None:
    for name in MODEL_ARGUMENTS:
        value = getattr(args, name, None)
        if isinstance(value, list):
            setattr(args, name, [_model_path(v, name) for v in value])
        elif value is not None:
            setattr(args, name, _model_path(value, name))


def _require_prompts(paths: list[str], flag: str) -> None:
    """Refuse prompt files / folders that hold no prompt."""
    from .prompts import load_prompts

    if not load_prompts(paths):
        raise UsageError(f"{flag}: no prompts in {' '.join(paths)}")


def _require_shards(folders: list[str], flag: str) -> None:
    """Refuse regenerated-data folders that are missing or hold no finished shard."""
    from .training.trainer import list_shards

    missing = [folder for folder in folders if not Path(folder).is_dir()]
    if missing:
        raise UsageError(f"{flag}: no such folder: {missing[0]}")
    try:
        list_shards(folders)
    except FileNotFoundError as err:
        raise UsageError(f"{flag}: {err}") from None


def _int_list(text: str) -> list[int]:
    """argparse type for comma-separated integers (layer ids), e.g. ``28,29``."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _load_target(name: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in (None, "smollm2", "SmolLM2-135M-Instruct"):
        from .target import load_smollm2

        return load_smollm2(dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(name)


def _device(name: str) -> torch.device:
    """``auto``: the GPU where CUDA is available, else the CPU; otherwise the named device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return device


def _setup_target(args, dtype_name: str | None = None):
    """Thread count, dtype and the target (+ tokenizer) for commands that run it."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    dtype = DTYPES[dtype_name or args.dtype]
    target, tokenizer = _load_target(args.target, dtype)
    return target, tokenizer, dtype


def cmd_generate(args) -> int:
    """DSpark-assisted greedy generation next to plain greedy generation, with tokens/s and accepted length.

    Prints what it is doing on stderr (loading, the one-time GGUF conversion and SPS profiling) and streams the DSpark
    run's text as it is generated; plain generation follows, then the comparison."""
    import hf_dspark  # noqa: F401  (installs the generate() dispatch)

    from transformers import TextStreamer

    from .defaults import load_drafter_for

    def step(message: str) -> None:
        print(f"[generate] {message}", file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    started = time.perf_counter()
    if args.target is None:
        from .target import smollm2_converted

        if not smollm2_converted():
            step("converting the SmolLM2-135M-Instruct GGUF file to a cached safetensors folder (once, ~20 s)")
    step(f"loading the target ({args.dtype})")
    target, tokenizer, dtype = _setup_target(args)
    drafter, origin = load_drafter_for(target, args.drafter, dtype=dtype)
    # Default: the hybrid (drafter block or prompt lookup, whichever the cost model prices higher) where the drafter
    # has a confidence head, else whole blocks.
    policy = args.policy or ("hybrid" if drafter.confidence_head is not None else "fixed")
    drafter.generation_config.verification_policy = policy
    if args.threshold is not None:
        drafter.generation_config.confidence_threshold = args.threshold
    if args.draft_round is not None:
        drafter.generation_config.draft_round = args.draft_round
    if policy in ("scheduler", "hybrid"):
        from .generation import sps_width
        from .profiling import load_or_profile, profile_path

        if not profile_path(target).is_file():
            step("profiling the target's steps per second by verification width (once per machine, dtype and "
                 "thread count; cached)")
        load_or_profile(target, sps_width(drafter))
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    if args.stop:
        settings.update(stop_strings=list(args.stop), tokenizer=tokenizer)
    runs = (("dspark", {"assistant_model": drafter}), ("plain", {}))
    for _, extra in runs:  # warm-up (first-call costs) outside the timed runs
        target.generate(**inputs, **{**settings, "max_new_tokens": 4}, **extra)
    step(f"ready after {time.perf_counter() - started:.0f} s")
    print(f"target: {args.target or 'SmolLM2-135M-Instruct'} ({args.dtype}); drafter: {origin}; verification "
          f"policy: {policy}", flush=True)
    print("-" * 60, flush=True)
    results = {}
    for name, extra in runs:
        # The DSpark run streams its text; decoding each accepted chunk costs microseconds beside a forward.
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if name == "dspark" else None
        start = time.perf_counter()
        out = target.generate(**inputs, **settings, **extra, streamer=streamer)
        elapsed = time.perf_counter() - start
        if name == "dspark":
            print("-" * 60, flush=True)
            step("plain greedy generate() for comparison")
        new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
        results[name] = {"tokens": new_tokens, "seconds": elapsed, "tokens_per_s": new_tokens / elapsed,
                         "ids": out[0, inputs["input_ids"].shape[1]:].tolist()}
    stats = drafter.last_stats
    print(f"plain greedy : {results['plain']['tokens']} tokens, {results['plain']['tokens_per_s']:.1f} tok/s")
    print(f"DSpark greedy: {results['dspark']['tokens']} tokens, {results['dspark']['tokens_per_s']:.1f} tok/s, "
          f"accepted length tau={stats.accepted_length:.2f} over {stats.rounds} rounds")
    print(f"speedup {results['dspark']['tokens_per_s'] / results['plain']['tokens_per_s']:.2f}x; "
          f"identical output: {results['plain']['ids'] == results['dspark']['ids']}")
    if args.json:
        summary = {k: {kk: vv for kk, vv in v.items() if kk != "ids"} for k, v in results.items()}
        summary["stats"] = stats.to_dict()
        print(json.dumps(summary))
    return 0


def cmd_data(args) -> int:
    from .training.data import RegenerationSettings, regenerate

    _require_prompts(args.prompts, "--prompts")
    torch.set_num_threads(args.threads or torch.get_num_threads())
    settings = RegenerationSettings(
        prompt_paths=args.prompts, shard_size=args.shard_size, batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        max_prompts=args.max_prompts, dtype=args.dtype, exclude=list(args.exclude), sampling=args.sampling,
    )
    target, tokenizer = _load_target(args.target, DTYPES[args.dtype])
    target = target.to(_device(args.device))
    summary = regenerate(target, tokenizer, args.output, settings, worker_index=args.worker_index,
                         num_workers=args.num_workers, time_budget_s=args.time_budget_s)
    print(json.dumps(summary))
    return 0


def cmd_train(args) -> int:
    from .training.trainer import DSparkTrainer, TrainingArguments

    _require_shards(args.data, "--data")
    if args.eval_data:
        _require_shards(args.eval_data, "--eval-data")
    training_args = TrainingArguments(
        output_dir=args.output, data_dirs=args.data, target=args.target, init_drafter=args.init_drafter,
        features_dir=args.features, lora=args.lora, lora_rank=args.lora_rank,
        sequential_head=args.sequential_head, block_size=args.block_size, num_hidden_layers=args.num_layers,
        markov_rank=args.markov_rank, target_layer_ids=args.target_layer_ids,
        enable_confidence_head=not args.no_confidence_head, draft_vocab_size=args.draft_vocab_size,
        confidence_target=args.confidence_target, train_modules=args.train_modules, max_steps=args.max_steps,
        learning_rate=args.lr, warmup_ratio=args.warmup_ratio, batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, max_length=args.max_length, num_anchors=args.num_anchors,
        mixed_precision=args.mixed_precision, torch_compile=args.torch_compile, seed=args.seed,
        save_every=args.save_every,
        log_every=args.log_every, threads=args.threads, eval_data_dirs=args.eval_data, eval_every=args.eval_every,
        eval_sequences=args.eval_sequences,
        init_layers_from_target=args.init_layers_from_target, add_layers=args.add_layers,
    )
    summary = DSparkTrainer(training_args).train()
    print(json.dumps(summary))
    return 0


def cmd_features(args) -> int:
    from .configuration_dspark import DSparkConfig
    from .training.features import cache_features
    from .training.trainer import list_shards

    _require_shards(args.data, "--data")
    target, _, _ = _setup_target(args, args.target_dtype)
    target = target.to(_device(args.device))
    layer_ids = args.target_layer_ids or DSparkConfig.for_target(target.config).target_layer_ids
    summary = cache_features(target, list_shards(args.data), args.output, layer_ids, args.max_length,
                             dtype=DTYPES[args.dtype], batch_size=args.batch_size, worker_index=args.worker_index,
                             num_workers=args.num_workers)
    print(json.dumps(summary))
    return 0


def cmd_bench(args) -> int:
    """Rollouts over prompt sets: tau, position-wise acceptance, tokens/s as ratios to plain generate()."""
    import hf_dspark  # noqa: F401

    from .defaults import load_drafter_for
    from .evaluation import run_rollouts

    _require_prompts(args.prompts, "--prompts")
    target, tokenizer, dtype = _setup_target(args)
    methods = {"plain": {"assistant": False}}
    specs = args.drafter or [None]
    origins = {}
    for index, spec in enumerate(specs):
        drafter, origin = load_drafter_for(target, spec, dtype=dtype)
        label = args.labels[index] if args.labels else ("dspark" if len(specs) == 1 else f"drafter{index}")
        origins[label] = origin
        for policy in args.policies:
            name, _, value = policy.partition("=")
            settings = {"assistant": True, "drafter": drafter, "verification_policy": name}
            if args.draft_round is not None:
                settings["draft_round"] = args.draft_round
            if name == "fixed" and value:
                settings["num_verify_tokens"] = int(value)
            if name == "threshold":
                settings["confidence_threshold"] = float(value or 0.5)
            if name == "scheduler" and value:
                if value != "gated":
                    raise SystemExit(f"--policies {policy}: expected scheduler or scheduler=gated")
                settings["realized_gate"] = True
            methods[f"{label}:{policy}"] = settings
    if args.prompt_lookup:
        methods["prompt_lookup"] = {"prompt_lookup": args.prompt_lookup}
    if any(m.get("verification_policy") in ("scheduler", "hybrid") for m in methods.values()):
        from .generation import sps_width
        from .profiling import load_or_profile

        load_or_profile(target, max(sps_width(m["drafter"]) for m in methods.values() if "drafter" in m))
    report = run_rollouts(target, tokenizer, None, args.prompts, methods, num_prompts=args.num_prompts,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                          multi_turn=not args.first_turn_only)
    reports = {"drafters": origins, "report": report}
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "func"}, "results": reports}
    if args.output:
        from pathlib import Path

        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(payload, indent=2))
    if args.markdown:
        from pathlib import Path

        from .evaluation.bench_report import render_bench_markdown
        from .evaluation.report import environment

        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_bench_markdown(payload, environment()))
    for label, origin in origins.items():
        print(f"{label}: {origin}")
    for group, per_method in sorted(report.items()):
        cells = [f"{name}: {r['tokens_per_s']:.1f} tok/s x{r['speedup']:.2f}"
                 + (f" tau={r['accepted_length']:.2f}" if "accepted_length" in r else "")
                 + _source_shares(r.get("sources")) + _time_shares(r)
                 + (f" same={r['identical_to_baseline']}" if "identical_to_baseline" in r else "")
                 for name, r in per_method.items()]
        print(f"{group:16s} " + " | ".join(cells))
    return 0


def _source_shares(sources: dict | None) -> str:
    """`` [block 12% lookup 30% none 58%]``: where a method's rounds drafted from (empty without rounds)."""
    from .evaluation.bench_report import round_shares

    if not sources:
        return ""
    return " [" + " ".join(f"{name} {share:.0f}%" for name, share in sorted(round_shares(sources).items())) + "]"


def _time_shares(result: dict) -> str:
    """`` (draft 4% verify 90% loop 6%)``: where a drafting method's seconds went (empty for plain methods)."""
    from .evaluation.bench_report import TIME_PARTS, time_shares

    spent = time_shares(result)
    if not spent:
        return ""
    return " (" + " ".join(f"{TIME_PARTS[key]} {share:.0f}%" for key, share in spent.items()) + ")"


def cmd_calibrate(args) -> int:
    """Sequential Temperature Scaling on held-out rollouts; writes the calibrated drafter, sts.json, a plot."""
    from pathlib import Path

    import hf_dspark  # noqa: F401

    from collections import Counter

    from .calibration import (
        ROLLOUT_CHECKPOINT,
        collect_rollouts,
        cross_validated_sts,
        fit_sts,
        reliability_diagram,
        write_sts,
    )
    from .defaults import load_drafter_for
    from .prompts import excluded_prompt_ids, load_prompts, sample_prompts

    _require_prompts(args.prompts, "--prompts")
    target, tokenizer, dtype = _setup_target(args)
    drafter, origin = load_drafter_for(target, args.drafter, dtype=dtype)
    if drafter.confidence_head is None:
        raise ValueError(f"{origin} has no confidence head to calibrate")
    records = load_prompts(args.prompts)
    excluded = excluded_prompt_ids(args.exclude)
    records = [r for r in records if r["id"] not in excluded]
    records = sample_prompts(records, args.num_prompts, args.sampling, args.seed)
    drafter.config.confidence_temperatures = None
    output = Path(args.output)
    checkpoint = output / ROLLOUT_CHECKPOINT  # finished records survive an interruption; a rerun resumes
    rollouts = collect_rollouts(target, tokenizer, drafter, records, args.max_new_tokens, args.temperature, args.seed,
                                concurrency=args.concurrency, checkpoint=checkpoint,
                                checkpoint_key={"drafter": str(origin), "prompts": [str(p) for p in args.prompts],
                                                "dtype": args.dtype})
    fit = fit_sts(rollouts)
    if args.cv_folds:
        fit["cross_validation"] = cross_validated_sts(rollouts, args.cv_folds, seed=args.seed)
    output.mkdir(parents=True, exist_ok=True)
    drafter.config.confidence_temperatures = fit["temperatures"]
    drafter.save_pretrained(output)
    dataset = ",".join(sorted({r["set"] for r in records}))
    write_sts(output, fit, dataset)
    reliability_diagram(rollouts, fit["temperatures"], output / "reliability.png")
    (output / "calibration_report.json").write_text(json.dumps({
        "fit": fit, "rollouts": rollouts.to_dict(), "prompts": len(records),
        "prompt_ids": [r["id"] for r in records],
        "settings": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "dtype": args.dtype,
                     "seed": args.seed, "concurrency": args.concurrency, "sampling": args.sampling,
                     "cv_folds": args.cv_folds},
        "sets": dict(sorted(Counter(r["set"] for r in records).items()))}, indent=2))
    checkpoint.unlink()  # the report holds every round now
    fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    heldout = fit.get("cross_validation", {}).get("ece_after") or [None] * len(fit["temperatures"])
    for k, (t, before, after, cv, auc) in enumerate(zip(fit["temperatures"], fit["ece_before"], fit["ece_after"],
                                                        heldout, fit["auc"]), 1):
        cv_text = f" (held out {fmt(cv)})" if args.cv_folds else ""
        print(f"position {k}: T={t:.3f} ECE {fmt(before)} -> {fmt(after)}{cv_text} AUC {fmt(auc)} "
              f"n={fit['num_samples'][k-1]}")
    return 0


def cmd_profile(args) -> int:
    from .profiling import export_sps, load_or_profile, profile_path

    target, _, _ = _setup_target(args)
    sps = load_or_profile(target, args.max_batch_tokens, time_budget_s=args.time_budget, repeats=args.repeats)
    print(json.dumps({"cache": str(profile_path(target)), **sps.to_dict()}))
    if args.export:
        export_sps(sps, args.export)
    return 0


def cmd_export(args) -> int:
    """Write a drafter as the folder a serving engine (vLLM, SGLang, TensorRT-LLM, reference DeepSpec) reads."""
    from pathlib import Path

    from .defaults import embedded_drafter_path, load_drafter_for
    from .export import STS_FILE, export_for_engine

    if args.target in (None, "smollm2", "SmolLM2-135M-Instruct"):
        target, _ = _load_target(args.target, torch.float32)
    else:  # only the embedding and LM head are exported: no tokenizer needed
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter, origin = load_drafter_for(target, args.drafter, dtype=torch.float32)
    sts = args.sts
    source = Path(args.drafter) if args.drafter else embedded_drafter_path()
    if sts is None and args.engine != "vllm" and source is not None and (source / STS_FILE).is_file():
        sts = source / STS_FILE  # what `hf-dspark calibrate` wrote next to the drafter
    result = export_for_engine(drafter, args.output, args.engine, dtype=DTYPES[args.dtype], sts=sts, sps=args.sps)
    print(f"exported {origin} for {result.engine} to {result.folder}: {', '.join(result.files)}")
    print(f"serve: {result.launch}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def cmd_demo(args) -> int:
    """Serve the Gradio demo (plain vs DSpark streaming side by side) on SmolLM2-135M-Instruct, offline."""
    import hf_dspark  # noqa: F401

    from .demo import launch_default

    if args.threads:
        torch.set_num_threads(args.threads)
    launch_default(host=args.host, port=args.port, drafter=args.drafter, dtype=DTYPES[args.dtype],
                   max_new_tokens=args.max_new_tokens)
    return 0


def cmd_eval(args) -> int:
    """Accepted length, position-wise acceptance, threshold sweep, calibration and speed: report.json/.md + plots."""
    import hf_dspark  # noqa: F401

    from .defaults import embedded_drafter_path, load_drafter_for
    from .evaluation.report import DEFAULT_THRESHOLDS, EvalSettings, included_markdown, run_eval, write_report

    if args.benchmarks_include and not args.benchmarks:
        raise SystemExit("--benchmarks-include needs --benchmarks (the page the reports are appended to)")
    for path in args.benchmarks_include:  # refused now, not after the evaluation has run
        if not Path(path).is_file():
            raise SystemExit(f"--benchmarks-include: no such file {path}")
        included_markdown(path)
    if args.render_only:
        report_path = Path(args.output) / "report.json"
        if not report_path.is_file():
            raise SystemExit(f"--render-only: no {report_path} (run the evaluation first)")
        write_report(json.loads(report_path.read_text()), Path(args.output), args.benchmarks,
                     args.benchmarks_include, render_only=True)
        print(f"rewrote {args.output}/report.md" + (f" and {args.benchmarks}" if args.benchmarks else ""))
        return 0
    if not args.data:
        raise SystemExit("hf-dspark eval needs --data (unless --render-only)")
    settings = EvalSettings(
        data=args.data, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperatures=args.temperatures, speed_prompts=args.speed_prompts,
        speed_temperatures=args.speed_temperatures, speed_threshold=args.speed_threshold,
        thresholds=args.thresholds or list(DEFAULT_THRESHOLDS), prompt_lookup=args.prompt_lookup, scheduler=not args.no_scheduler,
        multi_turn=not args.first_turn_only, seed=args.seed,
    )
    if (args.num_shards is None) != (args.shard_index is None):
        raise ValueError("--num-shards and --shard-index go together")
    _require_prompts(args.data, "--data")
    target, tokenizer, dtype = _setup_target(args)
    drafter, origin = load_drafter_for(target, args.drafter, dtype=dtype)
    if args.ablation == "none":
        ablation, ablation_origin = None, None
    else:
        path = args.ablation or (embedded_drafter_path("smollm2-135m-instruct-dflash")
                                 if args.drafter is None and args.target is None else None)
        ablation, ablation_origin = load_drafter_for(target, str(path), dtype=dtype) if path else (None, None)
    description = {"target": args.target or "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)", "drafter": origin,
                   "ablation": ablation_origin, "dtype": args.dtype}
    report = run_eval(target, tokenizer, drafter, args.output, settings, ablation=ablation,
                      num_shards=args.num_shards, shard_index=args.shard_index, description=description,
                      benchmarks_path=args.benchmarks, phases=args.phases, concurrency=args.concurrency,
                      benchmarks_include=args.benchmarks_include)
    for t, entry in report["temperatures"].items():
        acc = entry.get("acceptance")
        if acc:
            macro = ", ".join(f"{m} {v['accepted_length']:.2f}" for m, v in acc["macro"].items())
            ratio = acc.get("tau_ratio_dspark_over_dflash", {}).get("macro")
            print(f"T={t}: macro tau {macro}" + (f" (DSpark/DFlash {ratio:.3f}x)" if ratio else ""))
        if entry.get("speed"):
            cells = ", ".join(f"{m} {r['speedup']:.2f}x" for m, r in entry["speed"]["all"].items() if m != "plain")
            print(f"T={t}: speed vs plain: {cells}")
    print(f"wrote {args.output}/report.json, report.md and plots" + (f"; {args.benchmarks}" if args.benchmarks else ""))
    if report["missing"]:
        print(f"incomplete: {len(report['missing'])} units still to run (other shards or --phases): "
              + ", ".join(report["missing"]))
    return 0


def cmd_push(args) -> int:
    """Push a drafter folder to the Hub: weights, code, custom_generate/, sts.json when calibrated, model card."""
    from pathlib import Path

    import hf_dspark  # noqa: F401  (saving writes auto_map and the code files)

    from .hub import load_report, push_drafter, training_text
    from .modeling_dspark import DSparkDrafter

    if not Path(args.drafter, "config.json").is_file():
        raise FileNotFoundError(f"drafter folder not found (no config.json): {args.drafter}")
    drafter = DSparkDrafter.from_pretrained(args.drafter, dtype="auto")
    info = push_drafter(
        drafter, args.repo_id, revision=args.revision, private=True if args.private else None, token=args.token,
        commit_message=args.commit_message, report=load_report(args.report) if args.report else None,
        training=training_text(args.run) if args.run else None, target_name=args.target_name,
    )
    print(f"pushed {args.drafter} to {info.repo_url.repo_id}@{args.revision or 'main'}: commit {info.oid}")
    return 0


def serve_command(settings: dict) -> str:
    """The ``hf-dspark bench-serve`` command line that a report's settings record (options left at their default
    omitted): what a report written without its command names as its command."""
    import shlex

    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = subcommands.choices["bench-serve"]
    parts = ["hf-dspark", "bench-serve"]
    for action in serve._actions:
        if not action.option_strings or action.dest in ("help", "output", "plot", "markdown", "from_report"):
            continue
        value = settings.get(action.dest, action.default)
        if value is None or value == action.default or value is False:
            continue
        flag = action.option_strings[-1]
        if value is True or (action.const is not None and value == action.const):
            parts.append(flag)
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    for flag in ("output", "plot"):
        if settings.get(flag):
            parts += [f"--{flag}", settings[flag]]
    return shlex.join(parts)


def _render_serve_report(args) -> int:
    """``bench-serve --from-report JSON --markdown MD``: the Markdown of an earlier report, nothing run."""
    from pathlib import Path

    from .evaluation.bench_report import render_serve_markdown

    if not args.markdown:
        raise UsageError("--from-report renders an earlier report: give --markdown, the file to write")
    path = Path(args.from_report)
    if not path.is_file():
        raise UsageError(f"--from-report: no file {path}")
    payload = json.loads(path.read_text())
    if "settings" not in payload or "results" not in payload:
        raise UsageError(f"--from-report: {path} is not a bench-serve report (no 'settings' and 'results')")
    env = payload.get("environment") or {"command": serve_command(payload["settings"])}
    Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
    Path(args.markdown).write_text(render_serve_markdown(payload, env))
    print(f"markdown: {args.markdown}")
    return 0


def cmd_bench_serve(args) -> int:
    """Replay a prompt set through the batched engine at several concurrencies: plain / fixed / scheduled."""
    from pathlib import Path

    from .defaults import load_drafter_for
    from .engine.bench import (bench_interleaved, bench_serve, encode_prompts, fix_allocator, lockstep_pairs,
                               measurements_from_report, parse_method, plot_bench, pretouch_setting)
    from .prompts import load_prompts

    if args.from_report:
        return _render_serve_report(args)
    if args.markdown == args.output and args.markdown:
        raise UsageError("--markdown and --output name the same file")
    if not args.prompts:
        raise UsageError("--prompts is required (or --from-report to render an earlier report)")
    specs = {method: parse_method(method, args.schedule) for method in args.methods}  # fail fast on a typo
    if args.lockstep == "pairs":
        lockstep_pairs(specs)  # and on a method nothing would be compared with, before loading anything
    if args.concurrency is None:
        args.concurrency = [1] if args.interleave else [1, 4, 16, 64]
    if args.interleave and args.concurrency != [1]:
        raise ValueError("--interleave compares the methods request by request, one request at a time: it needs "
                         f"--concurrency 1, got {' '.join(map(str, args.concurrency))}")
    if args.interleave and args.lockstep:
        raise ValueError("--interleave and --lockstep are two ways to interleave the methods: choose one")
    if args.interleave and args.cold_engines:
        raise ValueError("--interleave serves every prompt on one long-lived engine per method; --cold-engines "
                         "starts every run from nothing")
    pretouch = pretouch_setting(args.dynamic_allocator, args.pretouch)
    _require_prompts(args.prompts, "--prompts")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target, tokenizer, dtype = _setup_target(args)
    target = target.to(device)
    drafter, origin = None, None
    if any(not m.startswith("plain") for m in args.methods):
        drafter, origin = load_drafter_for(target, args.drafter, dtype=dtype)
        drafter = drafter.to(device)
    sps = None
    if args.sps:
        from .profiling import BatchedStepsPerSecond
        from .scheduling import StepsPerSecond

        data = json.loads(Path(args.sps).read_text())
        data = data.get("profile", data)  # hf-dspark profile's cache file wraps the curve
        sps = BatchedStepsPerSecond.from_dict(data) if "curves" in data else StepsPerSecond.from_dict(data)
    if args.measurements and args.cold_engines:
        raise ValueError("--measurements gives the scheduled engines a start; --cold-engines starts each from nothing")
    start = measurements_from_report(args.measurements, args.methods) if args.measurements else None
    allocator = None if pretouch is None else fix_allocator(pretouch=pretouch)
    print(f"allocator: {allocator or 'as the C library sets it'}", flush=True)
    prompts = encode_prompts(tokenizer, load_prompts(args.prompts), args.num_prompts, args.seed)
    print(f"target: {args.target or 'SmolLM2-135M-Instruct'} ({args.dtype}, {device}); drafter: {origin}; "
          f"{len(prompts)} prompts, {args.max_new_tokens} new tokens", flush=True)
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  schedule=args.schedule, sps=sps, seed=args.seed, repeats=args.repeats, warmup=not args.no_warmup,
                  measurements=start, log=lambda line: print(line, flush=True))
    if args.interleave:
        report = bench_interleaved(target, drafter, [ids for _, ids in prompts], args.methods, **common)
    else:
        report = bench_serve(target, drafter, [ids for _, ids in prompts], args.methods, args.concurrency,
                             share_measurements=not args.cold_engines, lockstep=args.lockstep or False, **common)
    from .evaluation.report import environment

    settings = {k: v for k, v in vars(args).items() if k != "func"}
    payload = {"settings": {**settings, "device": str(device), "drafter_origin": origin, "allocator": allocator,
                            "prompt_ids": [i for i, _ in prompts]}, "environment": environment(), **report}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(payload, indent=2))
    if args.markdown:
        from .evaluation.bench_report import render_serve_markdown

        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(render_serve_markdown(payload, payload["environment"]))
    plot = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot and len(args.concurrency) > 1:
        print(f"plot: {plot_bench(report, plot)}")
    elif args.plot:
        print(f"no plot: {args.plot} would show one concurrency; the plot needs 2 or more")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dspark", description="DSpark speculative decoding for transformers")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="DSpark-assisted greedy generation vs plain generate(): tokens/s, tau")
    gen.add_argument("--target", default=None, help="target model path (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", default=None, help="drafter folder (default: the embedded drafter)")
    gen.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    gen.add_argument("--policy", default=None,
                     help="verification policy: hybrid | fixed | threshold | scheduler | <registered> (default: hybrid "
                          "for drafters with a confidence head, else fixed)")
    gen.add_argument("--threshold", type=float, default=None, help="confidence threshold for --policy threshold")
    gen.add_argument("--draft-round", choices=DRAFT_ROUNDS, default=None, help=DRAFT_ROUND_HELP)
    gen.add_argument("--stop", nargs="+", default=None, metavar="STRING",
                     help="stop strings: both runs end where the text first contains one (as generate(stop_strings=))")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    gen.add_argument("--json", action="store_true", help="also print a JSON summary line")
    gen.set_defaults(func=cmd_generate)

    data = sub.add_parser("data", help="regenerate training responses with the target (sharded, resumable)")
    data.add_argument("--prompts", nargs="+", required=True, help="prompt .jsonl files or folders")
    data.add_argument("--output", required=True, help="output folder (re-run the same command to resume)")
    data.add_argument("--target", default=None)
    data.add_argument("--shard-size", type=int, default=64)
    data.add_argument("--batch-size", type=int, default=16)
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--temperature", type=float, default=0.2)
    data.add_argument("--top-p", type=float, default=0.9)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--max-prompts", type=int, default=None)
    data.add_argument("--exclude", nargs="*", default=[], help=EXCLUDE_HELP)
    data.add_argument("--sampling", choices=SAMPLINGS, default="shuffled",
                      help="order the prompts are taken in (and cut by --max-prompts): uniformly shuffled, or "
                           "balanced round-robin over the prompt sets")
    data.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    data.add_argument("--threads", type=int, default=None)
    data.add_argument("--num-workers", type=int, default=1, help="split shards over this many processes")
    data.add_argument("--worker-index", type=int, default=0, help="this process's share (0..num-workers-1)")
    data.add_argument("--device", default="auto", help="where the target runs (auto: cuda if available, else cpu)")
    data.add_argument("--time-budget-s", type=float, default=None,
                      help="start no new shard after this many seconds (finished shards are kept; re-run continues)")
    data.set_defaults(func=cmd_data)

    train = sub.add_parser("train", help="train a DSpark drafter (resumable: re-run the same command)")
    train.add_argument("--data", nargs="+", required=True, help="regenerated data folders (hf-dspark data)")
    train.add_argument("--output", required=True, help="run folder: checkpoints, logs, final drafter")
    train.add_argument("--target", default=None)
    train.add_argument("--init-drafter", default=None, help="start from this drafter folder")
    train.add_argument("--lora", action="store_true", help="PEFT LoRA fine-tuning of --init-drafter, merged at the end")
    train.add_argument("--lora-rank", type=int, default=16)
    train.add_argument("--features", default=None, help="cached target features (hf-dspark features); default online")
    train.add_argument("--sequential-head", choices=["none", "markov", "gated", "rnn"], default="markov")
    train.add_argument("--block-size", type=int, default=7)
    train.add_argument("--num-layers", type=int, default=2)
    train.add_argument("--markov-rank", type=int, default=256)
    train.add_argument("--target-layer-ids", type=_int_list, default=None, help="comma-separated, reference numbering")
    train.add_argument("--no-confidence-head", action="store_true")
    train.add_argument("--confidence-target", choices=["sampling", "greedy"], default="sampling",
                       help="confidence head label: sampling acceptance rate 1 - TV (paper) or greedy argmax match")
    train.add_argument("--train-modules", nargs="+", default=None, metavar="MODULE",
                       help="train only these drafter modules (e.g. confidence_head), the rest frozen")
    train.add_argument("--draft-vocab-size", type=int, default=None,
                       help="draft over the N most frequent response tokens (cheap drafting; default: full vocab)")
    train.add_argument("--max-steps", type=int, default=1000)
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--warmup-ratio", type=float, default=0.04)
    train.add_argument("--batch-size", type=int, default=4)
    train.add_argument("--grad-accum", type=int, default=1)
    train.add_argument("--max-length", type=int, default=512)
    train.add_argument("--num-anchors", type=int, default=64)
    train.add_argument("--mixed-precision", choices=["no", "bf16", "auto"], default="auto",
                       help="bf16 autocast; auto: where the device multiplies bf16 natively (CUDA, AVX512-BF16 or "
                            "AMX CPUs), else float32")
    train.add_argument("--torch-compile", action="store_true",
                       help="compile the drafter's decoder layers and the vocabulary-wide loss terms with "
                            "torch.compile (the first steps compile: pays on runs of more than a few hundred steps)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--save-every", type=int, default=100)
    train.add_argument("--log-every", type=int, default=10)
    train.add_argument("--threads", type=int, default=None)
    train.add_argument("--eval-data", nargs="+", default=None,
                       help="held-out regenerated-data folders: held-out accepted length, per-position acceptance "
                            "and losses in <output>/eval_log.jsonl (at the start, every --eval-every steps, the end)")
    train.add_argument("--eval-every", type=int, default=0, help="steps between held-out evaluations (0: start/end)")
    train.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences evaluated (fixed sample)")
    train.add_argument("--init-layers-from-target", type=_int_list, default=None, metavar="IDS",
                       help="comma-separated target layer per drafter layer (0-based), e.g. 28,29: start the "
                            "drafter's layers from those target layers instead of random weights")
    train.add_argument("--add-layers", type=int, default=0, metavar="N",
                       help="grow --init-drafter by N decoder layers that start as no-ops (copies of its last layer "
                            "with zeroed output projections): more capacity without losing what it learned")
    train.set_defaults(func=cmd_train)

    feat = sub.add_parser("features", help="cache target features of regenerated data (resumable)")
    feat.add_argument("--data", nargs="+", required=True)
    feat.add_argument("--output", required=True)
    feat.add_argument("--target", default=None)
    feat.add_argument("--target-layer-ids", type=_int_list, default=None, help="comma-separated (default: the drafter default)")
    feat.add_argument("--max-length", type=int, default=512)
    feat.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    feat.add_argument("--target-dtype", choices=sorted(DTYPES), default="float32")
    feat.add_argument("--batch-size", type=int, default=4)
    feat.add_argument("--threads", type=int, default=None)
    feat.add_argument("--num-workers", type=int, default=1)
    feat.add_argument("--worker-index", type=int, default=0)
    feat.add_argument("--device", default="auto", help="where the target runs (auto: cuda if available, else cpu)")
    feat.set_defaults(func=cmd_features)

    bench = sub.add_parser("bench", help="rollouts over prompt sets: tau, acceptance, tokens/s vs plain")
    bench.add_argument("--prompts", nargs="+", required=True)
    bench.add_argument("--drafter", nargs="*", default=None, help="drafter folder(s) (default: embedded)")
    bench.add_argument("--labels", nargs="*", default=None, help="a short name per --drafter")
    bench.add_argument("--target", default=None)
    bench.add_argument("--policies", nargs="+", default=["fixed"],
                       help="fixed | fixed=N | threshold=T | scheduler | scheduler=gated (the scheduler with its "
                            "opt-in realized gate) | hybrid (drafter block or prompt lookup, priced per round); one "
                            "method each (--prompt-lookup N adds transformers' own prompt lookup)")
    bench.add_argument("--prompt-lookup", type=int, default=0, help="also run prompt-lookup decoding with N tokens")
    bench.add_argument("--draft-round", choices=DRAFT_ROUNDS, default=None, help=DRAFT_ROUND_HELP)
    bench.add_argument("--num-prompts", type=int, default=50, help="per prompt set")
    bench.add_argument("--max-new-tokens", type=int, default=256)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--first-turn-only", action="store_true")
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--output", default=None, help="write the JSON report here")
    bench.add_argument("--markdown", default=None, help="also write the report as Markdown tables here")
    bench.set_defaults(func=cmd_bench)

    cal = sub.add_parser("calibrate", help="Sequential Temperature Scaling of the confidence head")
    cal.add_argument("--drafter", default=None)
    cal.add_argument("--target", default=None)
    cal.add_argument("--prompts", nargs="+", required=True, help="calibration prompts (disjoint from train/eval)")
    cal.add_argument("--exclude", nargs="*", default=[], help=EXCLUDE_HELP)
    cal.add_argument("--num-prompts", type=int, default=100)
    cal.add_argument("--sampling", choices=SAMPLINGS, default="balanced",
                     help="balanced: the same number of prompts from each set (as far as each set allows); "
                          "shuffled: a uniform sample of all prompts, so big sets dominate")
    cal.add_argument("--cv-folds", type=int, default=5,
                     help="report held-out ECE by this many folds over prompts (0: skip)")
    cal.add_argument("--max-new-tokens", type=int, default=128)
    cal.add_argument("--temperature", type=float, default=0.0)
    cal.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--threads", type=int, default=None)
    cal.add_argument("--concurrency", type=int, default=16,
                     help="prompts rolled out at once by the batched engine (1: generate() prompt by prompt)")
    cal.add_argument("--output", required=True,
                     help="folder for the calibrated drafter, sts.json, plot; finished rollouts are kept in "
                          "OUTPUT/rollouts.partial.jsonl until the end, and a rerun resumes from them")
    cal.set_defaults(func=cmd_calibrate)

    ev = sub.add_parser("eval", help="evaluation report: tau, position-wise acceptance, threshold sweep, "
                                     "calibration, speed vs plain (report.json/.md + plots, resumable)")
    ev.add_argument("--data", nargs="+", default=None,
                    help="prompt .jsonl files or folders (e.g. ../shared/data/eval); required unless --render-only")
    ev.add_argument("--output", required=True, help="report folder (re-run the same command to resume)")
    ev.add_argument("--target", default=None, help="target model path (default: SmolLM2-135M-Instruct)")
    ev.add_argument("--drafter", default=None, help="DSpark drafter folder (default: the embedded drafter)")
    ev.add_argument("--ablation", default=None,
                    help="DFlash-ablation drafter folder, or 'none' (default: the embedded ablation for the default pair)")
    ev.add_argument("--num-prompts", type=int, default=50, help="prompts per set for the acceptance analyses")
    ev.add_argument("--speed-prompts", type=int, default=10, help="prompts per set for the timed comparison")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ev.add_argument("--speed-temperatures", type=float, nargs="*", default=None,
                    help="temperatures for the timed comparison (default: --temperatures)")
    ev.add_argument("--thresholds", type=float, nargs="+", default=None, help="static-threshold sweep values")
    ev.add_argument("--speed-threshold", type=float, default=0.5, help="threshold of the timed threshold policy")
    ev.add_argument("--prompt-lookup", type=int, default=7, help="prompt-lookup tokens (0: skip that baseline)")
    ev.add_argument("--no-scheduler", action="store_true", help="skip the scheduled-verification timing")
    ev.add_argument("--first-turn-only", action="store_true")
    ev.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ev.add_argument("--threads", type=int, default=None)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--concurrency", type=int, default=1,
                    help="quality phase: prompts served at once by the batched engine (several times faster on a CPU; "
                         "the speed phase always times generate() prompt by prompt)")
    ev.add_argument("--num-shards", type=int, default=None, help="split the work over N processes (default: accelerate's)")
    ev.add_argument("--shard-index", type=int, default=None)
    ev.add_argument("--phases", nargs="+", choices=["quality", "speed"], default=["quality", "speed"],
                    help="quality: acceptance analyses (whole-block rounds); speed: timed comparison (run it quiet)")
    ev.add_argument("--benchmarks", default=None, help="also write the Markdown report here (e.g. BENCHMARKS.md)")
    ev.add_argument("--benchmarks-include", nargs="+", default=[], metavar="MARKDOWN",
                    help="generated reports (e.g. `hf-dspark bench --markdown`) appended to --benchmarks as sections")
    ev.add_argument("--render-only", action="store_true",
                    help="run nothing: rewrite report.md and --benchmarks from OUTPUT/report.json (plots as they are)")
    ev.set_defaults(func=cmd_eval)

    push = sub.add_parser("push", help="push a drafter folder to the Hugging Face Hub with its model card")
    push.add_argument("--drafter", required=True, help="drafter folder (save_pretrained / hf-dspark calibrate output)")
    push.add_argument("--repo-id", required=True, help="ORG/NAME")
    push.add_argument("--revision", "--branch", dest="revision", default=None,
                      help="branch to push to (created from main if missing; default: main)")
    push.add_argument("--private", action="store_true", help="create the repo as private")
    push.add_argument("--token", default=None, help="Hub token with write access (default: HF_TOKEN / hf auth login)")
    push.add_argument("--report", default=None, help="evaluation report JSON for the card (hf-dspark bench --output)")
    push.add_argument("--run", default=None, help="training run folder for the card's training section")
    push.add_argument("--target-name", default=None,
                      help="the target's Hub id for the card (default: from the folder's README.md)")
    push.add_argument("--commit-message", default=None)
    push.set_defaults(func=cmd_push)

    prof = sub.add_parser("profile", help="profile the target's SPS(B) curve (cached per device/dtype/threads)")
    prof.add_argument("--target", default=None)
    prof.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    prof.add_argument("--max-batch-tokens", type=int, default=8)
    prof.add_argument("--time-budget", type=float, default=60.0)
    prof.add_argument("--repeats", type=int, default=5)
    prof.add_argument("--threads", type=int, default=None)
    prof.add_argument("--export", default=None, help="also write the serving-engine SPS JSON here")
    prof.set_defaults(func=cmd_profile)

    exp = sub.add_parser("export", help="write a drafter folder for a serving engine (vllm, sglang, trtllm, reference)")
    exp.add_argument("--drafter", default=None, help="drafter folder (default: the embedded drafter)")
    exp.add_argument("--engine", required=True, choices=["vllm", "sglang", "trtllm", "reference"])
    exp.add_argument("--output", required=True, help="folder to write")
    exp.add_argument("--target", default=None, help="the drafter's target, whose embedding / LM head are copied "
                     "(default: SmolLM2-135M-Instruct)")
    exp.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="weight dtype of the export")
    exp.add_argument("--sps", default=None, help="SPS profile JSON (hf-dspark profile --export, or its cache file)")
    exp.add_argument("--sts", default=None, help="calibration JSON (default: the drafter folder's sts.json, if any)")
    exp.set_defaults(func=cmd_export)

    demo = sub.add_parser("demo", help="Gradio demo: plain vs DSpark streaming side by side, drafts per round")
    demo.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    demo.add_argument("--port", type=int, default=None, help="port (default: the first free one from 7860)")
    demo.add_argument("--drafter", default=None, help="drafter folder (default: the embedded drafter)")
    demo.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    demo.add_argument("--max-new-tokens", type=int, default=128, help="the UI's initial max new tokens")
    demo.add_argument("--threads", type=int, default=None)
    demo.set_defaults(func=cmd_demo)

    from .engine.bench import BENCH_PRETOUCH_MIB

    serve = sub.add_parser("bench-serve", help="batched serving: tokens/s and verification budget vs concurrency")
    serve.add_argument("--prompts", nargs="+", default=None, help="prompt .jsonl files or folders (required to run)")
    serve.add_argument("--num-prompts", type=int, default=64, help="prompts replayed (shuffled with --seed)")
    serve.add_argument("--max-new-tokens", type=int, default=256)
    serve.add_argument("--concurrency", type=int, nargs="+", default=None,
                       help="most requests in the batch at once (one run per value; default 1 4 16 64, or 1 with "
                            "--interleave)")
    serve.add_argument("--methods", nargs="+", default=["plain", "fixed", "scheduled"],
                       help="plain | fixed | fixed=N | scheduled | scheduled=padded|prefix|topk | hybrid (scheduled, "
                            "plus per-request prompt lookup; hybrid=SCHEDULE too); append ',ungated' "
                            "(or scheduled=ungated) to turn the realized gate off, ',emitted' to have the gate "
                            "count emitted tokens (gate_tokens); "
                            "append ',hold=H' to any method to "
                            "set the engine's admission_hold (0: admit at once), ',prefill=F' to set its "
                            "PrefillCost fixed_tokens (1e9: each admission in one padded forward)")
    serve.add_argument("--repeats", type=int, default=1,
                       help="run the methods of each concurrency N times (one after the other, round-robin, or "
                            "side by side with --lockstep); keep each method's fastest run (with --interleave: N "
                            "passes over the prompts, pooled)")
    serve.add_argument("--interleave", action="store_true",
                       help="with --concurrency 1: serve each prompt with every method back to back (one long-lived "
                            "engine per method, the first method rotating) and compare them request by request, so "
                            "the machine's drift cancels in each pair; --repeats passes over the prompts")
    serve.add_argument("--lockstep", nargs="?", const="all", choices=["all", "pairs"], default=None,
                       help="run each repeat's methods side by side, stepping whichever engine is furthest behind, "
                            "each method timed on its own steps: the machine's drift lands on every method alike; "
                            "'--lockstep pairs': each comparison (a method and plain, scheduled and fixed) in its own "
                            "two-engine lockstep, so no engine steps after a third one's steps")
    serve.add_argument("--schedule", choices=["padded", "prefix", "topk"], default="padded",
                       help="budget sharing for 'scheduled': Algorithm 1 by width layers (costed as the padded batch), "
                            "Algorithm 1 over single entries, or dynamic top-K")
    serve.add_argument("--sps", default=None, help="SPS profile JSON (default: profile the target, cached)")
    serve.add_argument("--drafter", default=None, help="drafter folder (default: the embedded drafter)")
    serve.add_argument("--target", default=None)
    serve.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    serve.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    serve.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs checked against plain)")
    serve.add_argument("--top-p", type=float, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--threads", type=int, default=None)
    serve.add_argument("--no-warmup", action="store_true", help="skip the short warm-up run of each method")
    serve.add_argument("--dynamic-allocator", action="store_true",
                       help="leave glibc malloc's thresholds adjusting themselves (by default they are pinned: "
                            "engines run in one process otherwise read a few percent apart by which ran first)")
    serve.add_argument("--pretouch", type=int, default=None, metavar="MIB",
                       help=f"with the thresholds pinned, pre-touch this much heap first (default {BENCH_PRETOUCH_MIB} "
                            "MiB, room for three engines' caches at 64 requests; 0: none), so that the page faults of "
                            "fresh memory do not land on whichever engine first needs it (each run's count is in the "
                            "report)")
    serve.add_argument("--cold-engines", action="store_true",
                       help="start every scheduled run from no timings (a fresh server) instead of sharing one "
                            "method's measurements across its warm-up and runs (a long-lived server)")
    serve.add_argument("--measurements", default=None,
                       help="start the scheduled engines from what an earlier bench-serve report (or an engine "
                            "measurements file) measured: a server that has learned this machine already")
    serve.add_argument("--output", default=None, help="write the JSON report here (and the plot next to it)")
    serve.add_argument("--plot", default=None, help="PNG path (default: --output with .png; needs 2+ concurrencies)")
    serve.add_argument("--markdown", default=None,
                       help="also write the report as a Markdown table here (BENCHMARKS.md can include it: "
                            "`hf-dspark eval --render-only --benchmarks-include`)")
    serve.add_argument("--from-report", default=None, metavar="JSON",
                       help="run nothing: write --markdown from an earlier --output report")
    serve.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.debug else logging.WARNING, format="%(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        _check_model_paths(args)
        return args.func(args)
    except KeyboardInterrupt:
        print("hf-dspark: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one clear line unless --debug
        if args.debug:
            raise
        print(f"hf-dspark: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1


if __name__ == "__main__":
    sys.exit(main())
