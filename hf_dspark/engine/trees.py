"""Token-tree rounds in the batched engine: a greedy request's block grown into a tree (``token_tree.grow_tree``),
priced by the planner within the step's batch, verified in the step's one padded forward.

A tree row's block columns hold ``[anchor, nodes...]`` at positions by depth, and its part of the 4D attention mask
lets each node see the row's valid cache columns, the anchor, its ancestors and itself (``TokenTree.visibility``);
chain rows keep their causal block. The target's greedy choice at each node (the argmax, as ``greedy_verify`` takes
it) walks the tree (``TokenTree.accepted_path``). The accepted path's columns are kept in the cache and the rest
become holes: a path's nodes come in depth order among the block's columns (parents before children), so the kept
columns still hold the row's positions in order (``RaggedBatchCache``'s invariant). The drafter's deferred features
are taken along the same path.

Where a row's tree is priced (``Planner.tree_round``) the rest of the batch is held as it stands (``BatchShare``:
the other rows' expected tokens and verification width, the trees already chosen this step included), so a tree
that would widen every row's padded forward pays for all of them. Sampling requests verify their chain (see
``token_tree.DRAFT_TREES``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..budget import BatchShare, chain_expected
from ..draft_sources import Draft
from ..token_tree import TREE_NODES, TokenTree, grow_tree, tree_obstacle
from ..tree_round import additive_mask


def engine_tree_obstacle(drafter, mode: str, scheduled: bool, windowed: bool) -> str | None:
    """Why this engine's steps cannot verify trees (None: they can): ``mode``, its ``draft_tree`` setting;
    ``scheduled``, whether its policy is priced by an SPS profile; ``windowed``, whether the target has
    sliding-window layers."""
    if drafter is None:
        return "the engine has no drafter"
    if mode == "chain":
        return "draft_tree='chain'"
    if not scheduled:
        return "the policy is not priced by an SPS profile"
    if windowed:
        return "the target has sliding-window layers (its masks are built from positions by the engine)"
    return tree_obstacle(drafter)


def path_columns(path: list[int]) -> list[int]:
    """A tree row's block columns along its accepted ``path``: the anchor's, then each node's (node i is column
    1 + i)."""
    return [0] + [1 + node for node in path]


def tree_tokens_per_request(block_size: int, trees: bool) -> int:
    """The widest block a row verifies, anchor included (an SPS profile's widths per request): the block, or where
    rows may verify token trees, the largest tree."""
    return max(block_size, TREE_NODES if trees else 0) + 1


class EngineTrees:
    """The engine's token-tree rounds: which rows of a step verify a tree, and that step's tree-shaped inputs,
    acceptance and kept columns."""

    def __init__(self, drafter, mode: str, scheduled: bool, windowed: bool, eager: bool):
        self.drafter, self.eager, self.mode = drafter, eager, mode
        self.off = engine_tree_obstacle(drafter, mode, scheduled, windowed)
        if self.off is not None and self.mode == "always":
            raise ValueError(f"draft_tree='always' cannot grow token trees in this engine: {self.off}")

    def tokens_per_request(self, block_size: int) -> int:
        """The widest block a row verifies (anchor included): the SPS profile's widths per request."""
        return tree_tokens_per_request(block_size, self.off is None)

    def choose(self, planner, rows: Sequence, plan, block: Draft | None, lengths: list[int],
               table: torch.Tensor | None) -> dict[int, TokenTree]:
        """Row index -> the tree it verifies this step instead of its chain of ``lengths[i]`` drafts: the drafting
        greedy rows whose tree (with the row's free-source offer, such as the prompt lookup's copy, grafted on as
        one more branch) the ``planner`` prices above the chain, each within the rest of the batch as chosen so
        far."""
        if self.off is not None or block is None or block.base_logits is None or table is None:
            return {}
        expected = [self._expected(planner, i, plan, block, lengths) for i in range(len(rows))]
        widths = [1 + n for n in lengths]
        trees = {}
        for k, i in enumerate(plan.drafting):
            if rows[i].params.do_sample or plan.caps[i] < 1:
                continue
            share = self._share(planner, expected, widths, i)
            nodes = self._room(share, table)
            if nodes < 1:
                continue
            tree = grow_tree(self.drafter, block.base_logits[k], block.hidden[k], int(rows[i].anchor), nodes,
                             max_depth=plan.caps[i])
            confidences = None if block.confidences is None else block.confidences[k]
            branch = planner.best_offer(rows[i].token_ids(), plan.caps[i], table) if planner.sources else None
            tree = planner.tree_round(tree, confidences, lengths[i], table, always=self.mode == "always",
                                      branch=branch, share=share)
            if tree is not None:
                trees[i] = tree
                expected[i] = 1.0 + float(tree.survival.sum())
                widths[i] = 1 + tree.size
        return trees

    @staticmethod
    def _expected(planner, i: int, plan, block: Draft, lengths: list[int]) -> float:
        """Row ``i``'s expected tokens from its chain round (1 plus the survival of its verified drafts)."""
        if not lengths[i]:
            return 1.0
        offer = plan.offers.get(i)
        if offer is not None:
            confidences = offer.confidences[0] if offer.confidences is not None else None
        else:
            k = plan.drafting.index(i)
            confidences = None if block.confidences is None else planner.corrected(block.confidences[k])
        return 1.0 if confidences is None else float(chain_expected(confidences, lengths[i]))

    @staticmethod
    def _share(planner, expected: list[float], widths: list[int], i: int) -> BatchShare:
        others = [j for j in range(len(widths)) if j != i]
        return BatchShare(sum(expected[j] for j in others), sum(widths[j] for j in others),
                          max((widths[j] for j in others), default=0), len(widths),
                          planner.schedule == "padded")

    @staticmethod
    def _room(share: BatchShare, table: torch.Tensor) -> int:
        """The most nodes a row's tree may hold: ``TREE_NODES``, within what the table prices for the batch."""
        fits = share.batch_tokens(torch.arange(2, TREE_NODES + 2)) <= table.shape[0] - 1
        return int(fits.sum())

    @staticmethod
    def verified(lengths: list[int], trees: dict[int, TokenTree]) -> list[int]:
        """What each row verified this step: its chain's drafts, or its tree's nodes."""
        return [trees[i].size if i in trees else n for i, n in enumerate(lengths)]

    @staticmethod
    def chain_view(lengths: list[int], accepted: list[int], trees: dict[int, TokenTree],
                   paths: dict[int, list[int]]) -> tuple[list[int], list[int]]:
        """The step as the block's chain saw it, for the confidences' memory and the survival correction: a tree
        row verified the chain nodes its tree held and accepted its path's leading chain nodes."""
        lengths, accepted = list(lengths), list(accepted)
        for i, tree in trees.items():
            lengths[i], accepted[i] = tree.chain_length(), tree.leading_chain(paths[i])
        return lengths, accepted

    # ----------------------------------------------------------------------------------------------------------
    # The step's forward, acceptance and kept columns with trees in it
    # ----------------------------------------------------------------------------------------------------------
    @staticmethod
    def width(lengths: list[int], trees: dict[int, TokenTree]) -> int:
        """The step's block width: its widest chain or tree, anchor included."""
        return max([1 + n for n in lengths] + [1 + tree.size for tree in trees.values()])

    @staticmethod
    def place(tokens: torch.Tensor, offsets: torch.Tensor, block_valid: torch.Tensor,
              trees: dict[int, TokenTree]) -> None:
        """Write each tree row's nodes into ``tokens`` [R, Q], its depths into the position ``offsets`` [R, Q] and
        its node columns into ``block_valid`` [R, Q] (in place)."""
        for i, tree in trees.items():
            n = tree.size
            tokens[i, 1 : 1 + n] = tree.tokens.to(tokens.device)
            offsets[i, 1 : 1 + n] = tree.depths.to(offsets.device)
            offsets[i, 1 + n :] = 0
            block_valid[i] = torch.arange(block_valid.shape[1], device=block_valid.device) <= n

    def mask(self, cache_valid: torch.Tensor, block_valid: torch.Tensor, trees: dict[int, TokenTree],
             dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, Q, W + Q] mask of a step with trees: each row's valid cache columns, then its block causal over
        its valid columns (a chain) or the tree's visibility; padding queries see their anchor and themselves.
        Boolean, or additive floats of ``dtype`` for eager attention."""
        rows, width = block_valid.shape
        device = block_valid.device
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        block = causal[None] & block_valid[:, None, :]
        for i, tree in trees.items():
            n = tree.size
            block[i, : n + 1, : n + 1] = tree.visibility().to(device)
            block[i, n + 1 :] = False
        block |= torch.eye(width, dtype=torch.bool, device=device)[None]
        block[:, :, 0] = True
        past = cache_valid[:, None, :].expand(rows, width, cache_valid.shape[1])
        seen = torch.cat([past, block], dim=2)[:, None]
        return additive_mask(seen, dtype) if self.eager else seen

    @staticmethod
    def accept(logits: torch.Tensor, trees: dict[int, TokenTree], accepted: torch.Tensor,
               next_tokens: torch.Tensor) -> dict[int, list[int]]:
        """Each tree row's greedy walk over ``logits`` [R, Q, V]: its accepted path (node indices, returned) and
        next token, written into ``accepted`` and ``next_tokens`` [R]."""
        paths = {}
        for i, tree in trees.items():
            choices = logits[i, : 1 + tree.size].argmax(dim=-1).tolist()
            path, token = tree.accepted_path(lambda row, _path: choices[row])
            paths[i] = path
            accepted[i], next_tokens[i] = len(path), token
        return paths

    @staticmethod
    def kept(width: int, accepted: torch.Tensor, paths: dict[int, list[int]]) -> torch.Tensor:
        """[R, width]: the block columns each row keeps (anchor and accepted drafts; a tree row's along its
        path)."""
        kept = torch.arange(width, device=accepted.device) <= accepted[:, None]
        for i, path in paths.items():
            kept[i] = False
            kept[i, path_columns(path)] = True
        return kept

    @staticmethod
    def path_first(paths: dict[int, list[int]], rows: int, width: int, device) -> torch.Tensor | None:
        """[R, width] column order that puts each tree row's anchor and path first (identity elsewhere), for the
        deferred drafter features; None when no row verified a tree."""
        if not paths:
            return None
        order = torch.arange(width, device=device).repeat(rows, 1)
        for i, path in paths.items():
            first = path_columns(path)
            taken = set(first)
            rest = [c for c in range(width) if c not in taken]
            order[i] = torch.tensor(first + rest, device=device)
        return order


__all__ = ["EngineTrees", "engine_tree_obstacle", "path_columns", "tree_tokens_per_request"]
