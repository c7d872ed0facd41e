"""What caps the drafter's accepted length: the draft vocabulary, the data, or the drafter's capacity.

    python scripts/acceptance_caps.py [--drafter FOLDER] [--sequences 64] [--output caps.json]

Teacher-forced, on fixed anchors (the trainer's held-out proxy construction: every block drafted from the target's
hidden states up to its anchor, previous tokens taken from the regenerated turn), for two samples of regenerated
turns: the drafter's training turns (data/regen-smollm2, -b, -c) and the held-out ones (data/regen-smollm2-heldout).
A block position "matches" where the drafter's greedy token is the target's own greedy token there. It prints:

- the share of the target's greedy tokens outside the draft vocabulary, and the ceiling that puts on every block
  position (the fraction of blocks whose target tokens 1..k all lie inside the vocabulary) and on tau;
- match rate per block position (unconditional) and conditional on the earlier positions matching, and the
  whole-block greedy tau those give, for training and held-out turns (a gap between them says data-bound, no gap
  with a low rate says capacity-bound);
- tau by where the block starts in the response and by domain;
- at position 1, the share of misses where the drafter picked the target's second-ranked token (a near-tie the
  drafter cannot be blamed much for), or a token outside the target's top 2, or the target's token lies outside the
  draft vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hf_dspark.defaults import load_drafter_for  # noqa: E402
from hf_dspark.modeling_dspark import BlockLayout  # noqa: E402
from hf_dspark.target import load_smollm2  # noqa: E402
from hf_dspark.training.data import list_shards, load_sequences  # noqa: E402
from hf_dspark.training.losses import build_blocks, sample_anchors  # noqa: E402
from hf_dspark.training.trainer import collate  # noqa: E402

TRAIN_DATA = ["data/regen-smollm2", "data/regen-smollm2-b", "data/regen-smollm2-c"]
HELDOUT_DATA = ["data/regen-smollm2-heldout"]
# Where a block starts in the response (tokens after the prompt): the opening, the body, the long tail.
OFFSET_BUCKETS = ((0, 16), (16, 64), (64, 160), (160, 10**9))


def sample(data_dirs: list[str], count: int, max_length: int, seed: int) -> list[dict]:
    sequences = load_sequences(list_shards([str(REPO / d) for d in data_dirs]), max_length)
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    return [sequences[i] for i in sorted(order[:count])]


@torch.no_grad()
def teacher_forced_blocks(target, drafter, batch: dict, num_anchors: int, generator: torch.Generator):
    """One batch's target forward, its anchors and blocks (the trainer's construction), and the drafter's forward
    over every block from the target's features up to its anchor: ``(target output, anchors, blocks, drafter
    output)``."""
    config = drafter.config
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    out = target(input_ids=ids, attention_mask=batch["attention_mask"], output_hidden_states=True)
    features = drafter.gather_target_hidden(out.hidden_states, config.target_layer_ids).float()
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator)
    blocks = build_blocks(ids, loss_mask, anchors, keep, config.block_size, config.mask_token_id)
    b, n = ids.shape
    drafted = drafter(input_ids=blocks.input_ids, position_ids=blocks.position_ids, target_hidden=features,
                      context_position_ids=torch.arange(n).unsqueeze(0).expand(b, -1),
                      attention_mask=BlockLayout(blocks.context_lengths, config.block_size))
    return out, anchors, blocks, drafted


@torch.no_grad()
def block_records(target, drafter, batch: dict, num_anchors: int, generator: torch.Generator) -> dict:
    """Per block of one batch: target top-2 and the drafter's greedy token at every position, validity, offsets."""
    loss_mask = batch["loss_mask"]
    out, anchors, blocks, drafted = teacher_forced_blocks(target, drafter, batch, num_anchors, generator)
    b = loss_mask.shape[0]
    num, g = blocks.labels.shape[1:]
    hidden = drafted.hidden_states.view(b, num, g, -1)
    logits = drafted.logits.view(b, num, g, -1)
    bias = drafter.sequential_bias(hidden, blocks.prev_ids)
    if bias is not None:
        logits = logits + bias
    greedy = logits.argmax(-1)
    if drafter.draft_vocab is not None:
        greedy = drafter.draft_vocab[greedy]
    rows = blocks.target_positions.view(b, -1)  # [b, A * g] positions whose target logits predict each label
    target_logits = out.logits.gather(1, rows.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1]))
    top2 = target_logits.topk(2, dim=-1).indices.view(b, num, g, 2)
    response_start = loss_mask.long().argmax(dim=1)  # first supervised token
    offsets = anchors + 1 - response_start.unsqueeze(1)  # [b, A] the block's first label, in response tokens
    return {"greedy": greedy, "top2": top2, "valid": blocks.valid, "offsets": offsets}


