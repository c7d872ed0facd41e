"""DSpark-assisted greedy decoding must equal plain greedy decoding token for token (float32)."""

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from tests.helpers import make_drafter, random_prompts

HEADS = ["none", "markov", "gated", "rnn"]
BLOCK_SIZES = [1, 4, 7]
POLICIES = {"fixed": {}, "threshold": {"confidence_threshold": 0.5}}


def set_policy(drafter, name, **settings):
    drafter.generation_config.verification_policy = name
    for key, value in {**POLICIES.get(name, {}), **settings}.items():
        setattr(drafter.generation_config, key, value)


def assert_same_greedy(target, drafter, prompt, **kwargs):
    ref = target.generate(prompt, do_sample=False, **kwargs)
    out = target.generate(prompt, do_sample=False, assistant_model=drafter, **kwargs)
    assert torch.equal(ref, out), f"\nplain  {ref[0, prompt.shape[1]:].tolist()}\ndspark {out[0, prompt.shape[1]:].tolist()}"
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head", HEADS)
def test_random_drafter(tiny_targets, family, head, block_size, policy):
    target = tiny_targets[family]
    drafter = make_drafter(target, head=head, block_size=block_size, seed=block_size)
    set_policy(drafter, policy)
    for prompt in random_prompts(2, 7, target.config.vocab_size, seed=block_size):
        assert_same_greedy(target, drafter, prompt, max_new_tokens=19)
        stats = drafter.last_stats
        assert stats.rounds > 0 and max(stats.verified) <= block_size


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("num_verify", [1, 4, 7])
def test_trained_drafter_long_accepted_runs(tiny_targets, trained_drafters, family, policy, num_verify):
    target, drafter = tiny_targets[family], trained_drafters[family]
    set_policy(drafter, policy, num_verify_tokens=num_verify)
    taus = []
    for prompt in random_prompts(48, 8, target.config.vocab_size, seed=1)[:4]:
        assert_same_greedy(target, drafter, prompt, max_new_tokens=40)
        taus.append(drafter.last_stats.accepted_length)
        if policy == "fixed":
            assert max(drafter.last_stats.verified) <= num_verify
    if policy == "fixed" and num_verify == 7:
        assert max(taus) >= 5.0, f"trained drafter should get long accepted runs, got tau={taus}"
    set_policy(drafter, "fixed", num_verify_tokens=None)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9, 13, 22])
def test_max_new_tokens_mid_block(tiny_targets, trained_drafters, family, max_new_tokens):
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[3]
    out = assert_same_greedy(target, drafter, prompt, max_new_tokens=max_new_tokens)
    assert out.shape[1] == prompt.shape[1] + max_new_tokens


def test_eos_inside_a_draft_block(tiny_targets, trained_drafters, family):
    target, drafter = tiny_targets[family], trained_drafters[family]
    hits = 0
    for prompt in random_prompts(48, 8, target.config.vocab_size, seed=1)[:6]:
        free = target.generate(prompt, do_sample=False, max_new_tokens=30)[0, prompt.shape[1]:].tolist()
        # An EOS that first appears well inside the continuation, so it lands inside an accepted block.
        position = next((i for i in range(6, len(free)) if free[i] not in free[:i]), None)
        if position is None:
            continue
        eos = free[position]
        out = assert_same_greedy(target, drafter, prompt, max_new_tokens=30, eos_token_id=eos)
        assert out[0, -1].item() == eos and out.shape[1] == prompt.shape[1] + position + 1
        last_round = drafter.last_stats.accepted[-1]
        hits += last_round > 0  # EOS was among accepted drafts
    assert hits > 0, "no case exercised EOS inside an accepted draft block"


class CollectingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_and_return_dict(tiny_targets, trained_drafters, family):
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[2]
    streamer = CollectingStreamer()
    out = target.generate(prompt, do_sample=False, max_new_tokens=25, assistant_model=drafter, streamer=streamer,
                          return_dict_in_generate=True, output_scores=True)
    ref = target.generate(prompt, do_sample=False, max_new_tokens=25, return_dict_in_generate=True,
                          output_scores=True)
    assert torch.equal(out.sequences, ref.sequences)
    assert streamer.ended
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]  # first chunk is the prompt
    assert streamer.chunks[0] == prompt[0].tolist()
    assert streamed == out.sequences[0, prompt.shape[1]:].tolist()
    assert len(streamer.chunks) - 1 < 25, "accepted drafts should arrive several tokens per chunk"
    assert len(out.scores) == 25
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_zero_draft_rounds_keep_cache_bookkeeping(tiny_targets, trained_drafters, family):
    """A threshold of 1.0 verifies no drafts at all; every round is the target alone, still exact."""
    target, drafter = tiny_targets[family], trained_drafters[family]
    set_policy(drafter, "threshold", confidence_threshold=1.0)
    try:
        prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[0]
        assert_same_greedy(target, drafter, prompt, max_new_tokens=15)
        stats = drafter.last_stats
        assert sum(stats.verified) == 0 and stats.accepted_length == 1.0
        # Mixed zero and non-zero rounds: a mid threshold on the trained drafter.
        set_policy(drafter, "threshold", confidence_threshold=0.6)
        assert_same_greedy(target, drafter, prompt, max_new_tokens=30)
    finally:
        set_policy(drafter, "fixed")


def test_repetition_penalty_processor_composes(tiny_targets, trained_drafters, family):
    target, drafter = tiny_targets[family], trained_drafters[family]
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[1]
    assert_same_greedy(target, drafter, prompt, max_new_tokens=24, repetition_penalty=1.3)


