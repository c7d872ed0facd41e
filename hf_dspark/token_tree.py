"""Token trees: the drafter's block grown into a tree of continuations, all verified in one target forward.

The parallel backbone scores every block position once (``base_logits`` [g, V_draft], hidden states [g, d]). A
stateless sequential head (the Markov head, or the gated head: the bias at position k depends on the previous token
and position k's hidden state only) then scores the children of any parent token at position k for the price of
one embedding row and a rank-r projection, and the confidence head scores any parent for the price of one dot
product. So a round's block can propose several continuations at each depth, not only the chain of first choices.

Each node carries its predicted survival: the probability that the target's own path runs through it. A parent's
first-choice child survives with the parent's confidence ``c`` (the confidence head conditioned on that parent: the
probability that its first choice is accepted); the other children share the rest, ``1 - c``, in proportion to the
drafter's probabilities, each never above the drafter's own probability (without a confidence head, the drafter's
probability itself). The cap matters where the confidence head doubts a first choice the backbone is sure of: the
share of the rest would then hand a second choice most of ``1 - c``, where held-out data finds it right about as
often as the drafter's own probability says (``scripts/tree_calibration.py``). Survival multiplies along a
path, so a node never survives more than its parent: the n nodes of highest survival always form a tree, and a tree
is stored in that order (parents before children, every prefix a tree). The planner prices a prefix of it the way
it prices a chain (``budget.tree_schedule``).

Verification (greedy): one target forward over ``[anchor, nodes...]`` with positions by depth and an attention mask
that lets each node see the context, the anchor, its ancestors and itself (``TokenTree.visibility``). Walking from
the anchor, the target's choice at a node is accepted where one of the node's children carries it
(``TokenTree.accepted_path``); the output is the target's greedy sequence, whatever the tree held.

This file is self-contained (torch + its sibling ``setting_choices``), so exported drafter folders can carry it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .setting_choices import checked_choice
except ImportError:  # pragma: no cover - loaded as a top-level module
    from setting_choices import checked_choice  # type: ignore[no-redef]

# ``drafter.generation_config.draft_tree``:
#   "chain"   (default) never a tree: on the CPUs measured so far a priced tree reads the chain's speed within
#             noise, in float32 and bfloat16 (BENCHMARKS.md, "Token trees"), so trees are opt-in
#   "auto"    each greedy block round verifies the tree the planner prices above the chain, or the chain where the
#             tree would not pay more
#   "always"  every greedy block round verifies a tree (sized by the planner, never smaller than the chain it would
#             verify); for tests and measurements
# Sampling rounds verify the chain: multi-draft speculative sampling (several candidate children per node, each
# accepted against the residual of the target's distribution) is not implemented, so a tree could not keep the
# target's sampling distribution exact.
DRAFT_TREES = ("chain", "auto", "always")
# The most nodes a tree holds (besides the anchor): the widest forward a round prices (SPS profiles of calls that may
# verify trees cover it).
TREE_NODES = 32
# The most parents a depth expands: its nodes of highest survival. Scoring a parent's children costs a rank-r
# projection over the draft vocabulary; the nodes of a budgeted tree hang off a few parents per depth.
TREE_PARENTS = 8


def draft_tree_mode(drafter) -> str:
    """``drafter.generation_config.draft_tree`` (default ``"chain"``), checked."""
    return checked_choice(drafter, "draft_tree", DRAFT_TREES, "chain")


def tree_obstacle(drafter) -> str | None:
    """Why ``drafter`` cannot grow trees (None: it can): the children of a parent need a stateless sequential head."""
    head = getattr(drafter, "markov_head", None)
    if head is None:
        return "the drafter has no sequential head to score a parent's children"
    if getattr(head, "stateful", True):
        return "the drafter's sequential head carries a state along the block (RNN): a child depends on the whole path"
    return None


@dataclass
class TokenTree:
    """A tree of ``n`` draft nodes below an anchor, in decreasing predicted survival (parents before children).

    ``tokens`` [n] full-vocabulary ids; ``parents`` [n] each node's parent (-1: the anchor); ``depths`` [n] (1 for the
    anchor's children); ``survival`` [n] float, the predicted probability that the target's path runs through the
    node; ``chain`` [n] bool, whether the node is on the block's chain of first choices.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    survival: torch.Tensor
    chain: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    def prefix(self, n: int) -> "TokenTree":
        """The first ``n`` nodes (a tree: every node's parent comes before it)."""
        return TokenTree(*(t[:n] for t in (self.tokens, self.parents, self.depths, self.survival, self.chain)))

    def ranked(self, survival: torch.Tensor) -> "TokenTree":
        """The same nodes with ``survival`` [n] (never above a parent's), reordered by it (ties: the shallower
        first), so that every prefix is again a tree."""
        by_depth = torch.argsort(self.depths, stable=True)
        order = by_depth[torch.argsort(-survival[by_depth], stable=True)]
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        parents = self.parents[order]
        parents = torch.where(parents >= 0, rank[parents.clamp(min=0)], parents)
        return TokenTree(self.tokens[order], parents, self.depths[order], survival[order].float(), self.chain[order])

    def graft(self, tokens: torch.Tensor, conditionals: torch.Tensor) -> "TokenTree":
        """This tree with the branch ``tokens`` [k] below the anchor (a draft of another source, such as the prompt
        lookup's copy) merged in: where the tree already holds a prefix of it, the branch continues from there, and a
        node it shares keeps the higher survival. ``conditionals`` [k]: the source's conditional acceptance per
        position; the branch's survival is their running product. Returned reranked (every prefix a tree)."""
        children: dict[tuple[int, int], int] = {}
        for i, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            children.setdefault((parent, token), i)
        node_tokens, parents = self.tokens.tolist(), self.parents.tolist()
        depths, survival, chain = self.depths.tolist(), self.survival.tolist(), self.chain.tolist()
        node, alive = -1, 1.0
        for depth, (token, conditional) in enumerate(zip(tokens.tolist(), conditionals.tolist()), start=1):
            alive *= max(0.0, min(1.0, float(conditional)))
            child = children.get((node, token))
            if child is None:
                child = len(node_tokens)
                node_tokens.append(token), parents.append(node), depths.append(depth)
                survival.append(alive), chain.append(False)
                children[(node, token)] = child
            else:
                survival[child] = max(survival[child], alive)
            node = child
        for i in reversed(range(len(parents))):  # a raised node raises its ancestors (parents come first)
            if parents[i] >= 0 and survival[i] > survival[parents[i]]:
                survival[parents[i]] = survival[i]
        grown = TokenTree(torch.tensor(node_tokens), torch.tensor(parents), torch.tensor(depths),
                          torch.tensor(survival), torch.tensor(chain, dtype=torch.bool))
        return grown.ranked(grown.survival)

    def leading_chain(self, path: list[int]) -> int:
        """How many of ``path``'s first nodes (an accepted path, ``accepted_path``) lie on the chain: what the
        block's chain delivered in a tree round."""
        on_chain = self.chain.tolist()
        return next((k for k, node in enumerate(path) if not on_chain[node]), len(path))

    def chain_length(self) -> int:
        """How many of the block's chain nodes the tree holds (a prefix of the chain)."""
        return int(self.chain.sum())

    def is_chain(self) -> bool:
        """Whether every node is on the chain (the tree is a chain prefix)."""
        return bool(self.chain.all())

    def visibility(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: row i (0 the anchor, i the node i - 1) sees column j when j is i or an ancestor."""
        n = self.size
        seen = torch.eye(n + 1, dtype=torch.bool)
        seen[:, 0] = True
        parents = self.parents.tolist()
        for i, parent in enumerate(parents, start=1):
            if parent >= 0:
                seen[i] |= seen[parent + 1]
        return seen

    def accepted_path(self, choose: Callable[[int, list[int]], int]) -> tuple[list[int], int]:
        """The nodes the target accepts and its next token: from the anchor, ``choose(row, path)`` is the target's
        token at ``row`` (0 the anchor, i the node i - 1) after the accepted ``path`` (node indices); the walk goes
        to the child carrying it, and stops where no child does."""
        children: dict[int, dict[int, int]] = {}
        for i, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist())):
            children.setdefault(parent, {}).setdefault(token, i)
        path: list[int] = []
        node = -1
        while True:
            token = choose(node + 1, path)
            child = children.get(node, {}).get(token)
            if child is None:
                return path, token
            path.append(child)
            node = child


def grow_tree(drafter, base_logits: torch.Tensor, hidden: torch.Tensor, anchor: int, max_nodes: int,
              max_depth: int | None = None) -> TokenTree:
    """The ``max_nodes`` nodes of highest predicted survival below ``anchor``, from one block's backbone outputs
    (``base_logits`` [g, V_draft], ``hidden`` [g, d]) and the drafter's sequential and confidence heads, at most
    ``max_depth`` deep (default: the block)."""
    obstacle = tree_obstacle(drafter)
    if obstacle is not None:
        raise ValueError(f"cannot grow a token tree: {obstacle}")
    if max_nodes < 1:
        raise ValueError(f"a token tree needs max_nodes >= 1, got {max_nodes}")
    depth_limit = base_logits.shape[0] if max_depth is None else min(max_depth, base_logits.shape[0])
    device = base_logits.device
    to_full = drafter.draft_vocab.to(device) if drafter.draft_vocab is not None else None
    temperatures = _confidence_temperatures(drafter, base_logits.shape[0], hidden)
    levels = []
    parents_tokens = torch.tensor([anchor], device=device)
    parents_survival = torch.ones(1, device=device)
    parents_chain = torch.ones(1, dtype=torch.bool, device=device)
    parent_nodes = torch.zeros(1, dtype=torch.long, device=device)  # each parent's index among its depth's nodes
    floor = 0.0  # the survival a node needs to be among the max_nodes best found so far
    for depth in range(depth_limit):
        survival, first = _children(drafter, base_logits[depth], hidden[depth], parents_tokens, parents_survival,
                                    None if temperatures is None else temperatures[depth])
        values, flat = survival.flatten().topk(min(max_nodes, survival.numel()))
        keep = values > floor
        if not bool(keep.any()):
            break
        values, flat = values[keep], flat[keep]
        parent, index = flat // survival.shape[1], flat % survival.shape[1]
        tokens = index if to_full is None else to_full[index]
        on_chain = parents_chain[parent] & (index == first[parent])
        levels.append((values, parent_nodes[parent], tokens, on_chain))
        floor = max(floor, float(torch.cat([level[0] for level in levels]).topk(
            min(max_nodes, sum(level[0].numel() for level in levels))).values[-1]))
        # the next depth's parents: this depth's best (values are sorted), the chain's node always among them
        parent_nodes = torch.arange(min(TREE_PARENTS, values.numel()), device=device)
        if not bool(on_chain[parent_nodes].any()) and bool(on_chain.any()):
            parent_nodes[-1] = int(on_chain.nonzero()[0])
        parents_tokens, parents_survival, parents_chain = (t[parent_nodes] for t in (tokens, values, on_chain))
    return _best_nodes(levels, max_nodes)


def _confidence_temperatures(drafter, block_size: int, hidden: torch.Tensor) -> torch.Tensor | None:
    if getattr(drafter, "confidence_head", None) is None:
        return None
    temperatures = drafter.confidence_temperature_tensor(block_size, hidden.dtype, hidden.device)
    return torch.ones(block_size, dtype=hidden.dtype, device=hidden.device) if temperatures is None else temperatures


def _children(drafter, base: torch.Tensor, hidden: torch.Tensor, parents: torch.Tensor, survival: torch.Tensor,
              temperature: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Survival of every child of every parent at one depth [P, V_draft], and each parent's first choice [P]."""
    rows = hidden.expand(parents.shape[0], -1)
    bias, _ = drafter.markov_head.step(parents, rows, None)
    probs = torch.softmax(base.float() + bias.float(), dim=-1)
    top, first = probs.max(dim=-1)
    if temperature is None:
        conditional = probs
    else:
        confidence = torch.sigmoid(drafter.confidence_logits(rows, parents).float() / temperature.float())
        rest = (1.0 - confidence) / (1.0 - top).clamp(min=1e-12)
        conditional = torch.minimum(probs * rest[:, None], probs)
        conditional.scatter_(1, first[:, None], confidence[:, None])
    return survival[:, None] * conditional, first


def _best_nodes(levels: list, max_nodes: int) -> TokenTree:
    """The ``max_nodes`` nodes of highest survival across depths (ties: the shallower), parents before children."""
    if not levels:
        empty = torch.empty(0, dtype=torch.long)
        return TokenTree(empty, empty, empty, torch.empty(0), torch.empty(0, dtype=torch.bool))
    survival = torch.cat([level[0] for level in levels])
    depth = torch.cat([torch.full_like(level[1], d + 1) for d, level in enumerate(levels)])
    starts = [0]
    for level in levels:
        starts.append(starts[-1] + level[0].numel())
    # global index of each node's parent (-1: the anchor)
    parent = torch.cat([level[1] + starts[d - 1] if d else torch.full_like(level[1], -1)
                        for d, level in enumerate(levels)])
    by_depth = torch.argsort(depth, stable=True)
    order = by_depth[torch.argsort(-survival[by_depth], stable=True)][:max_nodes]
    rank = torch.full((survival.numel(),), -1, dtype=torch.long, device=survival.device)
    rank[order] = torch.arange(order.numel(), device=survival.device)
    chosen_parent = parent[order]
    new_parent = torch.where(chosen_parent >= 0, rank[chosen_parent.clamp(min=0)], chosen_parent)
    tokens = torch.cat([level[2] for level in levels])[order]
    chain = torch.cat([level[3] for level in levels])[order]
    return TokenTree(tokens.cpu(), new_parent.cpu(), depth[order].cpu(), survival[order].float().cpu(), chain.cpu())


__all__ = ["DRAFT_TREES", "TREE_NODES", "TREE_PARENTS", "TokenTree", "draft_tree_mode", "grow_tree", "tree_obstacle"]
