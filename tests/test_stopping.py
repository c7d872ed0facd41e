"""Generation stops exactly where plain generate() stops, for every stopping criterion, even when the criterion fires
on a draft the target accepted in the middle of a round."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer

from hf_dspark.generation import first_stop, in_round_stopping_criteria
from tests.helpers import random_prompts


class StopAfterSequence(StoppingCriteria):
    """Fires when the sequence ends with ``tokens`` (what a stop string does, in token space)."""

    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        n = self.tokens.shape[0]
        if input_ids.shape[1] < n:
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)
        return (input_ids[:, -n:] == self.tokens).all(dim=-1)


class StopAtLength(StoppingCriteria):
    """Fires once the sequence holds ``length`` tokens (a custom criterion the assisted loop knows nothing of)."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self):
        pass


def _greedy(target, prompt, criteria, **kwargs):
    kwargs.setdefault("max_new_tokens", 40)
    return target.generate(prompt, do_sample=False, stopping_criteria=StoppingCriteriaList(criteria), **kwargs)


def test_first_stop_finds_the_first_firing_prefix():
    candidates = torch.tensor([[5, 6, 7, 8, 9, 7, 8]])
    criteria = StoppingCriteriaList([StopAfterSequence([7, 8])])
    assert first_stop(criteria, candidates, 2) == 2  # 7, 8 complete at the second draft
    assert first_stop(criteria, candidates, 4) == 3  # from length 4 on, the next 7, 8 completes at draft 3
    assert first_stop(criteria, candidates[:, :6], 4) is None
    assert first_stop(None, candidates, 2) is None
    assert first_stop(criteria, candidates, 7) is None  # no drafts


def test_only_criteria_the_loop_does_not_crop_at_are_checked_inside_a_round():
    custom = StopAtLength(3)
    kept = in_round_stopping_criteria([MaxLengthCriteria(10), EosTokenCriteria(torch.tensor([1])), custom])
    assert list(kept) == [custom]
    assert in_round_stopping_criteria([MaxLengthCriteria(10)]) is None
    assert in_round_stopping_criteria(None) is None


def test_custom_length_criterion_at_every_position(tiny_targets, trained_drafters, family):
    """A stop at each of the first 30 positions: inside rounds (accepted drafts), at round ends, in later rounds."""
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[3]
    inside = 0
    for new in range(1, 31):
        criteria = [StopAtLength(prompt.shape[1] + new)]
        ref = _greedy(target, prompt, criteria)
        streamed = Collect()
        out = _greedy(target, prompt, criteria, assistant_model=drafter, streamer=streamed)
        assert torch.equal(ref, out), f"stop after {new}: plain {ref.shape[1]}, dspark {out.shape[1]}"
        assert out.shape[1] == prompt.shape[1] + new
        assert streamed.tokens == out[0].tolist()  # the streamer saw nothing past the stop (prompt, then tokens)
        stats = drafter.last_stats
        assert 1 + sum(stats.accepted) + stats.rounds == new  # committed tokens only: the prefill's, then the rounds'
        inside += stats.rounds > 0 and stats.accepted[-1] > 0  # the stop came after accepted drafts of a round
    assert inside > 0


def test_token_sequence_criterion_inside_and_across_rounds(tiny_targets, trained_drafters, family):
    """A two-token stop sequence taken from the plain continuation at each position: it completes on an accepted
    draft in mid-round, on the target's own token, and straddling two rounds."""
    target, drafter = tiny_targets[family], trained_drafters[family]
    checked = mid_round = 0
    for prompt in random_prompts(48, 8, target.config.vocab_size, seed=1)[:3]:
        free = target.generate(prompt, do_sample=False, max_new_tokens=40)[0, prompt.shape[1]:].tolist()
        for end in range(1, 25):
            pair = free[end - 1:end + 1]
            if any(free[i:i + 2] == pair for i in range(end - 1)):
                continue  # the pair completes earlier: covered by that earlier position
            criteria = [StopAfterSequence(pair)]
            ref = _greedy(target, prompt, criteria, return_dict_in_generate=True, output_scores=True)
            out = _greedy(target, prompt, criteria, return_dict_in_generate=True, output_scores=True,
                          assistant_model=drafter)
            assert torch.equal(ref.sequences, out.sequences), f"pair ending at {end + 1}"
            assert out.sequences.shape[1] == prompt.shape[1] + end + 1
            assert len(out.scores) == end + 1
            stats = drafter.last_stats
            mid_round += stats.accepted[-1] > 0  # the stop landed after accepted drafts of the last round
            checked += 1
    assert checked >= 20 and mid_round > 0


