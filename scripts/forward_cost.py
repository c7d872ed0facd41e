#!/usr/bin/env python
"""Where a k-token target forward's time goes, against the floor of streaming the weights once.

For each dtype, linear path (torch's stock linears, oneDNN-prepacked ones: ``hf_dspark.optimize_target``), cache
length and width k, it times the target's forward over a cache of that length (the fastest of ``--repeats``, widths
round-robin so drift hits them alike, under the packed grouped-query attention DSpark verifies with) and splits one
profiled forward into: the decoder's linears, the LM head, attention over the cache, appending to the KV cache,
the rest of the kernels (norms, rotary, activations, residual adds) and what no kernel accounts for (Python,
dispatch and the profiler's own cost). The floor is the weights' bytes over the machine's measured read bandwidth (a
sum over a 256 MiB buffer, fastest of ten).

    python scripts/forward_cost.py --output reports/forward-cost.md
    python scripts/forward_cost.py --dtypes float32 --contexts 256 --widths 1 2 4 8 16   # the short form
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 17)
CONTEXTS = (64, 256, 1024, 4096)
CATEGORIES = ("linears", "lm_head", "attention", "kv_cache", "other_kernels", "python_dispatch")
LINEAR_OPS = {"aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "mkldnn::_linear_pointwise", "aten::linear"}


def read_bandwidth() -> float:
    """Bytes per second the machine reads with torch's threads: a sum over 256 MiB, fastest of ten."""
    buffer = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(10):
        started = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * buffer.element_size() / best


def weight_bytes(model) -> int:
    """What one forward streams: every parameter once (tied ones once), the embedding table excepted unless the LM
    head shares it (a lookup reads one row of it)."""
    seen, total = set(), 0
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    for parameter in model.parameters():
        if id(parameter) in seen or (parameter is embedding and head is not embedding):
            continue
        seen.add(id(parameter))
        total += parameter.numel() * parameter.element_size()
    return total


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{fields.get('Model name', '?').strip()} ({', '.join(wanted)})"


KV_CACHE_RANGE = "forward_cost::kv_cache_update"


@contextlib.contextmanager
def labelled_cache_updates():
    """Every transformers cache layer's ``update`` (appending the new keys and values) runs inside a profiler range,
    so its kernels are told apart from the identical ones (``cat``) that rotary embeddings call."""
    from transformers import cache_utils

    patched = []
    for cls in vars(cache_utils).values():
        if isinstance(cls, type) and cls.__name__.endswith("Layer") and "update" in vars(cls):
            original = vars(cls)["update"]

            def update(self, *args, _original=original, **kwargs):
                with torch.profiler.record_function(KV_CACHE_RANGE):
                    return _original(self, *args, **kwargs)

            patched.append((cls, original))
            cls.update = update
    try:
        yield
    finally:
        for cls, original in patched:
            cls.update = original


def classify(event, vocab: int) -> str:
    """The category of one profiled op: by the range it runs in (cache update, attention), else by name and shapes."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == KV_CACHE_RANGE:
            return "kv_cache"
        if "scaled_dot_product" in parent.name:
            return "attention"
        parent = parent.cpu_parent
    if event.name in LINEAR_OPS:
        return "lm_head" if any(vocab in shape for shape in event.input_shapes if shape) else "linears"
    if "scaled_dot_product" in event.name:
        return "attention"
    return "other_kernels"


def profiled_split(model, step, vocab: int, wall: float) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with labelled_cache_updates(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        started = time.perf_counter()
        step()
        profiled_wall = time.perf_counter() - started
    split = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.events():
        if event.name != KV_CACHE_RANGE:
            split[classify(event, vocab)] += event.self_cpu_time_total / 1e6
    # The profiler slows every op a little; the kernels' shares are scaled to the unprofiled forward.
    kernels = sum(split.values())
    scale = wall / profiled_wall
    split = {k: v * scale for k, v in split.items()}
    split["python_dispatch"] = max(0.0, wall - kernels * scale)
    return split


def measure(model, widths, context: int, repeats: int) -> dict[int, dict]:
    from transformers import DynamicCache

    from hf_dspark.attention import packed_attention

    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context), generator=generator)
    steps = {w: torch.randint(0, vocab, (1, w), generator=generator) for w in widths}
    results = {}
    with torch.inference_mode(), packed_attention(model):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

        def step_for(w):
            def step():
                model(input_ids=steps[w], cache=cache, position_ids=torch.arange(context, context + w)[None],
                      use_cache=True)
                cache.crop(-w)
            return step

        times = {w: [] for w in widths}
        for r in range(repeats + 1):
            for w in widths:
                started = time.perf_counter()
                step_for(w)()
                if r:
                    times[w].append(time.perf_counter() - started)
        for w in widths:
            wall = min(times[w])
            results[w] = {"seconds": wall, "split": profiled_split(model, step_for(w), vocab, wall)}
    return results


def table(rows: list[dict], floor: float) -> list[str]:
    lines = ["| linears | context | width | forward ms | x width 1 | x floor | " + " | ".join(CATEGORIES) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(CATEGORIES)]
    for row in rows:
        split = " | ".join(f"{row['split'][c] * 1e3:.1f}" for c in CATEGORIES)
        lines.append(f"| {row['linears']} | {row['context']} | {row['width']} | {row['seconds'] * 1e3:.1f} | "
                     f"{row['ratio']:.2f} | {row['seconds'] / floor:.2f} | {split} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--linears", nargs="+", default=["stock", "prepacked"], choices=["stock", "prepacked"])
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, help="write the Markdown report here (and the numbers as .json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from hf_dspark.optimization import optimize_target
    from hf_dspark.target import load_smollm2

    bandwidth = read_bandwidth()
    lines = ["<!-- generated by `python scripts/forward_cost.py`; do not edit by hand -->",
             f"# Where a verification forward's time goes: SmolLM2-135M-Instruct, {args.threads} threads", "",
             f"CPU: {cpu_model()}; torch {torch.__version__}; read bandwidth {bandwidth / 1e9:.1f} GB/s.",
             "Times are milliseconds of one forward (fastest of "
             f"{args.repeats}); the split comes from one profiled forward, scaled to it. Command: "
             f"`python scripts/forward_cost.py {' '.join(sys.argv[1:] if argv is None else argv)}`.", ""]
    report = {"cpu": cpu_model(), "bandwidth_bytes_per_s": bandwidth, "threads": args.threads, "rows": {}}
    for dtype_name in args.dtypes:
        model, _ = load_smollm2(dtype=getattr(torch, dtype_name))
        floor = weight_bytes(model) / bandwidth
        lines += [f"## {dtype_name}", "", f"Weights streamed per forward: {weight_bytes(model) / 1e6:.0f} MB; floor "
                  f"{floor * 1e3:.1f} ms.", ""]
        rows = []
        for linears in args.linears:
            optimize_target(model, "on" if linears == "prepacked" else "off")
            for context in args.contexts:
                print(f"[forward_cost] {dtype_name} {linears} context {context}", file=sys.stderr, flush=True)
                measured = measure(model, args.widths, context, args.repeats)
                one = measured[min(measured)]["seconds"]
                rows += [{"linears": linears, "context": context, "width": w, "ratio": m["seconds"] / one, **m}
                         for w, m in measured.items()]
        lines += table(rows, floor) + [""]
        report["rows"][dtype_name] = {"floor_seconds": floor, "rows": rows}
        del model
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
        args.output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
