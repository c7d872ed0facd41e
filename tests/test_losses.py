"""Training math: anchors, block construction and masks, losses (hand-computed cases)."""

import math

import pytest
import torch

from hf_dspark.training.losses import build_blocks, dspark_losses, position_weights, sample_anchors


def test_anchors_only_where_next_token_is_supervised():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    anchors, keep = sample_anchors(loss_mask, 10, torch.Generator().manual_seed(0))
    for row in range(2):
        chosen = anchors[row][keep[row]].tolist()
        expected = [p for p in range(1, 7) if loss_mask[row, p + 1]]
        assert sorted(chosen) == expected


def test_blocks_labels_and_mask():
    ids = torch.arange(10, 20).unsqueeze(0)  # tokens 10..19 at positions 0..9
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 4:9] = True  # position 9 unsupervised
    anchors, keep = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    blocks = build_blocks(ids, loss_mask, anchors, keep, block_size=3, mask_token_id=0)
    assert blocks.input_ids.tolist() == [[13, 0, 0, 16, 0, 0]]
    assert blocks.position_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    assert blocks.labels.tolist() == [[[14, 15, 16], [17, 18, 0]]]
    assert blocks.valid.tolist() == [[[True, True, True], [True, True, False]]]
    assert blocks.prev_ids.tolist() == [[[13, 14, 15], [16, 17, 18]]]
    assert blocks.context_lengths.tolist() == [[3, 6]]  # each block sees the context before its anchor
    mask = blocks.attention_mask[0, 0]
    # block 0 queries see context 0..2 and their own block only
    assert mask[0, :10].tolist() == [True] * 3 + [False] * 7
    assert mask[0, 10:].tolist() == [True, True, True, False, False, False]
    assert mask[4, :10].tolist() == [True] * 6 + [False] * 4
    assert mask[4, 10:].tolist() == [False, False, False, True, True, True]


def test_position_weights():
    w = position_weights(3, 4.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))


def test_losses_zero_tv_when_distributions_match():
    logits = torch.randn(1, 1, 2, 5)
    labels = logits.argmax(-1)
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    out = dspark_losses(logits, logits.clone(), labels, valid, torch.full((1, 1, 2), 20.0))
    assert out["tv"].item() < 1e-6
    # soft label 1 and confidence logit 20 -> BCE ~ 0
    assert out["confidence"].item() < 1e-6


def test_losses_hand_computed():
    # one position, V = 2: p_d = (0.5, 0.5) (zero logits), p_t = (1, 0) (huge logit gap)
    draft = torch.zeros(1, 1, 1, 2)
    target = torch.tensor([[[[50.0, 0.0]]]])
    labels = torch.tensor([[[0]]])
    valid = torch.ones(1, 1, 1, dtype=torch.bool)
    out = dspark_losses(draft, target, labels, valid, torch.zeros(1, 1, 1))
    assert abs(out["ce"].item() - math.log(2)) < 1e-6
    assert abs(out["tv"].item() - 1.0) < 1e-6  # |0.5-1| + |0.5-0|
    # soft label 1 - 0.5 * 1 = 0.5; BCE(sigmoid(0)=0.5, 0.5) = log 2
    assert abs(out["confidence"].item() - math.log(2)) < 1e-6
    assert abs(out["loss"].item() - (0.1 * math.log(2) + 0.9 * 1.0 + math.log(2))) < 1e-5


def test_draft_vocabulary_losses():
    # V = 4, draft vocabulary {0, 2}; target puts 0.5 on token 1 (outside) and 0.5 on token 0
    target = torch.log(torch.tensor([[[[0.5, 0.5, 1e-12, 1e-12]]]]))
    draft = torch.log(torch.tensor([[[[1.0, 1e-12]]]]))  # p_d = (1, 0) over {0, 2}
    labels, valid = torch.tensor([[[1]]]), torch.ones(1, 1, 1, dtype=torch.bool)
    out = dspark_losses(draft, target, labels, valid, None, draft_vocab=torch.tensor([0, 2]))
    assert abs(out["tv"].item() - 1.0) < 1e-5  # |1 - 0.5| + |0 - 0| + 0.5 outside
    assert out["ce"].item() == 0.0  # label outside the draft vocabulary: no CE


def test_greedy_confidence_target_is_the_argmax_match():
    # two positions, V = 3. Position 0: draft argmax 1, target argmax 1 (accepted by greedy verification, although
    # the distributions differ: soft label 1 - TV < 1). Position 1: draft argmax 0, target argmax 2 (rejected).
    draft = torch.tensor([[[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]]])
    target = torch.tensor([[[[0.0, 1.0, 0.5], [0.0, 0.0, 4.0]]]])
    labels = torch.tensor([[[1, 2]]])
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    z = torch.tensor([[[0.3, -0.2]]])
    out = dspark_losses(draft, target, labels, valid, z, gamma=1e9, confidence_target="greedy")
    expected = (torch.nn.functional.softplus(-z[0, 0, 0]) + torch.nn.functional.softplus(z[0, 0, 1])) / 2
    assert abs(out["confidence"].item() - expected.item()) < 1e-6
    soft = dspark_losses(draft, target, labels, valid, z, gamma=1e9)
    assert abs(soft["confidence"].item() - expected.item()) > 1e-3  # the paper's soft label differs here
    for other in ("ce", "tv", "accuracy"):
        assert torch.equal(out[other], soft[other])
    with pytest.raises(ValueError, match="confidence_target"):
        dspark_losses(draft, target, labels, valid, z, confidence_target="argmax")


