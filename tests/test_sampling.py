"""Sampling with DSpark must be lossless: the joint distribution of generated tokens equals plain sampling.

The target's exact distribution over (x2, x3) is enumerated (tiny vocabulary), and DSpark samples are compared with
it by a chi-square test. x1 comes from the prefill; x2 and x3 are drafted and verified (with max_new_tokens=4 the
first round verifies two drafts plus a bonus). The same test must reject a generator that reports a wrong q.
"""

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

from tests.helpers import make_target, train_drafter_on_target

VOCAB = 6
SAMPLES = 1500


@pytest.fixture(scope="module")
def setup():
    target = make_target("llama", vocab_size=VOCAB, seed=3, init=0.3)
    # Trained briefly on the target's outputs so drafts are accepted often (about one of two per call).
    drafter = train_drafter_on_target(target, steps=150, block_size=4)
    prompt = torch.tensor([[1, 2, 3, 4]])
    return target, drafter, prompt


def warpers(temperature, top_k):
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        procs.append(TopKLogitsWarper(top_k))
    return procs


@torch.no_grad()
def exact_pair_distribution(target, prompt, temperature, top_k):
    """P(x2, x3) under plain sampling, summing over x1."""
    procs = warpers(temperature, top_k)

    def next_probs(ids):
        logits = target(ids).logits[:, -1].float()
        return torch.softmax(procs(ids, logits), dim=-1)[0]

    table = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = next_probs(prompt)
    for x1 in range(VOCAB):
        if p1[x1] == 0:
            continue
        ids1 = torch.cat([prompt, torch.tensor([[x1]])], dim=1)
        p2 = next_probs(ids1)
        for x2 in range(VOCAB):
            if p2[x2] == 0:
                continue
            p3 = next_probs(torch.cat([ids1, torch.tensor([[x2]])], dim=1))
            table[x2] += p1[x1] * p2[x2] * p3.double()
    return table


def sample_pairs(target, drafter, prompt, temperature, top_k, n, seed):
    torch.manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    accepted = 0
    for _ in range(n):
        out = target.generate(prompt, do_sample=True, temperature=temperature, top_k=top_k or None, top_p=None,
                              max_new_tokens=4, assistant_model=drafter)
        x2, x3 = out[0, prompt.shape[1] + 1 : prompt.shape[1] + 3].tolist()
        counts[x2, x3] += 1
        accepted += sum(drafter.last_stats.accepted)
    return counts, accepted / n


def chi_square_pvalue(counts, expected_probs):
    expected = expected_probs.flatten() / expected_probs.sum() * counts.sum()
    observed = counts.flatten().double()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * (obs.sum() / exp.sum())  # exact totals for scipy's consistency check
    return chisquare(obs.numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 4)])
def test_sampling_matches_target_distribution(setup, temperature, top_k):
    target, drafter, prompt = setup
    exact = exact_pair_distribution(target, prompt, temperature, top_k)
    counts, accepted_per_call = sample_pairs(target, drafter, prompt, temperature, top_k, SAMPLES, seed=11)
    assert accepted_per_call > 0.5, "drafts must be accepted often for the test to exercise verification"
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"DSpark sampling deviates from the target distribution (p={pvalue:.2e})"


def test_wrong_q_is_detected(setup, monkeypatch):
    """Reporting the unprocessed backbone logits as q (no sequential head, no temperature / top-k; the bug in
    transformers' DFlash/MTP generators) must fail the same test."""
    target, drafter, prompt = setup
    original = type(drafter).sample_block

    def sample_block_with_wrong_q(self, base_logits, *args, **kwargs):
        draft = original(self, base_logits, *args, **kwargs)
        draft.draft_logits = base_logits.float()
        return draft

    monkeypatch.setattr(type(drafter), "sample_block", sample_block_with_wrong_q)
    exact = exact_pair_distribution(target, prompt, 0.7, 4)
    counts, _ = sample_pairs(target, drafter, prompt, 0.7, 4, SAMPLES, seed=11)
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue < 1e-3, f"the test has no power: a wrong q passed (p={pvalue:.2e})"


@pytest.fixture(scope="module")
def setup_draft_vocab(setup):
    """A drafter that samples in a 4-token draft vocabulary: with temperature and top-k (value-only warpers) it draws
    from those warpers over the draft vocabulary, and that distribution is the q it reports."""
    target, _, prompt = setup
    drafter = train_drafter_on_target(target, steps=150, block_size=4, draft_vocab_size=4)
    assert drafter.draft_vocab is not None and drafter.draft_vocab.numel() == 4
    return target, drafter, prompt


def test_sampling_in_the_draft_vocabulary_with_warpers(setup_draft_vocab, monkeypatch):
    target, drafter, prompt = setup_draft_vocab
    drafted_in_draft_space = []
    original = type(drafter).sample_block

    def recording(self, *args, **kwargs):
        draft = original(self, *args, **kwargs)
        drafted_in_draft_space.append(draft.to_full_vocab is not None)
        return draft

    monkeypatch.setattr(type(drafter), "sample_block", recording)
    exact = exact_pair_distribution(target, prompt, 0.7, 3)
    counts, accepted_per_call = sample_pairs(target, drafter, prompt, 0.7, 3, SAMPLES, seed=12)
    assert drafted_in_draft_space and all(drafted_in_draft_space)
    assert accepted_per_call > 0.3, "drafts must be accepted often for the test to exercise verification"
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"draft-vocabulary sampling deviates from the target distribution (p={pvalue:.2e})"


def test_static_round_sampling_matches_target_distribution(setup_draft_vocab):
    """The static round (what a CUDA graph replays: the sequential head and the warpers over the draft vocabulary,
    one multinomial per position) reports the q it sampled from, like the eager round."""
    target, drafter, prompt = setup_draft_vocab
    drafter.generation_config.draft_round = "static"
    try:
        exact = exact_pair_distribution(target, prompt, 0.7, 3)
        counts, accepted_per_call = sample_pairs(target, drafter, prompt, 0.7, 3, SAMPLES, seed=13)
    finally:
        drafter.generation_config.draft_round = "auto"
    assert accepted_per_call > 0.3, "drafts must be accepted often for the test to exercise verification"
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"static-round sampling deviates from the target distribution (p={pvalue:.2e})"


def test_draft_vocabulary_q_must_be_the_draft_space_one(setup_draft_vocab, monkeypatch):
    """Reporting q without the draft-space warpers and head (the backbone's draft-vocabulary logits) must fail the
    same test: the draft-vocabulary configuration does not weaken it."""
    target, drafter, prompt = setup_draft_vocab
    original = type(drafter).sample_block

    def sample_block_with_full_vocab_q(self, base_logits, *args, **kwargs):
        draft = original(self, base_logits, *args, **kwargs)
        draft.draft_logits = self.to_full_vocab(base_logits.float())
        return draft

    monkeypatch.setattr(type(drafter), "sample_block", sample_block_with_full_vocab_q)
    exact = exact_pair_distribution(target, prompt, 0.7, 3)
    counts, _ = sample_pairs(target, drafter, prompt, 0.7, 3, SAMPLES, seed=12)
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue < 1e-3, f"the test has no power: a wrong q passed (p={pvalue:.2e})"
