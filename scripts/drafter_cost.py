"""Per-round cost of drafting vs target forwards on SmolLM2-135M-Instruct (median ms, this machine).

Compares a target forward over 1 and over 8 tokens (a full g=7 verification) with one drafting round (2 draft
layers, block 7) for the full vocabulary and for draft vocabularies, with and without the Markov head.

    python scripts/drafter_cost.py --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

import hf_dspark  # noqa: F401
from hf_dspark import DSparkConfig, DSparkDrafter
from hf_dspark.target import load_smollm2


def median_ms(fn, repeats: int = 9) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--draft-vocab-sizes", type=int, nargs="+", default=[0, 8192, 4096])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, _ = load_smollm2(dtype=dtype)
    ids = torch.randint(0, target.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        out = target(ids, cache=cache, output_hidden_states=True)

    def target_forward(tokens):
        def run():
            with torch.no_grad():
                target(ids[:, :tokens], cache=cache, use_cache=True)
            cache.crop(-tokens)
        return run

    results = {"target_1_token_ms": median_ms(target_forward(1)), "target_8_tokens_ms": median_ms(target_forward(8))}
    anchor = args.context - 1
    for size in args.draft_vocab_sizes:
        for head in ("markov", "none"):
            config = DSparkConfig.for_target(target.config, num_hidden_layers=2, sequential_head=head,
                                             draft_vocab_size=size or None)
            drafter = DSparkDrafter(config).to(dtype).eval().attach_target(target)
            features = drafter.gather_target_hidden(out.hidden_states, config.target_layer_ids)
            context = drafter.new_context_cache()
            drafter.extend_context(context, features[:, : anchor - 1], 0)

            def draft():
                drafter.draft(ids[:, anchor], anchor, features[:, anchor - 1 : anchor], context)
                context.crop(anchor - 1)

            results[f"draft_vocab={size or 'full'}_{head}_ms"] = median_ms(draft)
    base = results["target_1_token_ms"]
    print(json.dumps({k: round(v, 2) for k, v in results.items()}))
    print(json.dumps({k.replace("_ms", "_vs_target_1"): round(v / base, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