@pytest.mark.parametrize("with_draft_vocab", [False, True])
@pytest.mark.parametrize("cached", [False, True])
def test_target_view_equals_the_full_softmax(with_draft_vocab, cached):
    """The target's probabilities over the output vocabulary, its outside mass and argmax, from distinct rows in
    chunks (or from a cached log-normaliser), equal the full-vocabulary softmax's."""
    from hf_dspark.training.losses import TargetView, log_normalizer_and_argmax, target_view

    torch.manual_seed(0)
    rows, weight = torch.randn(37, 8), torch.randn(50, 8) * 2
    draft_vocab = torch.tensor([0, 3, 7, 11, 20, 49]) if with_draft_vocab else None
    reference = TargetView.from_logits(rows @ weight.T, draft_vocab)
    lse = argmax = None
    if cached:
        lse, argmax = log_normalizer_and_argmax(rows, weight, chunk_rows=5)
        torch.testing.assert_close(lse, torch.logsumexp(rows @ weight.T, -1))
        assert argmax.dtype == torch.int32
    view = target_view(rows, weight, draft_vocab, lse, argmax, chunk_rows=5)
    torch.testing.assert_close(view.probs, reference.probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(view.outside, reference.outside, atol=1e-6, rtol=1e-5)
    assert torch.equal(view.argmax, reference.argmax)
    if with_draft_vocab:
        assert float(view.outside.min()) > 0  # most of the mass lies outside six of fifty tokens


def test_losses_from_a_target_view_equal_those_from_logits():
    from hf_dspark.training.losses import TargetView

    torch.manual_seed(1)
    target, draft = torch.randn(2, 3, 4, 10), torch.randn(2, 3, 4, 5, requires_grad=True)
    draft_vocab = torch.tensor([1, 2, 4, 6, 9])
    labels = torch.randint(0, 10, (2, 3, 4))
    valid = torch.rand(2, 3, 4) > 0.2
    z = torch.randn(2, 3, 4)
    a = dspark_losses(draft, target, labels, valid, z, draft_vocab=draft_vocab)
    b = dspark_losses(draft, TargetView.from_logits(target, draft_vocab), labels, valid, z, draft_vocab=draft_vocab)
    for key in ("loss", "ce", "tv", "confidence", "accuracy"):
        torch.testing.assert_close(a[key], b[key])
    assert torch.equal(a["greedy_matches"], b["greedy_matches"])
    with pytest.raises(ValueError, match="output vocabulary"):
        dspark_losses(draft, TargetView.from_logits(target), labels, valid, z, draft_vocab=draft_vocab)


def test_blockwise_attention_equals_the_dense_block_mask():
    """Attention under a BlockLayout equals SDPA under the dense mask build_blocks makes, for every kept block."""
    from hf_dspark.configuration_dspark import DSparkConfig
    from hf_dspark.modeling_dspark import BlockLayout, DSparkAttention

    torch.manual_seed(0)
    config = DSparkConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          intermediate_size=64, vocab_size=50, block_size=3, num_hidden_layers=1)
    attention = DSparkAttention(config, 0)
    b, n, g = 2, 9, 3
    loss_mask = torch.zeros(b, n, dtype=torch.bool)
    loss_mask[0, 3:] = True
    loss_mask[1, 6:] = True  # few candidates: some blocks of row 1 are dropped
    anchors, keep = sample_anchors(loss_mask, 4, torch.Generator().manual_seed(1))
    blocks = build_blocks(torch.randint(0, 50, (b, n)), loss_mask, anchors, keep, g, mask_token_id=0)
    q = blocks.input_ids.shape[1]
    block = torch.randn(b, q, 32)
    context = torch.randn(b, n, 32)
    rope = (torch.ones(b, q, 8), torch.zeros(b, q, 8))
    context_kv = attention.key_values(context, torch.ones(b, n, 8), torch.zeros(b, n, 8))
    dense = attention(block, rope, context_kv, blocks.attention_mask)
    blockwise = attention(block, rope, context_kv, BlockLayout(blocks.context_lengths, g))
    kept = keep.repeat_interleave(g, dim=1)
    assert not bool(keep.all())  # the comparison covers a batch with dropped blocks
    torch.testing.assert_close(blockwise[kept], dense[kept], atol=1e-6, rtol=1e-5)