def test_eos_list_and_custom_criterion_together(tiny_targets, trained_drafters, family):
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[0]
    free = target.generate(prompt, do_sample=False, max_new_tokens=40)[0, prompt.shape[1]:].tolist()
    eos = [free[20], target.config.vocab_size - 1]
    for criteria in ([StopAtLength(prompt.shape[1] + 11)], [StopAfterSequence(free[5:7])]):
        ref = _greedy(target, prompt, criteria, eos_token_id=eos)
        out = _greedy(target, prompt, criteria, eos_token_id=eos, assistant_model=drafter)
        assert torch.equal(ref, out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_ends_at_the_first_stop_of_its_own_tokens(tiny_targets, trained_drafters, seed):
    """Sampling: the output ends at the first position where the criterion fires on the committed tokens, and the
    criterion fires nowhere before it (plain sampling's rule, applied to the same committed tokens)."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[1]
    torch.manual_seed(seed)
    free = target.generate(prompt, do_sample=True, max_new_tokens=40, assistant_model=drafter)[0].tolist()
    generated = free[prompt.shape[1]:]
    stop = generated[9:10]  # a token the drafter's sampling produces: it recurs often enough to be met
    criterion = StopAfterSequence(stop)
    hits = 0
    for trial in range(6):
        torch.manual_seed(100 * seed + trial)
        out = target.generate(prompt, do_sample=True, max_new_tokens=40, assistant_model=drafter,
                              stopping_criteria=StoppingCriteriaList([criterion]))[0]
        fired = [bool(criterion(out[None, :n], None)[0]) for n in range(prompt.shape[1] + 1, out.shape[0] + 1)]
        assert not any(fired[:-1]), "generation ran past a stop"
        hits += fired[-1]
        stats = drafter.last_stats
        assert 1 + sum(stats.accepted) + stats.rounds == out.shape[0] - prompt.shape[1]
    assert hits > 0


@pytest.mark.parametrize("method", ["fixed", "scheduler"])
def test_batched_engine_stops_where_generate_stops(tiny_targets, trained_drafters, method):
    """Each request has its own criterion (a token pair from its plain continuation, or a custom length); they end
    where plain generate() ends, with finish_reason "stop", while the rest of the batch runs on."""
    from hf_dspark.engine import SamplingParams, generate_batch

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompts, params, expected = [], [], []
    for i, prompt in enumerate(random_prompts(48, 8, target.config.vocab_size, seed=1)[:6]):
        free = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1]:].tolist()
        end = 5 + 3 * i
        criterion = StopAtLength(prompt.shape[1] + end) if i % 2 else StopAfterSequence(free[end - 2:end])
        ref = _greedy(target, prompt, [criterion], max_new_tokens=30)
        prompts.append(prompt[0].tolist())
        params.append(SamplingParams(max_new_tokens=30, stopping_criteria=[criterion]))
        expected.append(ref[0, prompt.shape[1]:].tolist())
    result = generate_batch(target, prompts, drafter, params, policy=method)
    for out, tokens in zip(result.outputs, expected):
        assert out.token_ids == tokens
        assert out.finish_reason == ("stop" if len(tokens) < 30 else "length")
    assert {o.finish_reason for o in result.outputs} == {"stop"}


def test_engine_stop_strings_need_a_tokenizer(tiny_targets):
    from hf_dspark.engine import DSparkEngine, SamplingParams

    engine = DSparkEngine(tiny_targets["llama"], policy="plain")
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(stop_strings=["return"]))
    with pytest.raises(ValueError, match="non-empty strings"):
        SamplingParams(stop_strings=[""])