def in_vocab_mask(drafter, tokens: torch.Tensor) -> torch.Tensor:
    if drafter.draft_vocab is None:
        return torch.ones_like(tokens, dtype=torch.bool)
    member = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    member[drafter.draft_vocab] = True
    return member[tokens]


def collect(target, drafter, sequences: list[dict], args) -> dict:
    """Whole-block records over the sample: [blocks, g] tensors plus each block's domain and response offset."""
    parts = defaultdict(list)
    generator = torch.Generator()
    for start in range(0, len(sequences), args.batch_size):
        chunk = sequences[start : start + args.batch_size]
        generator.manual_seed(args.seed * 7919 + 104_729 + start)  # the trainer's fixed evaluation anchors
        rec = block_records(target, drafter, collate(chunk, args.pad_id), args.num_anchors, generator)
        full = rec["valid"].all(-1)  # blocks with all g positions inside the response
        parts["greedy"].append(rec["greedy"][full])
        parts["top2"].append(rec["top2"][full])
        parts["offsets"].append(rec["offsets"][full])
        domains = [[seq["domain"]] * rec["valid"].shape[1] for seq in chunk]
        flat = [d for row, keep in zip(domains, full.tolist()) for d, k in zip(row, keep) if k]
        parts["domain"].extend(flat)
        print(f"  {min(start + args.batch_size, len(sequences))}/{len(sequences)} sequences", file=sys.stderr)
    return {k: v if k == "domain" else torch.cat(v) for k, v in parts.items()}


def tau(matches: torch.Tensor) -> float:
    """Whole-block greedy accepted length: one plus the mean number of leading matches."""
    if matches.numel() == 0:
        return float("nan")
    return 1.0 + float(matches.long().cumprod(-1).sum(-1).float().mean())


def summarise(drafter, records: dict) -> dict:
    target_top1 = records["top2"][..., 0]
    matches = records["greedy"] == target_top1  # [blocks, g]
    inside = in_vocab_mask(drafter, target_top1)
    leading = matches.long().cumprod(-1)
    conditional = [float(matches[:, 0].float().mean())]
    for k in range(1, matches.shape[1]):
        reached = leading[:, k - 1].bool()
        conditional.append(float(matches[reached, k].float().mean()) if reached.any() else float("nan"))
    first_miss = ~matches[:, 0]
    second = records["greedy"][:, 0] == records["top2"][:, 0, 1]
    misses = max(int(first_miss.sum()), 1)
    by_offset = {}
    for lo, hi in OFFSET_BUCKETS:
        chosen = (records["offsets"] >= lo) & (records["offsets"] < hi)
        by_offset[f"{lo}-{hi if hi < 10**9 else 'end'}"] = {"blocks": int(chosen.sum()), "tau": tau(matches[chosen])}
    by_domain = {}
    for domain in sorted(set(records["domain"])):
        chosen = torch.tensor([d == domain for d in records["domain"]])
        by_domain[domain] = {"blocks": int(chosen.sum()), "tau": tau(matches[chosen])}
    return {
        "blocks": int(matches.shape[0]),
        "outside_vocab_share": float((~inside).float().mean()),
        "vocab_ceiling_per_position": inside.long().cumprod(-1).float().mean(0).tolist(),
        "vocab_ceiling_tau": tau(inside),
        "match_per_position": matches.float().mean(0).tolist(),
        "conditional_acceptance": conditional,
        "tau": tau(matches),
        "position1_miss_share": float(first_miss.float().mean()),
        "position1_miss_is_target_second": float((first_miss & second).sum()) / misses,
        "position1_miss_outside_vocab": float((first_miss & ~inside[:, 0]).sum()) / misses,
        "tau_by_response_offset": by_offset,
        "tau_by_domain": by_domain,
    }


