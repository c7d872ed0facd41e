"""What a draft vocabulary of K tokens covers and costs, for SmolLM2-135M-Instruct's regenerated responses.

A drafter with a draft vocabulary predicts only its K most frequent response tokens (``set_draft_vocab``): a target
token outside them can never be drafted, so the share of response tokens the K cover bounds every position's
acceptance. In exchange the drafter's output layer (and the Markov head's rank-r map onto the vocabulary) shrinks from
the target's 49,152 rows to K. For each K this measures:

- coverage: the share of response tokens in the vocabulary the trainer would choose from the training responses
  (``--draft-vocab-size K``: the target's special tokens, then the K most frequent response tokens of the training
  sequences as it loads them), on those responses and on held-out responses of the same recipe that the drafter never
  trained on;
- cost: the wall time of the drafter's output projection (hidden -> K logits) and of the Markov head's
  rank-r -> K projection for one block of g positions, at 1 and at 16 drafting requests, in the drafter's dtype;
- size: the parameters those two K-wide maps would hold (the output rows are the target's LM head, shared, not
  stored in the drafter folder; the Markov map is).

The shipped drafter's own vocabulary (its ``draft_vocab`` buffer) is measured alongside. Run on a quiet machine:

    python scripts/draft_vocab_coverage.py --output reports/draft-vocab-coverage.json
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

DEFAULT_TRAIN = ["data/regen-smollm2", "data/regen-smollm2-b"]
DEFAULT_HELDOUT = ["data/regen-smollm2-heldout", "data/regen-smollm2-c"]
SIZES = [1024, 2048, 4096, 8192, 16384, 32768]


def seconds_per_call(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", nargs="+", default=DEFAULT_TRAIN, help="folders the vocabulary is counted on")
    parser.add_argument("--heldout", nargs="+", default=DEFAULT_HELDOUT, help="folders it is checked on")
    parser.add_argument("--drafter", default="hf_dspark/drafters/smollm2-135m-instruct-dspark")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", default=None, help="write the measurements as JSON here")
    args = parser.parse_args()
    if any(k < 1 for k in args.sizes):
        raise ValueError(f"--sizes must be positive, got {args.sizes}")
    torch.set_num_threads(args.threads)

    from transformers import GenerationConfig

    from hf_dspark import DSparkDrafter
    from hf_dspark.target import smollm2_folder
    from hf_dspark.training.trainer import (TrainingArguments, list_shards, load_sequences, response_token_counts,
                                            special_token_ids, token_coverage, top_tokens)

    drafter = DSparkDrafter.from_pretrained(args.drafter)
    config = drafter.config
    vocab_size, hidden, block = config.vocab_size, config.hidden_size, config.block_size
    rank = getattr(config, "markov_rank", None) or 128
    dtype = getattr(torch, args.dtype)
    shipped = None if drafter.draft_vocab is None else set(drafter.draft_vocab.tolist())

    max_length = TrainingArguments.__dataclass_fields__["max_length"].default  # the trainer's truncation
    train_sequences = load_sequences(list_shards(args.train), max_length)
    heldout_sequences = load_sequences(list_shards(args.heldout), max_length)
    train, heldout = response_token_counts(train_sequences), response_token_counts(heldout_sequences)
    always = special_token_ids(GenerationConfig.from_pretrained(smollm2_folder()))
    print(f"training responses: {len(train_sequences)} turns, {sum(train.values())} tokens, {len(train)} distinct "
          f"(the vocabulary past those is filled in id order); "
          f"held-out: {len(heldout_sequences)} turns, {sum(heldout.values())} tokens")

    rows = []
    generator = torch.Generator().manual_seed(0)
    for k in sorted(set(args.sizes) | {vocab_size}):
        k = min(k, vocab_size)
        vocab = top_tokens(train, k, always)
        weight = torch.randn(k, hidden, generator=generator).to(dtype)
        markov = torch.randn(k, rank, generator=generator).to(dtype)
        timing = {}
        for requests in (1, 16):
            x = torch.randn(requests * block, hidden, generator=generator).to(dtype)
            z = torch.randn(requests * block, rank, generator=generator).to(dtype)
            with torch.no_grad():
                timing[requests] = {
                    "output_ms": 1000 * seconds_per_call(lambda: x @ weight.T, args.repeats),
                    "markov_ms": 1000 * seconds_per_call(lambda: z @ markov.T, args.repeats),
                }
        row = {"size": k, "train_coverage": token_coverage(vocab, train),
               "heldout_coverage": token_coverage(vocab, heldout),
               "output_params": k * hidden, "markov_params": k * rank, "timing": timing}
        rows.append(row)
        print(f"K={k:6d}  coverage train {100 * row['train_coverage']:6.2f}%  held-out "
              f"{100 * row['heldout_coverage']:6.2f}%  output+markov per block: "
              f"{timing[1]['output_ms'] + timing[1]['markov_ms']:6.2f} ms (1 request), "
              f"{timing[16]['output_ms'] + timing[16]['markov_ms']:6.2f} ms (16)  markov params {k * rank:,}")
    report = {"train": args.train, "heldout": args.heldout, "train_turns": len(train_sequences),
              "train_distinct": len(train), "heldout_turns": len(heldout_sequences), "max_length": max_length, "dtype": args.dtype, "threads": args.threads, "block_size": block,
              "markov_rank": rank, "sizes": rows}
    if shipped is not None:
        report["shipped"] = {"size": len(shipped), "train_coverage": token_coverage(shipped, train),
                             "heldout_coverage": token_coverage(shipped, heldout)}
        print(f"shipped draft vocabulary ({len(shipped)} tokens): coverage train "
              f"{100 * report['shipped']['train_coverage']:.2f}%, held-out "
              f"{100 * report['shipped']['heldout_coverage']:.2f}%")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
