"""How well a token tree's predicted survival matches where the target's path runs, by kind of node and depth.

    python scripts/tree_calibration.py [--sequences 48] [--nodes 32] [--output calibration.json]

Teacher-forced on held-out regenerated turns (``data/regen-smollm2-heldout``, the blocks of
``scripts/acceptance_caps.py``). Every whole block is grown into the tree a round would verify
(``token_tree.grow_tree`` with ``--nodes`` nodes, no survival correction), and each node is marked on the target's
path where its parent is and its token is the target's greedy token there. A node's conditional survival is its
predicted survival over its parent's; where the parent lies on the path, that is a prediction of a yes/no outcome,
and the table compares the two by kind of node:

- ``chain``: the block's first choice below a chain node (what the chain itself would verify);
- ``first``: the first choice below a node off the chain;
- ``alternative``: any other child (a parent's second, third... choice), which shares ``1 - c`` of its parent.

Columns: nodes with the parent on the path, their mean predicted conditional, the observed rate, and the ratio
(above 1: the tree is overconfident about that kind of node). The last lines give the accepted drafts per block the
tree predicts (the sum of its nodes' survival) against the observed ones, for the chain's nodes and for the whole
tree.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from acceptance_caps import teacher_forced_blocks  # noqa: E402
from tree_ceiling import heldout_batches, heldout_parser, heldout_setup  # noqa: E402

from hf_dspark.token_tree import TokenTree, grow_tree, tree_obstacle  # noqa: E402

KINDS = ("chain", "first", "alternative")


@torch.no_grad()
def blocks_of(target, drafter, batch: dict, num_anchors: int, generator: torch.Generator) -> list[dict]:
    """Whole blocks of one batch: the backbone's logits [g, V_draft] and hidden states [g, d], the anchor token and
    the target's greedy token at every block position [g]."""
    out, _, blocks, drafted = teacher_forced_blocks(target, drafter, batch, num_anchors, generator)
    b = batch["input_ids"].shape[0]
    num, g = blocks.labels.shape[1:]
    logits = drafted.logits.view(b, num, g, -1)
    hidden = drafted.hidden_states.view(b, num, g, -1)
    rows = blocks.target_positions.view(b, -1)
    greedy = out.logits.gather(1, rows.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1])).argmax(-1).view(b, num, g)
    full = blocks.valid.all(-1)
    anchors = blocks.prev_ids[..., 0]
    return [{"logits": logits[i, j], "hidden": hidden[i, j], "anchor": int(anchors[i, j]), "greedy": greedy[i, j]}
            for i, j in full.nonzero().tolist()]


def node_kinds(tree: TokenTree) -> list[str]:
    """Each node's kind: ``chain``, ``first`` (the highest-survival child of an off-chain parent) or
    ``alternative``."""
    best: dict[int, int] = {}
    for i, parent in enumerate(tree.parents.tolist()):
        if parent not in best or tree.survival[i] > tree.survival[best[parent]]:
            best[parent] = i
    firsts = set(best.values())
    chain = tree.chain.tolist()
    return ["chain" if chain[i] else "first" if i in firsts else "alternative" for i in range(tree.size)]


def score(tree: TokenTree, greedy: list[int], record: dict) -> None:
    """Add one tree's nodes to ``record``: per (kind, depth) the predicted conditionals and the outcomes of the nodes
    whose parent lies on the target's path, and the predicted and observed accepted drafts."""
    parents, tokens, depths = tree.parents.tolist(), tree.tokens.tolist(), tree.depths.tolist()
    survival = tree.survival.tolist()
    kinds = node_kinds(tree)
    on_path = [False] * tree.size
    for i in range(tree.size):  # parents come first
        parent_on = parents[i] < 0 or on_path[parents[i]]
        if not parent_on:
            continue
        on_path[i] = tokens[i] == greedy[depths[i] - 1]
        parent_survival = 1.0 if parents[i] < 0 else survival[parents[i]]
        key = (kinds[i], depths[i])
        record["predicted"][key] += survival[i] / max(parent_survival, 1e-12)
        record["observed"][key] += float(on_path[i])
        record["count"][key] += 1
    chain = tree.chain.tolist()
    record["chain_predicted"] += sum(s for s, c in zip(survival, chain) if c)
    record["chain_observed"] += sum(1 for p, c in zip(on_path, chain) if p and c)
    record["tree_predicted"] += sum(survival)
    record["tree_observed"] += sum(on_path)
    record["blocks"] += 1


def table(record: dict) -> list[dict]:
    rows = []
    for kind in KINDS:
        keys = sorted(key for key in record["count"] if key[0] == kind)
        for scope, chosen in [("all", keys)] + [(str(key[1]), [key]) for key in keys]:
            count = sum(record["count"][key] for key in chosen)
            if not count:
                continue
            predicted = sum(record["predicted"][key] for key in chosen) / count
            observed = sum(record["observed"][key] for key in chosen) / count
            rows.append({"kind": kind, "depth": scope, "nodes": count, "predicted": predicted, "observed": observed,
                         "ratio": predicted / observed if observed else float("inf")})
    return rows


def main() -> None:
    parser = heldout_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32, help="nodes per tree")
    args, target, tokenizer, drafter, origin, sequences = heldout_setup(parser, positive=("nodes",))
    obstacle = tree_obstacle(drafter)
    if obstacle is not None:
        raise SystemExit(f"tree_calibration.py: {obstacle}")
    record = {"predicted": defaultdict(float), "observed": defaultdict(float), "count": defaultdict(int),
              "chain_predicted": 0.0, "chain_observed": 0, "tree_predicted": 0.0, "tree_observed": 0, "blocks": 0}
    for chunk, generator in heldout_batches(args, tokenizer, sequences):
        with torch.no_grad():
            for block in blocks_of(target, drafter, chunk, args.num_anchors, generator):
                tree = grow_tree(drafter, block["logits"], block["hidden"], block["anchor"], args.nodes)
                score(tree, block["greedy"].tolist(), record)
    rows = table(record)
    blocks = record["blocks"]
    print(f"Drafter: {origin}; {len(sequences)} held-out turns, {blocks} whole blocks, trees of {args.nodes} nodes.\n")
    print("| kind | depth | nodes (parent on path) | predicted | observed | predicted / observed |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['kind']} | {row['depth']} | {row['nodes']} | {row['predicted']:.3f} | {row['observed']:.3f} "
              f"| {row['ratio']:.2f} |")
    print(f"\nAccepted drafts per block, predicted / observed: chain nodes {record['chain_predicted'] / blocks:.3f} / "
          f"{record['chain_observed'] / blocks:.3f}; whole tree {record['tree_predicted'] / blocks:.3f} / "
          f"{record['tree_observed'] / blocks:.3f}")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "drafter": origin, "turns": len(sequences), "blocks": blocks, "nodes": args.nodes, "rows": rows,
            "per_block": {name: record[name] / blocks for name in
                          ("chain_predicted", "chain_observed", "tree_predicted", "tree_observed")}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
