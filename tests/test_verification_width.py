"""A fixed verification width (``verification_width="fixed"``, automatic with a static target cache on CUDA): every
block round verifies the whole block and every lookup round the longest lookup draft, padded past a shorter match, so
a compiled verification forward sees one width per source. Greedy outputs stay identical to plain decoding (a
verified token is kept only where it is the target's own choice); the sampled case is the chi-square test in
tests/test_hybrid.py."""

import types

import pytest
import torch
from transformers import DynamicCache, StaticCache

from hf_dspark.generation import VERIFICATION_WIDTHS, verification_width_mode
from hf_dspark.scheduling import lookup_max_tokens
from tests.helpers import random_prompts

CHEAP_VERIFY = {"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [100.0, 98.0]}


def _settings(drafter, **settings):
    for key, value in settings.items():
        setattr(drafter.generation_config, key, value)


@pytest.mark.parametrize("policy", ["fixed", "scheduler", "hybrid"])
@pytest.mark.parametrize("static_cache", [False, True])
def test_fixed_width_greedy_equals_plain(tiny_targets, trained_drafters, policy, static_cache):
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    g = drafter.config.block_size
    prompts = random_prompts(2, 8, target.config.vocab_size, seed=5)
    prompts[1] = torch.cat([prompts[1], prompts[1][:, :6], prompts[1]], dim=1)  # repeated text: lookup fires
    _settings(drafter, verification_policy=policy, sps_profile=CHEAP_VERIFY, verification_width="fixed")
    sources = set()
    try:
        for prompt in prompts:
            new_tokens = 23
            extra = {}
            if static_cache:
                extra["cache"] = StaticCache(config=target.config, max_cache_len=prompt.shape[1] + 40)
            plain = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens)
            out = target.generate(prompt, do_sample=False, max_new_tokens=new_tokens, assistant_model=drafter, **extra)
            assert torch.equal(plain, out), f"\nplain  {plain[0, prompt.shape[1]:].tolist()}\n" \
                                            f"dspark {out[0, prompt.shape[1]:].tolist()}"
            stats = drafter.last_stats
            length = prompt.shape[1] + 1  # after the prefill round
            for verified, accepted, source in zip(stats.verified, stats.accepted, stats.sources):
                room = prompt.shape[1] + new_tokens - length - 1
                if source == "block":
                    assert verified == min(g, room), (source, verified, room)
                elif source == "lookup":
                    assert verified == min(lookup_max_tokens(drafter.generation_config), room), (source, verified)
                length += accepted + 1
                sources.add(source)
    finally:
        _settings(drafter, verification_policy="fixed", verification_width=None)
        del drafter.generation_config.sps_profile
    assert "block" in sources
    if policy == "hybrid":
        assert "lookup" in sources


def test_auto_width_is_fixed_only_for_a_static_cache_on_cuda(tiny_targets):
    drafter = types.SimpleNamespace(generation_config=types.SimpleNamespace(verification_width=None))
    config = tiny_targets["llama"].config
    static, dynamic = StaticCache(config=config, max_cache_len=16), DynamicCache(config=config)
    assert VERIFICATION_WIDTHS == ("auto", "variable", "fixed")
    assert verification_width_mode(drafter, static, cuda=True) == "fixed"
    assert verification_width_mode(drafter, static, cuda=False) == "variable"  # nothing compiles it on CPU
    assert verification_width_mode(drafter, dynamic, cuda=True) == "variable"
    assert verification_width_mode(drafter, None, cuda=True) == "variable"
    drafter.generation_config.verification_width = "variable"
    assert verification_width_mode(drafter, static, cuda=True) == "variable"
    drafter.generation_config.verification_width = "fixed"
    assert verification_width_mode(drafter, None, cuda=False) == "fixed"
    drafter.generation_config.verification_width = "wide"
    with pytest.raises(ValueError, match="verification_width"):
        verification_width_mode(drafter, None, cuda=False)


def test_the_generator_sees_the_targets_cache(tiny_targets, trained_drafters, monkeypatch):
    """``auto`` decides from the cache transformers decodes with: a StaticCache passed as ``cache=`` reaches it."""
    import hf_dspark.generation as generation

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    seen = []
    original = generation.verification_width_mode

    def record(drafter_, cache, cuda):
        seen.append(type(cache).__name__)
        return original(drafter_, cache, cuda)

    monkeypatch.setattr(generation, "verification_width_mode", record)
    prompt = random_prompts(1, 8, target.config.vocab_size, seed=2)[0]
    target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=drafter,
                    cache=StaticCache(config=target.config, max_cache_len=32))
    target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=drafter)
    assert seen == ["StaticCache", "DynamicCache"]
