"""``hf-dspark bench-serve``: replay a prompt set through the batched engine at several concurrencies.

All prompts are queued at once; the engine keeps at most C of them in the batch (a closed loop: a finished request's
slot goes to the next waiting one). Methods run interleaved per concurrency, so a noisy machine affects each alike:

- ``plain``: the same engine without drafting (one token per request per step), the baseline;
- ``fixed`` / ``fixed=N``: every request verifies its whole block (or N drafts) each step;
- ``scheduler`` / ``scheduler=prefix|topk``: a shared budget per step from the drafter's confidences and the
  profiled SPS(B) curve of the batch's total verification tokens; zero-budget requests skip drafting;
- ``hybrid`` / ``hybrid=prefix|topk`` (the default policy): ``scheduler``, and requests whose prompt lookup pays
  verify its drafts instead of the drafter's block;
- any other registered verification policy (``threshold``, or one registered with
  ``scheduling.register_verification_policy``): the engine verifying what that policy decides.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from ..allocator import BENCH_PRETOUCH_MIB, fix_allocator, pretouch_setting  # noqa: F401  (re-exported)
from ..engine.batching import DSparkEngine
from ..engine.config import scheduled_policy
from ..engine.requests import SamplingParams
from .paired_ratios import (  # noqa: F401  (plot_bench re-exported)
    _format_ratios,
    _format_request_ratios,
    against_baseline,
    against_baseline_by_request,
    plot_bench,
)
from ..stats import totals_by_source
from ..engine.trees import tree_tokens_per_request
from ..token_tree import draft_tree_mode
from .policy_specs import parse_policy


def measurements_from_report(path, methods: list[str]) -> dict:
    """``{method: EngineMeasurements}`` for the scheduled ``methods`` from a bench-serve report's ``measurements``
    (each method from its own entry, or from the report's only one), or from one ``EngineMeasurements.save`` file
    (every scheduled method starts from a copy of it)."""
    import json

    from ..engine.measurements import EngineMeasurements

    data = json.loads(Path(path).read_text())
    scheduled = [m for m in methods if scheduled_policy(parse_policy(m)["policy"])]
    if "key" in data:  # one EngineMeasurements file
        return {m: EngineMeasurements.from_dict(data) for m in scheduled}
    saved = data.get("measurements") or {}
    if not saved:
        raise ValueError(f"{path}: neither a bench-serve report with measurements nor an engine measurements file")
    out = {}
    for m in scheduled:
        entry = saved.get(m) or (next(iter(saved.values())) if len(saved) == 1 else None)
        if entry is None:
            raise ValueError(f"{path} has measurements for {sorted(saved)}, not for method {m!r}")
        out[m] = EngineMeasurements.from_dict(entry)
    return out


def encode_prompts(tokenizer, records: list[dict], num_prompts: int | None,
                   seed: int = 0) -> list[tuple[str, list[int]]]:
    """First turns of ``num_prompts`` records (shuffled with ``seed``), chat-templated: ``[(id, token ids)]``."""
    records = list(records)
    random.Random(seed).shuffle(records)
    selected = records[:num_prompts] if num_prompts else records
    out = []
    for record in selected:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": record["turns"][0]}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out.append((record["id"], inputs["input_ids"][0].tolist()))
    return out


def add_measurement_arguments(parser, *, num_prompts: int = 64, max_new_tokens: int = 32,
                              dtype: str = "bfloat16") -> None:
    """The options of an engine measurement script (``scripts/engine_prefill_batching.py``): which prompts and how
    many, new tokens per request, CPU threads and the dtype of SmolLM2 and the embedded drafter."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--prompts", default="../shared/data/eval")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=dtype)


