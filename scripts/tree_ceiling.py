"""How much a token tree could buy over the chain, on this machine: accepted length per tree shape and node budget,
and the tokens per second each would give at this machine's SPS curve.

    python scripts/tree_ceiling.py [--sequences 48] [--dtype float32] [--output tree.json]

Teacher-forced on held-out regenerated turns (``data/regen-smollm2-heldout``, the construction of
``scripts/acceptance_caps.py``: every block drafted from the target's features up to its anchor; the target's greedy
token at each block position given the turn's tokens before it). The drafter's parallel backbone scores every block
position once; its sequential (Markov) head then scores the children of any parent token for the price of one
embedding row and a rank-r projection, so a tree is the backbone's block with the head conditioned on each parent.

- Full trees: the top ``b_d`` children of every node at depth d (then one child per node to the block's end).
- Budgeted trees: the N nodes of highest path probability (the product of the drafter's probabilities along the
  path: a node's ancestors rank above it, so the N best nodes always form a tree).
- A block's accepted length is 1 + the depth of the deepest node on the target's greedy path (every node above it on
  that path is in the tree), the whole tree verified.
- The expected rate of a shape with n nodes is ``tau * SPS(1 + n)`` (one target forward over the anchor and the
  nodes, at this machine's profile for the target in ``--dtype``), against the best chain prefix ``max_l tau_l *
  SPS(1 + l)`` and plain decoding ``SPS(1)``. The drafter's cost is left out: it is one backbone forward for every
  shape, plus the head's rows for a tree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from acceptance_caps import HELDOUT_DATA, sample, teacher_forced_blocks  # noqa: E402

from hf_dspark.defaults import load_drafter_for  # noqa: E402
from hf_dspark.target import load_smollm2  # noqa: E402
from hf_dspark.training.trainer import collate  # noqa: E402

FULL_TREES = ((), (2,), (4,), (3, 2), (4, 2), (4, 2, 2))
BUDGETS = (8, 16, 24, 32, 48, 64)
KEEP = 64  # nodes kept per depth for the budgeted trees (at least the largest budget)
CHUNK = 64  # blocks scored together


@torch.no_grad()
def blocks_of(target, drafter, batch: dict, num_anchors: int, generator: torch.Generator) -> dict:
    """The whole blocks of one batch: the backbone's logits over the draft vocabulary [n, g, V], the anchor
    token [n], and the target's greedy token at each block position [n, g] (full vocabulary)."""
    out, _, blocks, drafted = teacher_forced_blocks(target, drafter, batch, num_anchors, generator)
    b = batch["input_ids"].shape[0]
    num, g = blocks.labels.shape[1:]
    logits = drafted.logits.view(b, num, g, -1).float()
    rows = blocks.target_positions.view(b, -1)
    greedy = out.logits.gather(1, rows.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1])).argmax(-1).view(b, num, g)
    full = blocks.valid.all(-1)
    return {"logits": logits[full], "anchor": blocks.prev_ids[..., 0][full], "greedy": greedy[full]}


