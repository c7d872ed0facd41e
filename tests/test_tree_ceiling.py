"""scripts/tree_ceiling.py: trees from the drafter's block, scored against the target's greedy path."""

import pytest
import torch

from tests.helpers import load_script, make_drafter, make_target


@pytest.fixture(scope="module")
def tree():
    return load_script("tree_ceiling")


@pytest.fixture(scope="module")
def scorer_and_block(tree):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    torch.manual_seed(0)
    logits = torch.randn(6, 4, drafter.config.vocab_size)
    anchor = torch.randint(2, drafter.config.vocab_size, (6,))
    return tree.TreeScorer(drafter), logits, anchor


def test_the_chain_follows_the_heads_greedy_path(tree, scorer_and_block):
    scorer, logits, anchor = scorer_and_block
    levels = tree.grow(scorer, logits, anchor, tree.full_tree(()))
    tokens, previous = [], anchor
    for depth in range(logits.shape[1]):  # the sequential head's greedy draft, step by step
        previous = scorer.children(logits[:, depth], previous[:, None])[:, 0].argmax(-1)
        tokens.append(previous)
    chain = torch.stack(tokens, dim=1)
    assert torch.equal(torch.cat([level["token"] for level in levels], dim=1), chain)
    greedy = chain.clone()
    greedy[:3, 2] = -1  # three blocks where the target disagrees at the third draft
    assert tree.accepted(tree.on_path(levels, greedy)).tolist() == [2, 2, 2, 4, 4, 4]


def test_full_trees_hold_the_chain_and_more(tree, scorer_and_block):
    scorer, logits, anchor = scorer_and_block
    chain = tree.grow(scorer, logits, anchor, tree.full_tree(()))
    wide = tree.grow(scorer, logits, anchor, tree.full_tree((3, 2)))
    assert [level["token"].shape[1] for level in wide] == [3, 6, 6, 6]
    # a target path through the second choice at depth 1, then the head's greedy children: only the tree holds it
    second = wide[0]["token"][:, 1]
    child = wide[1]["token"][:, 2]  # the first child of node 1 (children are grouped by parent)
    greedy = torch.stack([second, child, torch.full_like(second, -1), torch.full_like(second, -1)], dim=1)
    assert tree.accepted(tree.on_path(chain, greedy)).tolist() == [0] * 6
    assert tree.accepted(tree.on_path(wide, greedy)).tolist() == [2] * 6


def test_budgeted_trees_are_trees_and_grow_with_the_budget(tree, scorer_and_block):
    scorer, logits, anchor = scorer_and_block
    levels = tree.grow(scorer, logits, anchor, tree.best_nodes)
    chain = torch.cat([level["token"] for level in tree.grow(scorer, logits, anchor, tree.full_tree(()))], dim=1)
    marks = tree.on_path(levels, chain)
    previous = None
    for budget in (1, 4, 8, 16):
        chosen = tree.budget_selection(levels, budget)
        assert torch.cat(chosen, dim=1).sum(dim=1).tolist() == [budget] * 6
        assert bool(chosen[0].any(dim=1).all())  # the best node is a child of the anchor
        for depth in range(1, len(levels)):  # every chosen node's parent is chosen
            parents = chosen[depth - 1].gather(1, levels[depth]["parent"])
            assert bool((parents | ~chosen[depth]).all())
        held = tree.accepted(marks, chosen)
        assert previous is None or bool((held >= previous).all())
        previous = held
