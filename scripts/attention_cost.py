"""Verify-forward cost with transformers' SDPA vs the engine's packed grouped-query attention.

For each batch size R and block width q: R rows of ``--context`` cached tokens with a few holes in the mask (as the
engine's rows have), then a q-token step with the target's hidden-state taps, timed with each attention
implementation, round-robin, median of ``--repeats`` after a warm-up. Also checks the two give the same greedy
tokens. Run it on a quiet machine:

    python scripts/attention_cost.py --dtype bfloat16 --threads 2 --output reports/attention-cost-bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from hf_dspark.attention import packed_attention  # noqa: E402
from hf_dspark.defaults import load_default  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--output", default=None, help="JSON file for the table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _, drafter = load_default(dtype=getattr(torch, args.dtype))
    taps = list(drafter.target_hidden_states_indices())
    vocab = target.config.vocab_size
    rows = []
    for batch in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch)
        cache = DynamicCache(config=target.config)
        valid = torch.ones(batch, args.context, dtype=torch.bool)
        valid[:, 10:20] = False  # holes: a rejected block, as in the engine's rows
        with torch.no_grad():
            target(input_ids=torch.randint(0, vocab, (batch, args.context), generator=generator),
                   attention_mask=valid, cache=cache, use_cache=True, logits_to_keep=1)
        for width in args.widths:
            block = torch.randint(0, vocab, (batch, width), generator=generator)
            positions = valid.sum(1, keepdim=True) + torch.arange(width)
            mask = torch.cat([valid, torch.ones(batch, width, dtype=torch.bool)], dim=1)
            seconds: dict[str, list[float]] = {"sdpa": [], "packed": []}
            tokens = {}
            for repeat in range(args.repeats + 1):
                for name in seconds:
                    context = packed_attention(target) if name == "packed" else torch.no_grad()
                    started = time.perf_counter()
                    with torch.no_grad(), context:
                        out = target(input_ids=block, attention_mask=mask, position_ids=positions, cache=cache,
                                     use_cache=True, output_hidden_states=taps)
                    elapsed = time.perf_counter() - started
                    cache.crop(-width)
                    if repeat:
                        seconds[name].append(elapsed)
                    tokens[name] = out.logits.argmax(-1)
            row = {"batch": batch, "width": width,
                   "sdpa_ms": 1000 * statistics.median(seconds["sdpa"]),
                   "packed_ms": 1000 * statistics.median(seconds["packed"]),
                   "same_greedy_tokens": bool((tokens["sdpa"] == tokens["packed"]).all())}
            rows.append(row)
            print(f"R={batch:<3d} q={width}: sdpa {row['sdpa_ms']:7.1f} ms  packed {row['packed_ms']:7.1f} ms  "
                  f"({row['sdpa_ms'] / row['packed_ms']:.2f}x)  same greedy tokens: {row['same_greedy_tokens']}",
                  flush=True)
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "output"}
        settings["cpu"] = _cpu_name()
        path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
        print(f"wrote {path}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
