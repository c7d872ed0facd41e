"""scripts/tree_calibration.py: a tree's predicted survival scored against where the target's path runs."""

from collections import defaultdict

import pytest
import torch

from hf_dspark.token_tree import TokenTree, grow_tree
from tests.helpers import load_script, make_drafter, make_target


@pytest.fixture(scope="module")
def calibration():
    return load_script("tree_calibration")


def empty_record() -> dict:
    return {"predicted": defaultdict(float), "observed": defaultdict(float), "count": defaultdict(int),
            "chain_predicted": 0.0, "chain_observed": 0, "tree_predicted": 0.0, "tree_observed": 0, "blocks": 0}


def hand_tree() -> TokenTree:
    """anchor -> 5 (chain, 0.6; -> 7 chain 0.3, -> 8 0.2), anchor -> 6 (0.3; -> 9 0.15)."""
    return TokenTree(tokens=torch.tensor([5, 6, 7, 8, 9]), parents=torch.tensor([-1, -1, 0, 0, 1]),
                     depths=torch.tensor([1, 1, 2, 2, 2]), survival=torch.tensor([0.6, 0.3, 0.3, 0.2, 0.15]),
                     chain=torch.tensor([True, False, True, False, False]))


def test_nodes_are_scored_where_their_parent_lies_on_the_path(calibration):
    tree = hand_tree()
    assert calibration.node_kinds(tree) == ["chain", "alternative", "chain", "alternative", "first"]
    record = empty_record()
    calibration.score(tree, [5, 8], record)  # the target's path: 5, then 8 (the chain's alternative)
    # both children of the anchor, and the two children of 5; node 9's parent (6) is off the path
    assert dict(record["count"]) == {("chain", 1): 1, ("alternative", 1): 1, ("chain", 2): 1, ("alternative", 2): 1}
    assert record["observed"][("chain", 1)] == 1 and record["observed"][("alternative", 1)] == 0
    assert record["observed"][("chain", 2)] == 0 and record["observed"][("alternative", 2)] == 1
    assert record["predicted"][("alternative", 2)] == pytest.approx(0.2 / 0.6)
    assert (record["chain_observed"], record["tree_observed"]) == (1, 2)
    assert record["tree_predicted"] == pytest.approx(1.55)
    rows = {(row["kind"], row["depth"]): row for row in calibration.table(record)}
    assert rows[("alternative", "all")]["nodes"] == 2
    assert rows[("alternative", "2")]["ratio"] == pytest.approx((0.2 / 0.6) / 1.0)


def test_no_alternative_is_predicted_above_the_drafters_own_probability():
    """A parent's other children share 1 - c of it, never more than the drafter gives each of them."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    torch.manual_seed(0)
    base = torch.randn(4, drafter.config.vocab_size) * 3
    hidden = torch.randn(4, drafter.config.hidden_size)
    with torch.no_grad():
        tree = grow_tree(drafter, base, hidden, anchor=3, max_nodes=12)
        bias, _ = drafter.markov_head.step(torch.tensor([3]), hidden[:1], None)
        probs = torch.softmax(base[0].float() + bias[0].float(), dim=-1)
    for i in range(tree.size):
        if tree.depths[i] == 1 and not tree.chain[i]:
            token = int(tree.tokens[i])
            index = token if drafter.draft_vocab is None else int((drafter.draft_vocab == token).nonzero())
            assert float(tree.survival[i]) <= float(probs[index]) + 1e-6
