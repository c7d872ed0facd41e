"""Speed against plain decoding across context lengths: end to end, decode only, time to first token, round split.

    python scripts/bench_context.py [--lengths 256 1024 4096 max] [--max-new-tokens 64] [--repeats 2]
        [--policies hybrid scheduler] [--prompt-lookup 10] [--dtype float32] [--threads 2]
        [--documents README.md docs/design.md docs/layout.md] [--output F.json] [--markdown F.md]

Each prompt is the start of one long document (by default this repository's own README and docs, concatenated)
cut to the given number of tokens, followed by "Summarise the text above in a few sentences." in the target's chat
template; ``max`` is the longest prompt the target's context holds with the new tokens. Methods run interleaved,
repeat after repeat, so drift in the machine's load hits each alike; each method runs once on a short prompt first
(warm-up). A streamer stamps the first generated token: time to first token (TTFT) covers the prefill and the first
round, decode-only covers the remaining tokens. Ratios are plain's seconds over the method's, summed over repeats
(TTFT: the method's over plain's). Outputs are compared with plain's token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

# Not BENCHMARKS.md: it carries this script's own table, so each run would change the next run's prompts.
DOCUMENTS = ["README.md", "docs/design.md", "docs/layout.md"]
INSTRUCTION = "\n\nSummarise the text above in a few sentences."


class FirstTokenClock(BaseStreamer):
    """Stamps the first ``put`` after the prompt's (the first generated token)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def build_prompts(tokenizer, documents: list[str], lengths: list[str], max_new_tokens: int, context: int) -> dict:
    """``{label: input_ids [1, n]}``: each document prefix of the asked length in the chat template."""
    text = "\n\n".join(Path(p).read_text(encoding="utf-8") for p in documents)
    ids = tokenizer(text, add_special_tokens=False).input_ids

    def prompt(n: int) -> torch.Tensor:
        messages = [{"role": "user", "content": tokenizer.decode(ids[:n]) + INSTRUCTION}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]

    overhead = prompt(1).shape[1] - 1
    longest = context - max_new_tokens - overhead - 8  # room for re-tokenisation at the cut
    prompts = {}
    for label in lengths:
        n = longest if label == "max" else int(label)
        if n > longest:
            raise SystemExit(f"--lengths {label}: the target's context ({context}) holds at most {longest} document "
                             f"tokens with {max_new_tokens} new ones")
        if n > len(ids):
            raise SystemExit(f"--lengths {label}: the documents hold only {len(ids)} tokens")
        prompts[label] = prompt(n)
    return prompts


def methods_for(args, drafter) -> dict:
    methods = {"plain": {}}
    for policy in args.policies:
        methods[policy] = {"assistant_model": drafter, "policy": policy}
    if args.prompt_lookup:
        methods["prompt_lookup"] = {"prompt_lookup_num_tokens": args.prompt_lookup}
    return methods


def run_once(target, drafter, input_ids, method: dict, max_new_tokens: int) -> dict:
    kwargs = {k: v for k, v in method.items() if k != "policy"}
    if "policy" in method:
        drafter.generation_config.verification_policy = method["policy"]
    clock = FirstTokenClock()
    started = time.perf_counter()
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, streamer=clock, **kwargs)
    ended = time.perf_counter()
    new = out[0, input_ids.shape[1]:].tolist()
    record = {"tokens": len(new), "seconds": ended - started, "ttft_s": clock.first_token_at - started,
              "output": new}
    if "policy" in method:
        stats = drafter.last_stats
        per_source: dict = {}
        for source, accepted, stamp in zip(stats.sources, stats.accepted, stats.stamps):
            entry = per_source.setdefault(source, {"rounds": 0, "accepted": 0, "seconds": 0.0})
            entry["rounds"] += 1
            entry["accepted"] += accepted
            entry["seconds"] += stamp[2] - stamp[0]  # drafting + verification of the round
        record["sources"] = per_source
        record["time_split"] = stats.time_split()
    return record


def summarise(runs: dict, max_new_tokens: int) -> dict:
    """Ratios per method against plain over the repeats, with plain's own times."""
    plain = runs["plain"]
    total = lambda rs, key: sum(r[key] for r in rs)  # noqa: E731
    decode = lambda rs: sum(r["seconds"] - r["ttft_s"] for r in rs)  # noqa: E731
    result = {}
    for name, rs in runs.items():
        entry = {
            "seconds": total(rs, "seconds"), "ttft_s": total(rs, "ttft_s"), "decode_s": decode(rs),
            "end_to_end": total(plain, "seconds") / total(rs, "seconds"),
            "decode_only": decode(plain) / decode(rs),
            "ttft_ratio": total(rs, "ttft_s") / total(plain, "ttft_s"),
            "identical": all(r["output"] == p["output"] for r, p in zip(rs, plain)),
        }
        if "sources" in rs[0]:
            merged: dict = {}
            for r in rs:
                for source, s in r["sources"].items():
                    m = merged.setdefault(source, Counter())
                    m.update(s)
            entry["sources"] = {k: dict(v) for k, v in merged.items()}
        result[name] = entry
    plain_step = decode(plain) / (len(plain) * (max_new_tokens - 1))
    result["plain"]["decode_step_s"] = plain_step
    return result