class TreeScorer:
    """The drafter's Markov head over a chunk of blocks: conditional log-probabilities of every child of a parent."""

    def __init__(self, drafter):
        head = drafter.markov_head
        if head is None or getattr(head, "stateful", False) or type(head).__name__ != "DSparkMarkovHead":
            raise SystemExit("tree_ceiling.py scores trees with a first-order Markov head (sequential_head='markov')")
        self.head = head
        vocab = drafter.draft_vocab
        self.to_full = vocab if vocab is not None else None

    def children(self, logits: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """log p(child | parent) [n, P, V] at one block position: backbone ``logits`` [n, V], ``parents`` [n, P]
        (full-vocabulary ids)."""
        bias = self.head.markov_w2(self.head.markov_w1(parents))  # [n, P, V]
        return torch.log_softmax(logits[:, None, :] + bias, dim=-1)

    def full_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.to_full is None else self.to_full[draft_ids]


def grow(scorer: TreeScorer, logits: torch.Tensor, anchor: torch.Tensor, width) -> list[dict]:
    """Levels of a tree over a chunk: ``width(depth, path_logp [n, P, V]) -> (path logp, parent, draft id)`` picks
    each depth's nodes. Returns per depth ``{"logp", "parent", "token"}`` tensors of [n, P_d]."""
    levels, parents, parent_logp = [], anchor[:, None], torch.zeros(anchor.shape[0], 1)
    for depth in range(logits.shape[1]):
        path = parent_logp[:, :, None] + scorer.children(logits[:, depth], parents)  # [n, P, V]
        logp, parent, draft = width(depth, path)
        token = scorer.full_ids(draft)
        levels.append({"logp": logp, "parent": parent, "token": token})
        parents, parent_logp = token, logp
    return levels


def full_tree(branching: tuple[int, ...]):
    """``width`` of a full tree: the top ``branching[d]`` children of each node (1 past the spec)."""

    def width(depth, path):
        k = branching[depth] if depth < len(branching) else 1
        logp, draft = path.topk(k, dim=-1)  # [n, P, k]
        n, p = path.shape[:2]
        parent = torch.arange(p).view(1, p, 1).expand(n, p, k)
        return logp.reshape(n, -1), parent.reshape(n, -1), draft.reshape(n, -1)

    return width


def best_nodes(depth, path):
    """``width`` of the budgeted trees: the ``KEEP`` best nodes of the depth by path probability."""
    n, p, v = path.shape
    logp, flat = path.reshape(n, -1).topk(min(KEEP, p * v), dim=-1)
    return logp, flat // v, flat % v


def on_path(levels: list[dict], greedy: torch.Tensor) -> list[torch.Tensor]:
    """Per depth [n, P_d]: the node is the target's greedy token there and its parent is on the path too."""
    marks, previous = [], None
    for depth, level in enumerate(levels):
        hit = level["token"] == greedy[:, depth : depth + 1]
        if previous is not None:
            hit &= previous.gather(1, level["parent"])
        marks.append(hit)
        previous = hit
    return marks


def accepted(marks: list[torch.Tensor], selected: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Accepted drafts per block [n]: the depths with a (selected) node on the target's path."""
    return sum((m if selected is None else m & s).any(-1).long() for m, s in zip(marks, selected or marks))


def budget_selection(levels: list[dict], budget: int) -> list[torch.Tensor]:
    """Per depth: whether the node is among the ``budget`` of highest path probability (ties: the shallower)."""
    logp = torch.cat([level["logp"] for level in levels], dim=1)
    depth = torch.cat([torch.full_like(level["logp"], d) for d, level in enumerate(levels)], dim=1)
    by_depth = torch.argsort(depth, dim=1, stable=True)
    ranked = by_depth.gather(1, torch.argsort(-logp.gather(1, by_depth), dim=1, stable=True))  # node at each rank
    chosen, start = torch.argsort(ranked, dim=1) < budget, 0
    out = []
    for level in levels:
        out.append(chosen[:, start : start + level["logp"].shape[1]])
        start += level["logp"].shape[1]
    return out


def sps_curve(target, max_tokens: int):
    from hf_dspark.profiling import load_or_profile

    return load_or_profile(target, max_tokens)


def heldout_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every held-out tree script takes (drafter, turns, blocks per turn, batching, seed, threads,
    JSON output); a script adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the embedded DSpark drafter)")
    parser.add_argument("--sequences", type=int, default=48, help="held-out regenerated turns")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--num-anchors", type=int, default=64, help="blocks per turn")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--output", default=None, help="also write the numbers as JSON here")
    return parser


def heldout_setup(parser: argparse.ArgumentParser, positive: tuple[str, ...] = ()):
    """Parse and check the arguments (``positive``: a script's own flags that must be >= 1 too), then load the
    float32 target and drafter and sample the held-out turns: ``(args, target, tokenizer, drafter, origin,
    sequences)``."""
    args = parser.parse_args()
    for flag in ("sequences", "max_length", "num_anchors", "batch_size", *positive):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load_smollm2(torch.float32)
    drafter, origin = load_drafter_for(target, args.drafter, dtype=torch.float32)
    drafter.eval()
    sequences = sample(HELDOUT_DATA, args.sequences, args.max_length, args.seed)
    return args, target, tokenizer, drafter, origin, sequences


