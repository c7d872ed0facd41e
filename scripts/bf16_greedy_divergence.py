"""How often does DSpark-assisted greedy decoding diverge from plain greedy decoding in bfloat16?

In bf16 a forward over several tokens rounds differently from one-token forwards, so near-ties in the target's
argmax can flip depending on how many tokens each verification forward carries. This is not a DSpark bug (n-gram
prompt-lookup decoding shows it too); the script measures it for both, next to float32 as the control.

    python scripts/bf16_greedy_divergence.py --prompts ../shared/data/eval --num-prompts 20 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import random

import torch

import hf_dspark  # noqa: F401
from hf_dspark.defaults import load_drafter_for
from hf_dspark.prompts import load_prompts
from hf_dspark.target import load_smollm2


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", nargs="+", default=["../shared/data/eval"])
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    records = load_prompts(args.prompts)
    random.Random(args.seed).shuffle(records)
    records = records[: args.num_prompts]
    report = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target, tokenizer = load_smollm2(dtype=dtype)
        drafter, origin = load_drafter_for(target, args.drafter, dtype=dtype)
        rows = {"dspark": [], "prompt_lookup": []}
        for record in records:
            messages = [{"role": "user", "content": record["turns"][0]}]
            inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                   return_dict=True)
            n = inputs["input_ids"].shape[1]
            kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
            plain = target.generate(**inputs, **kwargs)[0, n:].tolist()
            dspark = target.generate(**inputs, **kwargs, assistant_model=drafter)[0, n:].tolist()
            lookup = target.generate(**inputs, **kwargs, prompt_lookup_num_tokens=7)[0, n:].tolist()
            rows["dspark"].append(first_divergence(plain, dspark))
            rows["prompt_lookup"].append(first_divergence(plain, lookup))
        report[dtype_name] = {
            method: {
                "prompts": len(values),
                "diverged": sum(v is not None for v in values),
                "diverged_fraction": sum(v is not None for v in values) / len(values),
                "first_divergence_positions": [v for v in values if v is not None],
            }
            for method, values in rows.items()
        }
        report[dtype_name]["drafter"] = origin
        print(dtype_name, json.dumps(report[dtype_name]), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