def render(results: dict) -> str:
    names = list(results)
    width = max(len(results[n]["match_per_position"]) for n in names)
    lines = [f"| | {' | '.join(names)} |", "|---|" + "---|" * len(names)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("blocks (all positions in the response)", [str(results[n]["blocks"]) for n in names])
    row("tau (whole-block greedy, teacher-forced)", [f"{results[n]['tau']:.3f}" for n in names])
    row("target tokens outside the draft vocabulary", [f"{100 * results[n]['outside_vocab_share']:.1f}%" for n in names])
    row("tau ceiling from the vocabulary alone", [f"{results[n]['vocab_ceiling_tau']:.2f}" for n in names])
    for k in range(width):
        row(f"position {k + 1}: match / conditional / vocab ceiling",
            [f"{results[n]['match_per_position'][k]:.3f} / {results[n]['conditional_acceptance'][k]:.3f} / "
             f"{results[n]['vocab_ceiling_per_position'][k]:.3f}" for n in names])
    row("position-1 misses", [f"{100 * results[n]['position1_miss_share']:.1f}%" for n in names])
    row("... of which the target's 2nd token", [f"{100 * results[n]['position1_miss_is_target_second']:.1f}%"
                                                for n in names])
    row("... of which outside the draft vocabulary", [f"{100 * results[n]['position1_miss_outside_vocab']:.1f}%"
                                                      for n in names])
    for bucket in results[names[0]]["tau_by_response_offset"]:
        row(f"tau, block starting at response token {bucket}",
            [f"{results[n]['tau_by_response_offset'][bucket]['tau']:.3f} "
             f"({results[n]['tau_by_response_offset'][bucket]['blocks']})" for n in names])
    domains = sorted({d for n in names for d in results[n]["tau_by_domain"]})
    for domain in domains:
        row(f"tau, {domain}", [f"{results[n]['tau_by_domain'].get(domain, {}).get('tau', float('nan')):.3f} "
                               f"({results[n]['tau_by_domain'].get(domain, {}).get('blocks', 0)})" for n in names])
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the embedded DSpark drafter)")
    parser.add_argument("--sequences", type=int, default=64, help="regenerated turns per sample")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per turn, prompt included")
    parser.add_argument("--num-anchors", type=int, default=64, help="blocks per turn")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", default=None, help="also write the numbers as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2(torch.float32)
    drafter, origin = load_drafter_for(target, args.drafter, dtype=torch.float32)
    drafter.eval()
    args.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    results = {}
    for name, dirs in (("training turns", TRAIN_DATA), ("held-out turns", HELDOUT_DATA)):
        print(f"{name}: {', '.join(dirs)}", file=sys.stderr)
        results[name] = summarise(drafter, collect(target, drafter, sample(dirs, args.sequences, args.max_length,
                                                                            args.seed), args))
    print(f"Drafter: {origin}; {args.sequences} turns per sample, {args.num_anchors} anchors per turn, "
          f"block size {drafter.config.block_size}\n")
    print(render(results))
    if args.output:
        Path(args.output).write_text(json.dumps({"drafter": origin, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