@pytest.mark.parametrize("profile", [
    {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 60.0]},  # verification expensive
    {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]},  # verification almost free
])
def test_scheduler_policy_greedy_equality(tiny_targets, trained_drafters, family, profile):
    target, drafter = tiny_targets[family], trained_drafters[family]
    # Without the realized gate (explicitly, though it is the default): on the tiny models its timing verdict could
    # stop drafting, and this test is about the lengths the scheduler picks (the gate has its own test below).
    set_policy(drafter, "scheduler", sps_profile=profile, realized_gate=False)
    try:
        lengths = []
        for prompt in random_prompts(48, 8, target.config.vocab_size, seed=1)[:3]:
            assert_same_greedy(target, drafter, prompt, max_new_tokens=30)
            lengths += drafter.last_stats.verified
        assert len(set(lengths)) > 1 or profile["sample_steps_per_sec"][1] > 90, "the scheduler should vary lengths"
    finally:
        set_policy(drafter, "fixed")
        del drafter.generation_config.sps_profile
        del drafter.generation_config.realized_gate


def test_scheduler_realized_gate_is_shared_timed_and_lossless(tiny_targets, trained_drafters):
    """generate() times every whole round after the prefill into one RealizedGate per (drafter, target) shared by
    all calls; a gate that has seen drafting lose keeps the target decoding alone (outputs unchanged), and
    ``realized_gate=False`` drafts again."""
    from hf_dspark.generation import realized_gate_for

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    drafter.__dict__.pop("_dspark_realized_gates", None)
    cheap = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}  # the confidences say "draft"
    set_policy(drafter, "scheduler", sps_profile=cheap, realized_gate=True, explore_interval=1000,
               max_explore_interval=1000)
    prompts = random_prompts(48, 8, target.config.vocab_size, seed=1)[:3]
    try:
        recorded = 0
        for prompt in prompts[:2]:
            assert_same_greedy(target, drafter, prompt, max_new_tokens=20)
            stats = drafter.last_stats
            gate = realized_gate_for(drafter, target)
            recorded += stats.rounds - 1  # every round but the last (timed from its start to the next round's)
            windows = {drafted: list(gate.realized.get((1, drafted), [])) for drafted in (True, False)}
            assert sum(len(w) for w in windows.values()) == recorded  # one gate for both calls
            assert all(s > 0 for w in windows.values() for _, s in w)
            emitted = [a + 1 for d, a in zip(stats.drafted[:-1], stats.accepted[:-1]) if d > 0]
            assert [int(e) for e, _ in windows[True][len(windows[True]) - len(emitted):]] == emitted
        assert gate.realized.get((1, True)), "the cheap profile should have drafted"
        # Drafting measured slower than plain decoding: no drafting, same output.
        for _ in range(32):
            gate.record_step(1, True, 1, 10.0)
        for _ in range(32):
            gate.record_step(1, False, 1, 0.01)
        gate.steps_since[(1, True)] = 0
        assert_same_greedy(target, drafter, prompts[2], max_new_tokens=20)
        assert sum(drafter.last_stats.drafted) == 0 and drafter.last_stats.rounds > 0
        set_policy(drafter, "scheduler", realized_gate=False)
        assert_same_greedy(target, drafter, prompts[2], max_new_tokens=20)
        assert sum(drafter.last_stats.drafted) > 0
    finally:
        set_policy(drafter, "fixed")
        for key in ("sps_profile", "realized_gate", "explore_interval", "max_explore_interval"):
            delattr(drafter.generation_config, key)
        drafter.__dict__.pop("_dspark_realized_gates", None)


def test_scheduler_profiles_automatically(tiny_targets, trained_drafters, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DSPARK_CACHE", str(tmp_path))
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    set_policy(drafter, "scheduler")
    try:
        prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[0]
        assert_same_greedy(target, drafter, prompt, max_new_tokens=12)
        assert list((tmp_path / "profiles").glob("sps-*.json")), "a profile should have been cached"
    finally:
        set_policy(drafter, "fixed")


@pytest.mark.parametrize("head", ["none", "markov", "rnn"])
def test_draft_vocabulary_subset_is_lossless(tiny_targets, family, head):
    target = tiny_targets[family]
    drafter = make_drafter(target, head=head, block_size=4, draft_vocab_size=40)
    drafter.set_draft_vocab(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(2))[:40])
    for prompt in random_prompts(2, 7, target.config.vocab_size, seed=4):
        assert_same_greedy(target, drafter, prompt, max_new_tokens=16)
    draft = drafter.draft(torch.tensor([5]), 0 + 4, torch.zeros(1, 4, 128))
    # the full-vocabulary logits are built only when read (greedy callers never pay for them), from exactly the
    # draft-vocabulary logits the tokens were picked from
    assert draft.to_full_vocab is not None and draft.sampled_logits.shape[-1] == 40
    assert torch.equal(drafter.draft_vocab[draft.sampled_logits.argmax(-1)], draft.draft_ids)
    assert draft.base_logits.shape[-1] == 40 and draft.draft_logits.shape[-1] == target.config.vocab_size
    assert draft.to_full_vocab is None and draft.sampled_logits is draft.draft_logits  # built once, then kept
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[drafter.draft_vocab] = False
    assert torch.isinf(draft.draft_logits[0, :, outside]).all()  # q = 0 outside the draft vocabulary
    assert bool(torch.isin(draft.draft_ids, drafter.draft_vocab).all())