def serve(engine, prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    """Queue every prompt on ``engine`` (greedy, ``max_new_tokens`` each) and run it to completion: (tokens
    generated, wall seconds of the run)."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=max_new_tokens))
    started = time.perf_counter()
    for _ in engine.stream():
        pass
    wall = time.perf_counter() - started
    return sum(len(o.token_ids) for o in engine.outputs.values()), wall


def load_measurement_setup(args) -> tuple:
    """For ``add_measurement_arguments``' options: set the thread count, load ``(target, tokenizer, drafter)``
    (``hf_dspark.load_default``) in the dtype, and encode the prompts (first turns, shuffled with seed 0)."""
    from ..defaults import load_default
    from ..prompts import load_prompts

    torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_default(dtype=getattr(torch, args.dtype))
    prompts = [ids for _, ids in encode_prompts(tokenizer, load_prompts([args.prompts]), args.num_prompts, 0)]
    return target, tokenizer, drafter, prompts


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _engine(target, drafter, concurrency: int, engine_kwargs: dict, sps, seed: int, measurements,
            **extra) -> DSparkEngine:
    """An engine for one method (``parse_policy``'s keyword arguments, and ``extra`` ones); scheduled ones price their
    budget from ``sps`` (a prior: measured steps reprice it) and start from and add to ``measurements``."""
    kwargs = {**engine_kwargs, **extra}
    kwargs.setdefault("optimize_target", None)  # the caller optimised the shared target once (or chose not to)
    if scheduled_policy(kwargs["policy"]):
        kwargs["sps"] = sps
        kwargs.setdefault("adapt_sps", True)  # the profile is a prior; measured steps price the budget
        kwargs["measurements"] = measurements
    return DSparkEngine(target, drafter if kwargs["policy"] != "plain" else None, max_concurrency=concurrency,
                        seed=seed, **kwargs)


def run_once(target, drafter, prompts: list[list[int]], params: SamplingParams, concurrency: int, engine_kwargs: dict,
             sps=None, seed: int = 0, measurements=None) -> tuple[dict, list[list[int]]]:
    """Serve every prompt at ``concurrency``; returns the summary and each request's tokens (prompt order).
    ``measurements``: an ``EngineMeasurements`` the engine starts from and adds to (scheduled methods)."""
    engine = _engine(target, drafter, concurrency, engine_kwargs, sps, seed, measurements)
    from tqdm.auto import tqdm

    ids = [engine.add_request(p, params) for p in prompts]
    bar = tqdm(total=len(ids), desc=f"{engine_kwargs['policy']} c={concurrency}", unit="request", leave=False)
    _sync(target)
    faults = page_faults()
    started = time.perf_counter()
    for event in engine.stream():
        if event.finished:
            bar.update()
    _sync(target)
    wall = time.perf_counter() - started
    bar.close()
    outputs = [engine.outputs[i] for i in ids]
    summary = _summary(outputs, wall, concurrency, engine)
    summary["page_faults"] = None if faults is None else page_faults() - faults
    return summary, [o.token_ids for o in outputs]


def run_lockstep(target, drafter, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                 specs: dict[str, dict], sps=None, seed: int = 0, measured: dict | None = None,
                 shift: int = 0) -> dict[str, tuple[dict, list[list[int]]]]:
    """``run_once`` for several methods side by side: one engine per method (``specs``: name -> engine keyword
    arguments), each given every prompt, and one ``step()`` at a time of the engine furthest behind (tokens
    emitted, a finished request counting its whole ``max_new_tokens``; ties go round in turn, starting ``shift``
    methods in), until all are done. Faster methods step less often, so every engine reaches its end at about the
    same time and a drift of the shared machine lands on all of them alike, instead of on whichever ran in a slow
    minute or ran on alone. Each method's wall time is the sum of its own steps, and its requests' timestamps count
    its own steps only (a ``StepClock`` per engine), as do the page faults in its summary. Returns ``{name: (summary,
    each request's tokens)}`` (``measured``: a scheduled method's shared ``EngineMeasurements``).

    An engine's step runs just after another's, and finds the caches and allocator as that one left them. With plain,
    fixed and scheduled, fixed's extra tokens shift the turns so that scheduled follows fixed's wide steps more often
    than plain does, which moves their ratio by a few percent; balancing the turns instead makes the scheduled
    engine's own steps alternate between warm and cold predecessors, noise its realized gate can read as drafting
    winning. So the turns stay as they are; compare two methods at a time for the scheduled engine's own cost
    (``bench_serve(lockstep="pairs")`` runs every comparison that way)."""
    from tqdm.auto import tqdm

    measured = measured or {}
    names = list(specs)
    names = names[shift % len(names):] + names[: shift % len(names)]
    clocks = {name: StepClock() for name in names}
    engines = {name: _engine(target, drafter, concurrency, specs[name], sps, seed, measured.get(name),
                             clock=clocks[name]) for name in names}
    ids = {name: [engine.add_request(p, params) for p in prompts] for name, engine in engines.items()}
    done = dict.fromkeys(names, 0)
    faults = dict.fromkeys(names, 0) if page_faults() is not None else None
    bar = tqdm(total=len(names) * len(prompts), desc=f"lockstep c={concurrency}", unit="request", leave=False)
    turn = 0
    while True:
        active = [name for name in names if engines[name].has_unfinished()]
        if not active:
            break
        name = min(active, key=lambda n: (done[n], (names.index(n) - turn) % len(names)))
        _sync(target)
        before = page_faults()
        with clocks[name]:
            events = engines[name].step()
            _sync(target)
        if faults is not None:
            faults[name] += page_faults() - before
        for event in events:
            done[name] += len(event.token_ids)
            if event.finished:
                done[name] += params.max_new_tokens - len(engines[name].outputs[event.request_id].token_ids)
                bar.update()
        turn += 1
    bar.close()
    out = {}
    for name in specs:
        outputs = [engines[name].outputs[i] for i in ids[name]]
        summary = _summary(outputs, clocks[name](), concurrency, engines[name])
        summary["lockstep"] = True
        summary["page_faults"] = None if faults is None else faults[name]
        out[name] = (summary, [o.token_ids for o in outputs])
    return out


class StepClock:
    """A clock that runs only inside ``with clock:`` blocks (``time.perf_counter`` seconds, summed over the blocks):
    an engine's time when several are stepped in turn (``DSparkEngine(clock=...)``)."""

    def __init__(self):
        self.spent = 0.0
        self._started: float | None = None

    def __call__(self) -> float:
        running = 0.0 if self._started is None else time.perf_counter() - self._started
        return self.spent + running

    def __enter__(self) -> "StepClock":
        if self._started is not None:
            raise RuntimeError("StepClock is already running")
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.spent += time.perf_counter() - self._started
        self._started = None


def _summary(outputs: list, wall: float, concurrency: int, engine: DSparkEngine) -> dict:
    """A method's tokens/s over ``wall`` seconds, its requests' own speeds and acceptance, and its engine's stats."""
    tokens = sum(len(o.token_ids) for o in outputs)
    per_request = [o.tokens_per_s for o in outputs]
    verified = sum(sum(o.stats.verified) for o in outputs)
    accepted = sum(sum(o.stats.accepted) for o in outputs)
    rounds = sum(o.stats.rounds for o in outputs)
    return {
        "concurrency": concurrency,
        "requests": len(outputs),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "per_request_tokens_per_s": {"mean": statistics.fmean(per_request), "median": statistics.median(per_request),
                                     "p10": _percentile(per_request, 0.1), "p90": _percentile(per_request, 0.9)},
        "accepted_length": (accepted + rounds) / rounds if rounds else 0.0,
        "acceptance_rate": accepted / verified if verified else 0.0,
        "by_source": totals_by_source([s for o in outputs for s in o.stats.sources],
                                      verified=[v for o in outputs for v in o.stats.verified],
                                      accepted=[a for o in outputs for a in o.stats.accepted]),
        **engine.stats.summary(),
    }


def drafting_steps(summary: dict) -> int:
    """Steps of one run (a ``run_once`` / ``run_lockstep`` summary) where some request drafted."""
    return sum(entry["drafting"]["steps"] for entry in summary["by_active_requests"].values())


def _counts(summary: dict) -> dict:
    """What one run did, machine noise aside: steps (and those where some request drafted), prefill forwards,
    slot-steps held for joiners, prefill seconds, page faults during its steps."""
    return {"steps": summary["steps"], "drafting_steps": drafting_steps(summary),
            "prefill_calls": summary["prefill_calls"], "held_slot_steps": summary["held_slot_steps"],
            "prefill_s": summary["prefill_s"], "page_faults": summary.get("page_faults")}


def page_faults() -> int | None:
    """This process's page faults so far (minor, first touches of memory; ``getrusage``), None where not counted."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _sync(model) -> None:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# How long a bench waits for the scheduler kernels to compile before its runs (one variant takes seconds; 15 took
# 88 s on an H200).
KERNEL_COMPILE_WAIT_S = 180.0


def compile_scheduler_kernels(target, drafter, specs: dict[str, dict], concurrencies, log=print) -> bool | None:
    """On CUDA, compile every scheduler kernel variant the scheduled methods of ``specs`` can launch at up to
    ``max(concurrencies)`` requests, before any run is timed. An engine otherwise compiles what it lacks in a
    background thread during its first steps: a compile holds Python's GIL for seconds, so those steps (host-bound
    on a GPU), and the measurements shared with later runs, come out slower for the scheduled methods only. Returns
    whether every compile finished (None where nothing compiles: off CUDA, or no scheduled method)."""
    from ..engine.verification import schedule_kernel_kinds

    device = next(target.parameters()).device
    kinds = sorted({kind for spec in specs.values() if scheduled_policy(spec["policy"])
                    for kind in schedule_kernel_kinds(spec["schedule"])})
    if device.type != "cuda" or not kinds:
        return None
    from ..kernels.scheduler import WARMUP, warm_scheduler_kernels

    started = time.perf_counter()
    warm_scheduler_kernels(device, max(concurrencies), drafter.config.block_size, kinds=tuple(kinds))
    finished = WARMUP.wait(KERNEL_COMPILE_WAIT_S)
    state = "compiled" if finished else "still compiling"
    log(f"scheduler kernels ({', '.join(kinds)}) {state} after {time.perf_counter() - started:.1f} s"
        + (f"; failed: {sorted(WARMUP.failed)}" if WARMUP.failed else ""))
    return finished


def _prepare(target, drafter, prompts, methods, concurrencies, max_new_tokens, temperature, top_p, schedule, sps, seed,
             warmup, repeats, share_measurements, measurements, log) -> tuple[dict, SamplingParams, object, dict]:
    """Check a bench's arguments; returns each method's engine keyword arguments, the requests' sampling
    parameters, the SPS profile (profiled, cached, when a scheduled method needs one and none is given) and each
    scheduled method's shared ``EngineMeasurements`` (after the warm-up runs, when ``warmup``)."""
    if not prompts:
        raise ValueError("no prompts to replay")
    if any(c < 1 for c in concurrencies):
        raise ValueError(f"concurrencies must be >= 1, got {concurrencies}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    specs = {m: parse_policy(m, schedule) for m in methods}
    if any(s["policy"] != "plain" for s in specs.values()) and drafter is None:
        raise ValueError("drafting methods need a drafter")
    greedy = temperature == 0
    params = SamplingParams(max_new_tokens=max_new_tokens, do_sample=not greedy,
                            temperature=temperature if not greedy else 1.0, top_p=top_p)
    if sps is None and any(scheduled_policy(s["policy"]) for s in specs.values()):
        from ..profiling import load_or_profile_batched, powers_of_two_with

        sizes = powers_of_two_with(concurrencies)
        log(f"profiling batched SPS(B) at batch sizes {sizes} (cached)")
        started = time.perf_counter()
        trees = any(spec.get("draft_tree", draft_tree_mode(drafter)) != "chain" for spec in specs.values())
        sps = load_or_profile_batched(target, sizes, tree_tokens_per_request(drafter.config.block_size, trees),
                                      hidden_state_indices=drafter.target_hidden_states_indices())
        log(f"batched SPS(B) ready after {time.perf_counter() - started:.1f} s")
    compile_scheduler_kernels(target, drafter, specs, concurrencies, log)
    from ..engine.measurements import EngineMeasurements

    measurements = measurements or {}
    scheduled = [name for name, spec in specs.items() if scheduled_policy(spec["policy"])]
    unknown = sorted(set(measurements) - set(scheduled))
    if unknown:
        raise ValueError(f"starting measurements for {unknown}, which are not scheduled methods of this run")
    if measurements and not share_measurements:
        raise ValueError("starting measurements need share_measurements (a cold engine starts from nothing)")
    measured = ({name: measurements.get(name) or EngineMeasurements() for name in scheduled}
                if share_measurements else {})
    if warmup:
        for name, spec in specs.items():
            run_once(target, drafter, prompts[:2], SamplingParams(max_new_tokens=8), 2, spec, sps, seed,
                     measured.get(name))
    return specs, params, sps, measured


def lockstep_pairs(specs: dict[str, dict]) -> list[tuple[str, str]]:
    """The two-engine locksteps of ``bench_serve(lockstep="pairs")``: ``(baseline, method)`` for each method and each
    of its baselines (``_baselines``: plain, and each fixed-length method for a scheduled one), in the methods'
    order. Every method must take part in one: a method nothing is compared with would have no runs."""
    pairs = [(other, name) for name in specs for other in _baselines(specs, name)]
    alone = [name for name in specs if not any(name in pair for pair in pairs)]
    if alone:
        raise ValueError(f"lockstep pairs compare each method with plain (and scheduled ones with fixed ones); "
                         f"{alone} would be compared with nothing")
    return pairs


def _plain(specs: dict[str, dict]) -> str | None:
    """The first plain method of a bench (every other is compared with it), or None."""
    return next((name for name, spec in specs.items() if spec["policy"] == "plain"), None)


def _baselines(specs: dict[str, dict], name: str) -> list[str]:
    """The methods ``name`` is compared with: plain (unless it is plain), and each fixed-length method for a
    scheduled one."""
    plain = _plain(specs)
    fixed = [other for other, spec in specs.items() if spec["policy"] == "fixed"]
    return ([plain] if plain is not None and name != plain else []) + (
        fixed if scheduled_policy(specs[name]["policy"]) else [])


def bench_serve(target, drafter, prompts: list[list[int]], methods: list[str], concurrencies: list[int],
                max_new_tokens: int = 256, temperature: float = 0.0, top_p: float | None = None,
                schedule: str = "padded", sps=None, seed: int = 0, warmup: bool = True, repeats: int = 1,
                share_measurements: bool = True, measurements: dict | None = None, lockstep: bool | str = False,
                log=print) -> dict:
    """Run every method at every concurrency; returns ``{"results": {method: {concurrency: summary}}, ...}``.

    ``repeats`` > 1 runs the methods of each concurrency round-robin that many times (each repeat starting one method
    later) and keeps each method's fastest
    run (every run's tokens/s is listed under ``runs_tokens_per_s``, their mean under ``mean_tokens_per_s``): on a
    shared machine the least disturbed run is the best estimate, and round-robin exposes every method to the same
    drift (``runs_counts`` lists what each run did: steps, drafting steps, prefill forwards). With ``plain`` among
    the methods, every other method gets ``vs_plain`` (``against_baseline``): the ratio of
    the fastest runs, of the means, and of each repeat's back-to-back runs (their geometric mean, with its standard
    error); every scheduled method also gets ``vs_<name>`` against each fixed-length method ``name``.

    ``sps`` (for scheduled methods): a ``BatchedStepsPerSecond`` / ``StepsPerSecond``; None profiles the target
    (cached) at batch sizes 1, 2, 4, .. up to the largest concurrency.

    ``share_measurements`` (scheduled methods): each method's engines share one ``EngineMeasurements`` across the
    warm-up and every run, as a long-lived server keeps what it has measured (drafter and verify costs, and what
    drafting delivered at each batch size); False starts every run from nothing, as a freshly started server.

    ``measurements``: ``{method: EngineMeasurements}`` a scheduled method starts from instead of nothing (with
    ``share_measurements``), e.g. what an earlier report measured (``measurements_from_report``): a server that has
    already learned this machine, without the runs that learn it. The objects are added to.

    ``lockstep``: each repeat runs its methods side by side instead of one after the other (``run_lockstep``: one
    step at a time of the engine furthest behind, each method timed on its own steps, all reaching their ends
    together), so the paired ratios of a repeat are not moved by the machine slowing down during one method's run.
    ``lockstep="pairs"``: each repeat runs every comparison as its own two-engine lockstep instead (``lockstep_pairs``:
    each method with each of its baselines), so no engine steps after a third method's steps: with plain, fixed and
    scheduled side by side the scheduled engine follows fixed's wide steps two to three times as often as plain does
    (``run_lockstep``). A method's listed runs are those with its first partner (plain for the others, and plain's
    with the first method compared with it), each ``vs_<other>`` pairs its runs with ``other``'s from the same
    locksteps; each row's ``lockstep_partner`` names whom its listed runs stepped beside, and ``runs_beside`` holds
    its runs' tokens/s and counts by partner.
    """
    if lockstep not in (False, True, "all", "pairs"):
        raise ValueError(f"lockstep must be False, True (or 'all') or 'pairs', got {lockstep!r}")
    specs, params, sps, measured = _prepare(target, drafter, prompts, methods, concurrencies, max_new_tokens,
                                            temperature, top_p, schedule, sps, seed, warmup, repeats,
                                            share_measurements, measurements, log)
    pairs = lockstep_pairs(specs) if lockstep == "pairs" else None
    results: dict[str, dict[str, dict]] = {m: {} for m in methods}
    for concurrency in concurrencies:
        runs, beside = _serve_repeats(target, drafter, prompts, params, concurrency, specs, sps, seed, measured,
                                      repeats, lockstep, pairs, log)
        rows, tokens = _fastest_runs(specs, runs, beside, pairs)
        reference = None if params.do_sample else _plain_tokens(specs, tokens)
        for name in methods:
            results[name][str(concurrency)] = rows[name]
            _compare_with_baselines(rows[name], name, specs, runs, beside, pairs, concurrency, log)
            if reference is not None:
                same = sum(a == b for a, b in zip(tokens[name], reference))
                rows[name]["identical_to_plain"] = f"{same}/{len(reference)}"
    return {"results": results, "sps": None if sps is None else sps.to_dict(),
            "measurements": {name: m.to_dict() for name, m in measured.items()}}


def _serve_repeats(target, drafter, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                   specs: dict[str, dict], sps, seed: int, measured: dict, repeats: int, lockstep: bool | str,
                   pairs: list[tuple[str, str]] | None, log) -> tuple[dict[str, list], dict[tuple[str, str], list]]:
    """Every repeat of ``bench_serve``'s methods at one concurrency: ``(runs, beside)``, each method's ``(summary,
    tokens)`` runs (with lockstep ``pairs``, those beside its first partner) and, with lockstep ``pairs``, each
    ``(method, partner)``'s runs in the two-engine locksteps they shared."""
    runs: dict[str, list] = {name: [] for name in specs}
    beside: dict[tuple[str, str], list] = {}
    names = list(specs)
    for repeat in range(repeats):
        if pairs is not None:
            # each comparison in its own lockstep, the first pair rotating with the repeat
            for first, second in pairs[repeat % len(pairs):] + pairs[: repeat % len(pairs)]:
                together = run_lockstep(target, drafter, prompts, params, concurrency,
                                        {first: specs[first], second: specs[second]}, sps, seed, measured,
                                        shift=repeat)
                for name, partner in ((first, second), (second, first)):
                    beside.setdefault((name, partner), []).append(together[name])
                    _log_run(log, concurrency, f"{name} (beside {partner})", together[name][0])
            continue
        # Each repeat starts one method later, so no method always runs right after the same other one (a run
        # after fixed-length verification's wide steps may find the memory allocator or caches in another state).
        order = names[repeat % len(names):] + names[: repeat % len(names)]
        together = (run_lockstep(target, drafter, prompts, params, concurrency, specs, sps, seed, measured,
                                 shift=repeat) if lockstep else None)
        for name in order:
            summary, tokens = together[name] if lockstep else run_once(
                target, drafter, prompts, params, concurrency, specs[name], sps, seed, measured.get(name))
            runs[name].append((summary, tokens))
            _log_run(log, concurrency, name, summary)
    if pairs is not None:
        runs = {name: beside[(name, _first_partner(pairs, name))] for name in specs}
    return runs, beside


def _log_run(log, concurrency: int, name: str, summary: dict) -> None:
    """One line per run: its aggregate and per-request tokens/s, verification budget per step and tau."""
    log(f"c={concurrency:<4d} {name:20s} {summary['tokens_per_s']:9.1f} tok/s  per-request "
        f"{summary['per_request_tokens_per_s']['mean']:7.1f} tok/s  budget "
        f"{summary['mean_verify_tokens_per_step']:6.1f} drafts/step  tau {summary['accepted_length']:.2f}")


def _first_partner(pairs: list[tuple[str, str]], name: str) -> str:
    """The method ``name`` shares its first lockstep pair with: whom its listed runs stepped beside."""
    return next(b if a == name else a for a, b in pairs if name in (a, b))


def _fastest_runs(specs: dict[str, dict], runs: dict[str, list], beside: dict[tuple[str, str], list],
                  pairs: list[tuple[str, str]] | None) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    """Each method's row at one concurrency, its fastest run's summary with every run's tokens/s and counts (and,
    with lockstep ``pairs``, its partner and its runs beside each partner), and that run's tokens:
    ``({name: row}, {name: each request's tokens})``."""
    rows, tokens = {}, {}
    for name in specs:
        summary, tokens[name] = max(runs[name], key=lambda run: run[0]["tokens_per_s"])
        summary["runs_tokens_per_s"] = [run[0]["tokens_per_s"] for run in runs[name]]
        summary["runs_counts"] = [_counts(run[0]) for run in runs[name]]
        summary["mean_tokens_per_s"] = statistics.fmean(summary["runs_tokens_per_s"])
        if pairs is not None:
            summary["lockstep"] = "pairs"
            summary["lockstep_partner"] = _first_partner(pairs, name)
            summary["runs_beside"] = {partner: {"runs_tokens_per_s": [run[0]["tokens_per_s"] for run in mine],
                                                "runs_counts": [_counts(run[0]) for run in mine]}
                                      for (member, partner), mine in beside.items() if member == name}
        rows[name] = summary
    return rows, tokens


def _plain_tokens(specs: dict[str, dict], tokens: dict[str, list[list[int]]]) -> list[list[int]] | None:
    """The tokens of the bench's last plain method, which every method's greedy outputs are compared with; None
    without one."""
    plain = [name for name, spec in specs.items() if spec["policy"] == "plain"]
    return tokens[plain[-1]] if plain else None


def _compare_with_baselines(row: dict, name: str, specs: dict[str, dict], runs: dict[str, list],
                            beside: dict[tuple[str, str], list], pairs: list[tuple[str, str]] | None,
                            concurrency: int, log) -> None:
    """``row``'s ``vs_<other>`` for each method ``name`` is compared with (``_baselines``): ``against_baseline`` of
    its runs and other's from the same repeats (with lockstep ``pairs``, from the locksteps the two shared)."""
    def rates(method: str, other: str) -> list[float]:
        return [run[0]["tokens_per_s"] for run in (runs[method] if pairs is None else beside[(method, other)])]

    for other in _baselines(specs, name):
        ratios = against_baseline(rates(name, other), rates(other, name))
        row[f"vs_{other}"] = ratios
        log(f"c={concurrency:<4d} {name:20s} vs {other}: {_format_ratios(ratios)}")


def serve_request(engine: DSparkEngine, prompt: list[int], params: SamplingParams, target=None) -> tuple:
    """Queue one request on an idle ``engine`` and run it to completion: (its ``RequestOutput``, wall seconds)."""
    if engine.has_unfinished():
        raise ValueError("serve_request needs an idle engine: it times one request alone")
    request_id = engine.add_request(prompt, params)
    if target is not None:
        _sync(target)
    started = time.perf_counter()
    for _ in engine.stream():
        pass
    if target is not None:
        _sync(target)
    return engine.outputs[request_id], time.perf_counter() - started


def bench_interleaved(target, drafter, prompts: list[list[int]], methods: list[str], max_new_tokens: int = 256,
                      temperature: float = 0.0, top_p: float | None = None, schedule: str = "padded", sps=None,
                      seed: int = 0, warmup: bool = True, repeats: int = 1, measurements: dict | None = None,
                      log=print) -> dict:
    """Concurrency 1, compared request by request: one long-lived engine per method (a server that keeps running, so
    a scheduled engine's learning, its shared measurements and its survival correction, carries from pass to pass),
    and every prompt served by each method in turn, back to back, ``repeats`` passes over the prompts. The order
    rotates with the prompt (and with every second pass), and each odd pass serves every prompt in the reverse of
    its order in the pass before: over each two passes a method follows each other method as often as it precedes
    it, on every prompt.

    At one request at a time a server's aggregate throughput is its requests' tokens over their summed times (each
    timed from its admission and prefill to its last token), so this measures what ``bench_serve`` does at
    concurrency 1. But the two runs of a pair lie about a second apart instead of a whole run: the drift of a shared
    machine (often 10% between whole runs here) cancels in each pair, and every request is a pair.

    Returns a report like ``bench_serve``'s at concurrency "1", except that each method's ``tokens_per_s`` pools every
    pass (``runs_tokens_per_s`` lists each pass's) and its ``vs_plain`` (every other method, with plain among the
    methods) and ``vs_<fixed>`` (scheduled methods, for each fixed-length one) are ``against_baseline_by_request``'s,
    with each prompt's pairs as one group."""
    specs, params, sps, measured = _prepare(target, drafter, prompts, methods, [1], max_new_tokens, temperature,
                                            top_p, schedule, sps, seed, warmup, repeats, True, measurements, log)
    names = list(specs)
    engines = {name: _engine(target, drafter, 1, specs[name], sps, seed, measured.get(name)) for name in names}
    outputs, seconds = _serve_interleaved(target, engines, prompts, params, repeats, log)
    results: dict[str, dict[str, dict]] = {}
    for name in names:
        summary = _summary(outputs[name], sum(seconds[name]), 1, engines[name])
        summary["runs_tokens_per_s"] = [_pass_rate(outputs[name], seconds[name], repeat, len(prompts))
                                        for repeat in range(repeats)]
        summary["mean_tokens_per_s"] = statistics.fmean(summary["runs_tokens_per_s"])
        summary["interleaved"] = True
        results[name] = {"1": summary}
    baseline = _plain(specs)
    prompt_of = [index for _ in range(repeats) for index in range(len(prompts))]  # each prompt's passes: one unit
    for name in names:
        row = results[name]["1"]
        for other in _baselines(specs, name):
            ratios = against_baseline_by_request([len(o.token_ids) for o in outputs[name]], seconds[name],
                                                 [len(o.token_ids) for o in outputs[other]], seconds[other],
                                                 groups=prompt_of)
            row[f"vs_{other}"] = ratios
            log(f"c=1    {name:20s} vs {other}: {_format_request_ratios(ratios)}")
        if baseline is not None and not params.do_sample:
            same = sum(a.token_ids == b.token_ids for a, b in zip(outputs[name], outputs[baseline]))
            row["identical_to_plain"] = f"{same}/{len(outputs[name])}"
    return {"results": results, "sps": None if sps is None else sps.to_dict(),
            "measurements": {name: m.to_dict() for name, m in measured.items()}}


def _serve_interleaved(target, engines: dict[str, DSparkEngine], prompts: list[list[int]], params: SamplingParams,
                       repeats: int, log) -> tuple[dict[str, list], dict[str, list[float]]]:
    """``bench_interleaved``'s passes: every prompt served by each method's engine in turn, the order rotating with
    the prompt (and with every second pass), reversed on odd passes. Returns each method's ``RequestOutput``s and
    wall seconds, in (pass, prompt) order."""
    from tqdm.auto import tqdm

    names = list(engines)
    outputs: dict[str, list] = {name: [] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    bar = tqdm(total=repeats * len(prompts), desc="interleaved c=1", unit="prompt", leave=False)
    for repeat in range(repeats):
        for index, prompt in enumerate(prompts):
            shift = (index + repeat // 2) % len(names)
            order = names[shift:] + names[:shift]
            for name in (order if repeat % 2 == 0 else order[::-1]):
                output, wall = serve_request(engines[name], prompt, params, target)
                outputs[name].append(output)
                seconds[name].append(wall)
            bar.update()
        log(f"pass {repeat + 1}: " + ", ".join(
            f"{name} {_pass_rate(outputs[name], seconds[name], repeat, len(prompts)):.1f} tok/s" for name in names))
    bar.close()
    return outputs, seconds


def _pass_rate(outputs: list, seconds: list[float], repeat: int, count: int) -> float:
    """A method's tokens/s over pass ``repeat`` of ``count`` requests (its outputs and seconds in pass order)."""
    done = slice(repeat * count, (repeat + 1) * count)
    return sum(len(o.token_ids) for o in outputs[done]) / sum(seconds[done])


__all__ = ["BENCH_PRETOUCH_MIB", "StepClock", "add_measurement_arguments", "against_baseline",
           "against_baseline_by_request", "bench_interleaved", "bench_serve", "drafting_steps", "encode_prompts",
           "fix_allocator", "load_measurement_setup", "lockstep_pairs", "measurements_from_report", "page_faults",
           "parse_policy", "plot_bench", "pretouch_setting", "run_lockstep", "run_once", "serve", "serve_request"]
