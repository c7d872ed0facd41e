"""A fixed verification width (``verification_width="fixed"``, automatic with a static target cache on CUDA): every
block round verifies the whole block and every lookup round the longest lookup draft, padded past a shorter match, so
a compiled verification forward sees one width per source. Greedy outputs stay identical to plain decoding (a
verified token is kept only where it is the target's own choice); the sampled case is the chi-square test in
tests/test_hybrid.py."""

import types

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, StaticCache
from transformers.generation.configuration_utils import CompileConfig

from hf_dspark.generation import VERIFICATION_WIDTHS, verification_records_graphs, verification_width_mode
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


def test_auto_width_is_fixed_only_where_the_verification_forward_records_graphs():
    drafter = types.SimpleNamespace(generation_config=types.SimpleNamespace(verification_width=None))
    assert VERIFICATION_WIDTHS == ("auto", "variable", "fixed")
    assert verification_width_mode(drafter, records_graphs=True) == "fixed"
    assert verification_width_mode(drafter, records_graphs=False) == "variable"
    drafter.generation_config.verification_width = "variable"
    assert verification_width_mode(drafter, records_graphs=True) == "variable"
    drafter.generation_config.verification_width = "fixed"
    assert verification_width_mode(drafter, records_graphs=False) == "fixed"
    drafter.generation_config.verification_width = "wide"
    with pytest.raises(ValueError, match="verification_width"):
        verification_width_mode(drafter, records_graphs=False)


def _compile_config(**settings) -> CompileConfig:
    config = CompileConfig(**settings)
    config._compile_all_devices = True  # transformers' switch to compile on any device (its rule reads the device)
    return config


def test_graphs_follow_transformers_compile_rule_on_cuda(tiny_targets):
    """CUDA graphs are recorded where transformers compiles the verification forward (its own rule: a compilable
    cache, compile not disabled) in a mode that captures graphs, and only on CUDA."""
    target = tiny_targets["llama"]
    static = {"cache": StaticCache(config=target.config, max_cache_len=16)}
    dynamic = {"cache": DynamicCache(config=target.config)}
    on_cuda = types.SimpleNamespace(  # transformers' rule and default, read through a target that reports CUDA
        device=torch.device("cuda"), _valid_auto_compile_criteria=target._valid_auto_compile_criteria,
        _default_compile_config=target._default_compile_config)

    def graphs(model, kwargs, **config):
        return verification_records_graphs(model, kwargs, GenerationConfig(**config))

    everywhere = _compile_config()  # transformers' default mode, "reduce-overhead"
    assert graphs(on_cuda, static, compile_config=everywhere)
    assert not graphs(on_cuda, dynamic, compile_config=everywhere)
    assert not graphs(on_cuda, static, compile_config=everywhere, disable_compile=True)
    assert not graphs(on_cuda, static, compile_config=_compile_config(mode="default"))
    assert graphs(on_cuda, static, compile_config=_compile_config(mode="max-autotune"))
    assert graphs(on_cuda, static, compile_config=_compile_config(mode=None, options={"triton.cudagraphs": True}))
    assert not graphs(target, static, compile_config=everywhere)  # compiled on CPU, but no CUDA graphs there
    # Without a compile_config the target's default applies; transformers compiles only on accelerators, and the
    # rule reads the real (CPU) device, so this stays False here
    assert not graphs(on_cuda, static)
    # A transformers without the rule: the cache decides
    bare = types.SimpleNamespace(device=torch.device("cuda"))
    assert graphs(bare, static) and not graphs(bare, dynamic) and not graphs(bare, {})


def test_the_generator_asks_with_the_targets_cache_and_config(tiny_targets, trained_drafters, monkeypatch):
    """``auto`` decides from what transformers decodes with: a StaticCache passed as ``cache=`` and the call's
    generation config reach the rule."""
    import hf_dspark.generation as generation

    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    seen = []
    original = generation.verification_records_graphs

    def record(model, kwargs, config):
        seen.append((model is target, type(kwargs.get("cache")).__name__, config.compile_config is not None))
        return original(model, kwargs, config)

    monkeypatch.setattr(generation, "verification_records_graphs", record)
    prompt = random_prompts(1, 8, target.config.vocab_size, seed=2)[0]
    target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=drafter,
                    cache=StaticCache(config=target.config, max_cache_len=32), compile_config=CompileConfig())
    target.generate(prompt, do_sample=False, max_new_tokens=6, assistant_model=drafter)
    assert seen == [(True, "StaticCache", True), (True, "DynamicCache", False)]


@pytest.mark.parametrize("width", ["variable", "fixed"])
def test_a_compiled_target_keeps_greedy_outputs(tiny_targets, trained_drafters, width):
    """transformers compiles the target's verification forward with a static cache (here on CPU, through its
    compile-everywhere switch, traced by dynamo without a code generator): DSpark's rounds run through it and greedy
    outputs stay those of plain decoding."""
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    prompt = random_prompts(1, 8, target.config.vocab_size, seed=4)[0]
    prompt = torch.cat([prompt, prompt, prompt], dim=1)  # repeated text: lookup rounds too
    compile_config = _compile_config(backend="eager", mode=None)
    _settings(drafter, verification_policy="hybrid", sps_profile=CHEAP_VERIFY, verification_width=width)
    try:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=20)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                              cache=StaticCache(config=target.config, max_cache_len=64), compile_config=compile_config)
    finally:
        _settings(drafter, verification_policy="fixed", verification_width=None)
        del drafter.generation_config.sps_profile
    assert torch.equal(plain, out)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the verification forward was compiled
    assert set(drafter.last_stats.sources) >= {"block", "lookup"}