def heldout_batches(args, tokenizer, sequences: list[dict]):
    """The held-out turns in collated batches of ``args.batch_size``, each with its seeded anchor generator; the
    progress is logged to stderr after each batch."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    generator = torch.Generator()
    for start in range(0, len(sequences), args.batch_size):
        generator.manual_seed(args.seed * 7919 + 104_729 + start)
        yield collate(sequences[start : start + args.batch_size], pad), generator
        print(f"  {min(start + args.batch_size, len(sequences))}/{len(sequences)} turns", file=sys.stderr)


def main() -> None:
    parser = heldout_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the target's dtype for the SPS curve (accepted lengths are scored in float32)")
    args, target, tokenizer, drafter, origin, sequences = heldout_setup(parser)
    scorer = TreeScorer(drafter)
    shapes = {"chain" if not spec else ", ".join(map(str, spec)): spec for spec in FULL_TREES}
    totals = {name: [] for name in shapes} | {f"budget {n}": [] for n in BUDGETS}
    chain_depths, nodes = [], {}
    for chunk, generator in heldout_batches(args, tokenizer, sequences):
        blocks = blocks_of(target, drafter, chunk, args.num_anchors, generator)
        for first in range(0, blocks["anchor"].shape[0], CHUNK):
            part = {key: value[first : first + CHUNK] for key, value in blocks.items()}
            with torch.no_grad():
                for name, spec in shapes.items():
                    levels = grow(scorer, part["logits"], part["anchor"], full_tree(spec))
                    nodes[name] = sum(level["token"].shape[1] for level in levels)
                    marks = on_path(levels, part["greedy"])
                    totals[name].append(accepted(marks))
                    if not spec:  # the chain's accepted drafts, for its prefixes
                        chain_depths.append(accepted(marks))
                levels = grow(scorer, part["logits"], part["anchor"], best_nodes)
                marks = on_path(levels, part["greedy"])
                for budget in BUDGETS:
                    totals[f"budget {budget}"].append(accepted(marks, budget_selection(levels, budget)))
                    nodes[f"budget {budget}"] = budget
    target = target.to(getattr(torch, args.dtype))
    from hf_dspark.optimization import optimize_target

    optimize_target(target, "auto")
    sps = sps_curve(target, max(nodes.values()) + 1)
    chain = torch.cat(chain_depths)
    g = drafter.config.block_size
    chain_rates = {l: (1 + chain.clamp(max=l).float().mean().item()) * sps(1 + l) for l in range(1, g + 1)}
    best_l = max(chain_rates, key=chain_rates.get)
    rows = []
    for name, parts in totals.items():
        depth = torch.cat(parts).float()
        tau = 1 + depth.mean().item()
        rate = tau * sps(1 + nodes[name])
        rows.append({"tree": name, "nodes": nodes[name], "tau": tau, "sps": sps(1 + nodes[name]), "rate": rate})
    chain_tau = rows[0]["tau"]
    print(f"Drafter: {origin}; {len(sequences)} held-out turns, {chain.shape[0]} whole blocks; target SPS curve in "
          f"{args.dtype} ({torch.get_num_threads()} threads): SPS(1) {sps(1):.1f}/s. Plain: {sps(1):.1f} tok/s; "
          f"best chain prefix l={best_l}: {chain_rates[best_l]:.1f} tok/s.\n")
    print("| tree | nodes | tau | vs the chain | SPS(1 + nodes) | expected tok/s | vs the best chain prefix |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tree']} | {row['nodes']} | {row['tau']:.2f} | {row['tau'] / chain_tau:.2f} | {row['sps']:.1f} "
              f"| {row['rate']:.1f} | {row['rate'] / chain_rates[best_l]:.2f} |")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "drafter": origin, "turns": len(sequences), "blocks": int(chain.shape[0]), "dtype": args.dtype,
            "sps": {str(b): sps(b) for b in range(1, max(nodes.values()) + 2)}, "chain_rates": chain_rates,
            "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
