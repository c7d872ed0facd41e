"""CandidateWarpers: temperature then top-k / top-p / min-p on the top candidates give transformers' warpers' own
distribution whenever the kept tokens lie within the candidates, stop at the candidates otherwise, and are used only
for the warper lists they reproduce."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from hf_dspark.draft_sampling import DRAFT_CANDIDATES, CandidateWarpers

LISTS = {
    "top_p": [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)],
    "top_k,top_p": [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.95)],
    "min_p": [TemperatureLogitsWarper(1.3), MinPLogitsWarper(0.05)],
    "top_p,min_keep": [TopPLogitsWarper(0.3, min_tokens_to_keep=5)],
    "top_k": [TopKLogitsWarper(7)],
    "two temperatures,top_p,min_p": [TemperatureLogitsWarper(0.8), TemperatureLogitsWarper(0.9),
                                     TopPLogitsWarper(0.8), MinPLogitsWarper(0.1)],
}


@pytest.mark.parametrize("name", sorted(LISTS))
def test_candidates_reproduce_the_warpers_when_the_kept_set_fits(name):
    processors = LogitsProcessorList(LISTS[name])
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 8192, generator=g) * 4  # peaked enough that every kept set fits in the candidates
    candidate = CandidateWarpers.build(processors, 8192)
    assert candidate is not None
    values, indices = candidate(scores)
    ours = candidate.full(values, indices, 8192)
    theirs = processors(torch.zeros(64, 1, dtype=torch.long), scores.clone())
    kept_theirs, kept_ours = torch.isfinite(theirs), torch.isfinite(ours)
    assert (kept_theirs.sum(-1) <= candidate.candidates).all()  # the case this test is about
    assert torch.equal(kept_ours, kept_theirs)
    torch.testing.assert_close(torch.softmax(ours, -1), torch.softmax(theirs, -1), atol=1e-6, rtol=1e-5)


def test_a_nucleus_wider_than_the_candidates_stops_at_them():
    processors = LogitsProcessorList([TopPLogitsWarper(0.99)])
    scores = torch.randn(4, 8192, generator=torch.Generator().manual_seed(1)) * 0.1  # nearly flat
    candidate = CandidateWarpers.build(processors, 8192)
    values, indices = candidate(scores)
    assert candidate.candidates == DRAFT_CANDIDATES and torch.isfinite(values).all()
    assert torch.equal(indices, scores.topk(DRAFT_CANDIDATES).indices)
    full = candidate.full(values, indices, 8192)
    assert (torch.isfinite(full).sum(-1) == DRAFT_CANDIDATES).all()  # q is what the draft is drawn from
    assert torch.equal(full.gather(-1, indices), values)


def test_top_k_sets_the_candidate_count_and_small_vocabularies_cap_it():
    assert CandidateWarpers.build([TopKLogitsWarper(20), TopPLogitsWarper(0.9)], 8192).candidates == 20
    assert CandidateWarpers.build([TopPLogitsWarper(0.9)], 40).candidates == 40
    assert CandidateWarpers.build([TopKLogitsWarper(5000)], 8192).candidates == DRAFT_CANDIDATES


@pytest.mark.parametrize("processors", [
    [],  # nothing truncates: candidates would cut the distribution short
    [TemperatureLogitsWarper(0.7)],
    [TopPLogitsWarper(0.9), TemperatureLogitsWarper(0.7)],  # a temperature after a truncation
    [TemperatureLogitsWarper(0.7), TypicalLogitsWarper(0.9)],  # not one it reproduces
    [TopPLogitsWarper(0.9, filter_value=-1e4)],  # removed tokens keep some probability
    [RepetitionPenaltyLogitsProcessor(1.2), TopPLogitsWarper(0.9)],  # reads token ids
    [type("MyTopP", (TopPLogitsWarper,), {})(0.9)],  # a subclass may do anything
])
def test_other_lists_keep_the_processors_as_they_are(processors):
    assert CandidateWarpers.build(LogitsProcessorList(processors), 8192) is None