def markdown(report: dict) -> str:
    s = report["settings"]
    env = report.get("environment", {})
    lines = [
        "<!-- generated by `scripts/bench_context.py --markdown`; do not edit by hand -->",
        f"# Speed across context lengths: {s['dtype']}, {s['max_new_tokens']} new tokens",
        "",
        f"- Command: `{report['command']}`",
        f"- Machine: {env.get('cpu', 'not recorded')} ({env.get('cpu_count')} cores, {s['threads']} torch threads); "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}; run {report.get('run', 'not recorded')}",
        f"- Commit: `{report['commit']}` (the documents are read at this commit)",
        "",
        f"Prompts: the first N tokens of {', '.join(s['documents'])} (concatenated) + a request to summarise, "
        f"{s['max_new_tokens']} new tokens, greedy, {s['dtype']}, {s['threads']} threads, {s['repeats']} repeats "
        "interleaved. Ratios: plain's seconds over the method's (TTFT: the method's over plain's). "
        "Round cost: a round's seconds (drafting + verification) over plain's seconds per token, per draft source "
        "(rounds; accepted drafts).",
        "",
        "| prompt tokens | method | end to end | decode only | TTFT | plain TTFT s | round cost: none | block | "
        "lookup | same |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, entry in report["lengths"].items():
        plain = entry["methods"]["plain"]
        for name, m in entry["methods"].items():
            if name == "plain":
                continue
            cells = []
            for source in ("none", "block", "lookup"):
                src = m.get("sources", {}).get(source)
                cells.append(f"{src['seconds'] / src['rounds'] / plain['decode_step_s']:.2f} "
                             f"({src['rounds']}; {src['accepted']})" if src else "")
            lines.append(f"| {entry['prompt_tokens']} | {name} | {m['end_to_end']:.2f}x | {m['decode_only']:.2f}x | "
                         f"{m['ttft_ratio']:.3f} | {plain['ttft_s'] / s['repeats']:.2f} | " + " | ".join(cells)
                         + f" | {m['identical']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", default=["256", "1024", "4096", "max"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=["hybrid", "scheduler"])
    parser.add_argument("--prompt-lookup", type=int, default=10, help="also run transformers' prompt lookup (0: not)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--documents", nargs="+", default=DOCUMENTS)
    parser.add_argument("--output", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    import hf_dspark  # noqa: F401  (installs the generate() dispatch)
    from hf_dspark.defaults import load_default
    from hf_dspark.evaluation.report import environment
    from hf_dspark.generation import sps_width
    from hf_dspark.profiling import load_or_profile

    target, tokenizer, drafter = load_default(dtype=getattr(torch, args.dtype))
    load_or_profile(target, sps_width(drafter))
    documents = [str(REPO / p) if not Path(p).is_absolute() and (REPO / p).is_file() else p for p in args.documents]
    context = target.config.max_position_embeddings
    prompts = build_prompts(tokenizer, documents, args.lengths, args.max_new_tokens, context)
    methods = methods_for(args, drafter)
    warm = prompts[min(prompts, key=lambda k: prompts[k].shape[1])][:, -64:]
    for method in methods.values():
        run_once(target, drafter, warm, method, 8)
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    report = {"settings": {**vars(args), "documents": args.documents}, "lengths": {},
              "command": " ".join(["python scripts/bench_context.py", *(argv if argv is not None else sys.argv[1:])]),
              "commit": commit.stdout.strip() or "unknown", "environment": environment(),
              "run": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for label, input_ids in prompts.items():
        runs = {name: [] for name in methods}
        for repeat in range(args.repeats):
            for name, method in methods.items():
                runs[name].append(run_once(target, drafter, input_ids, method, args.max_new_tokens))
        summary = summarise(runs, args.max_new_tokens)
        report["lengths"][label] = {"prompt_tokens": input_ids.shape[1], "methods": summary}
        print(f"{input_ids.shape[1]:6d} tokens: " + " | ".join(
            f"{n} e2e {m['end_to_end']:.2f}x decode {m['decode_only']:.2f}x ttft {m['ttft_ratio']:.3f} "
            f"same={m['identical']}" for n, m in summary.items() if n != "plain")
            + f" | plain ttft {summary['plain']['ttft_s'] / args.repeats:.2f}s", flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
