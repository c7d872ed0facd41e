"""Batched engine in bfloat16: how many greedy outputs stay equal to the plain engine's at concurrency 1?

In bfloat16 a forward rounds differently with the batch shape (rows, padded width), so near-ties in the target's
argmax flip. The plain engine at other concurrencies is the control: if it differs from plain at concurrency 1 as
often as fixed-length DSpark does, the differences come from the arithmetic and not from speculative decoding (which
the float32 tests and runs show to be exact).

    python scripts/bf16_engine_divergence.py --num-prompts 24 --max-new-tokens 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import hf_dspark
from hf_dspark.engine.batching import DSparkEngine, SamplingParams
from hf_dspark.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="../shared/data/eval")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, drafter = hf_dspark.load_default(dtype=getattr(torch, args.dtype))
    records = load_prompts([args.prompts])
    random.Random(0).shuffle(records)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True)
               for r in records[: args.num_prompts]]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)

    def run(method: str, concurrency: int) -> list[list[int]]:
        engine = DSparkEngine(target, drafter if method != "plain" else None, method=method,
                              max_concurrency=concurrency)
        ids = [engine.add_request(p, params) for p in prompts]
        engine.run()
        return [engine.outputs[i].token_ids for i in ids]

    reference = run("plain", 1)
    result = {"dtype": args.dtype, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "equal_to_plain_c1": {}}
    for method, concurrency in (("plain", 4), ("plain", 16), ("fixed", 1), ("fixed", 4), ("scheduled", 1)):
        outputs = run(method, concurrency)
        result["equal_to_plain_c1"][f"{method} c={concurrency}"] = sum(a == b for a, b in zip(outputs, reference))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
