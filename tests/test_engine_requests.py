"""The engine and its requests: every request is checked when it arrives, one failing request never ends the
others, a request can be aborted, a seed gives a sampled request its own random numbers, and a load of requests
arriving while the engine steps (bad and aborted ones among them) loses none of the good ones."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import StoppingCriteria

from hf_dspark.engine import DSparkEngine, SamplingParams
from tests.helpers import char_tokenizer, make_drafter, make_target


@pytest.fixture(scope="module")
def models():
    target = make_target("llama")
    return target, make_drafter(target, block_size=4)


def plain(target, prompt: list[int], new_tokens: int) -> list[int]:
    out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt, params, message", [
    ([5, 200, 7], None, "token id 200 is outside the target's vocabulary"),
    ([5, -1, 7], None, "token id -1 is outside"),
    (torch.tensor([5.0, 6.0]), None, "token ids must be integers, got a torch.float32 tensor"),
    ([5, 6.5], None, "token ids must be integers, got 6.5"),
    ([5, True], None, "token ids must be integers, got True"),
    ([], None, "empty prompt"),
    ([5] * 500, SamplingParams(max_new_tokens=20), "500-token prompt plus max_new_tokens=20 passes the target's "
                                                   "context of 512"),
    ([5, 6], {"max_new_tokens": 4}, "params must be SamplingParams"),
    ([5, 6], SamplingParams(stop_strings=["x"]), "needs the engine's tokenizer"),
])
def test_a_bad_request_is_refused_when_it_arrives(models, prompt, params, message):
    target, drafter = models
    engine = DSparkEngine(target, drafter, policy="fixed")
    with pytest.raises(ValueError, match="request 'bad'") as refused:
        engine.add_request(prompt, params, request_id="bad")
    assert message in str(refused.value)
    assert not engine.has_unfinished()  # nothing was queued
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3), request_id="bad")  # the id is still free


def test_seed_must_be_an_integer():
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(do_sample=True, seed=1.5)


class FailsAfter(StoppingCriteria):
    def __init__(self, tokens: int):
        self.tokens = tokens

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.shape[1] >= self.tokens:
            raise RuntimeError("criterion broke")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_failing_request_ends_alone(models):
    target, drafter = models
    engine = DSparkEngine(target, drafter, policy="fixed")
    prompts = {"a": [3, 4, 5, 6], "b": [7, 8, 9], "c": [10, 11, 12, 13, 14]}
    for rid, prompt in prompts.items():
        criteria = [FailsAfter(len(prompt) + 5)] if rid == "b" else []
        engine.add_request(prompt, SamplingParams(max_new_tokens=16, stopping_criteria=criteria), request_id=rid)
    events = list(engine.stream())
    failed = engine.outputs["b"]
    assert failed.finish_reason == "error" and "criterion broke" in failed.error
    assert [e for e in events if e.request_id == "b"][-1].error == failed.error
    for rid in ("a", "c"):
        assert engine.outputs[rid].finish_reason == "length"
        assert engine.outputs[rid].token_ids == plain(target, prompts[rid], 16)


def test_abort_frees_the_slot(models):
    target, drafter = models
    engine = DSparkEngine(target, drafter, policy="fixed", max_concurrency=2)
    for rid in ("a", "b", "c"):
        engine.add_request([3, 4, 5 + len(rid)], SamplingParams(max_new_tokens=24), request_id=rid)
    engine.step()  # a and b run, c waits
    assert engine.abort_request("c") and engine.outputs["c"].finish_reason == "abort"
    assert engine.abort_request("a") and engine.num_active == 1
    assert engine.outputs["a"].finish_reason == "abort" and len(engine.outputs["a"].token_ids) < 24
    engine.run()
    assert engine.outputs["b"].token_ids == plain(target, [3, 4, 6], 24)
    assert not engine.abort_request("b")  # finished already
    with pytest.raises(ValueError, match="no request 'zzz'"):
        engine.abort_request("zzz")


def test_a_seed_repeats_a_sampled_request(models):
    target, drafter = models
    params = SamplingParams(max_new_tokens=20, do_sample=True, temperature=0.9, seed=7)

    def sampled(others: int) -> list[int]:
        engine = DSparkEngine(target, drafter, policy="fixed", seed=others)
        engine.add_request([3, 4, 5], params, request_id="seeded")
        for i in range(others):
            engine.add_request([9, 8, 7 + i], SamplingParams(max_new_tokens=12, do_sample=True), request_id=str(i))
        engine.run()
        return engine.outputs["seeded"].token_ids

    alone = sampled(0)
    assert sampled(0) == alone and sampled(3) == alone  # the other requests draw from the engine's numbers


def _load(target, drafter, requests: int, seed: int = 0):
    """Requests arriving while the engine steps: mixed prompt and output lengths, greedy and sampled, stop strings,
    one bad request and one abort mid-run."""
    rng = random.Random(seed)
    tokenizer = char_tokenizer(target.config.vocab_size)
    engine = DSparkEngine(target, drafter, policy="fixed", max_concurrency=6, tokenizer=tokenizer)
    pending = []
    for i in range(requests):
        prompt = [rng.randrange(2, 120) for _ in range(rng.randrange(1, 60))]
        sampled = i % 3 == 2
        params = SamplingParams(max_new_tokens=rng.randrange(1, 24), do_sample=sampled,
                                stop_strings=["~~"] if i % 5 == 4 else ())
        pending.append((str(i), prompt, params))
    accepted, refused, aborted = {}, [], None
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                rid, prompt, params = pending.pop(0)
                engine.add_request(prompt, params, request_id=rid)
                accepted[rid] = (prompt, params)
        if len(accepted) == requests // 2 and not refused:
            with pytest.raises(ValueError, match="outside the target's vocabulary"):
                engine.add_request([3, 10**6], request_id="bad")
            refused.append("bad")
        if aborted is None and engine.num_active > 1:
            aborted = engine.batch.rows[-1].request_id
            engine.abort_request(aborted)
        engine.step()
    return engine, accepted, aborted, tokenizer


@pytest.mark.parametrize("requests", [pytest.param(12, id="short"),
                                      pytest.param(64, id="long", marks=pytest.mark.slow)])
def test_load_loses_no_good_request(models, requests):
    target, drafter = models
    engine, accepted, aborted, tokenizer = _load(target, drafter, requests)
    assert aborted is not None and engine.outputs[aborted].finish_reason == "abort"
    for rid, (prompt, params) in accepted.items():
        output = engine.outputs[rid]
        if rid == aborted:
            continue
        assert output.finish_reason in ("length", "stop", "eos"), (rid, output.finish_reason, output.error)
        if not params.do_sample:
            expected = plain(target, prompt, params.max_new_tokens)
            if params.stop_strings:  # a stop string ends it early, never elsewhere
                assert expected[: len(output.token_ids)] == output.token_ids
            else:
                assert output.token_ids == expected
