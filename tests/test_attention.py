"""The packed grouped-query attention the engine's verify forwards use: the same attention as transformers' SDPA."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_dspark.attention import PACKED_ATTENTION, packed_attention, packed_gqa_attention
from tests.helpers import make_target


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(batch=3, heads=6, kv_heads=2, q=4, kv=11, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, q, dim, generator=g)
    key = torch.randn(batch, kv_heads, kv, dim, generator=g)
    value = torch.randn(batch, kv_heads, kv, dim, generator=g)
    return query, key, value


def _ragged_mask(batch, q, kv, seed=0):
    """Boolean [B, 1, q, kv]: causal over the last q keys, with holes in the cached part (as the engine's rows)."""
    g = torch.Generator().manual_seed(seed)
    cached = torch.rand(batch, kv - q, generator=g) > 0.3
    cached[:, 0] = True
    causal = torch.arange(q)[:, None] >= torch.arange(q)[None, :]
    return torch.cat([cached[:, None, :].expand(batch, q, -1), causal.expand(batch, q, q)], dim=-1)[:, None]


@pytest.mark.parametrize("q", [2, 4, 7])
def test_packed_gqa_equals_sdpa_with_ragged_masks(q):
    module = _Module(groups=3)
    query, key, value = _inputs(q=q)
    mask = _ragged_mask(3, q, 11)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    got, _ = packed_gqa_attention(module, query, key, value, mask, scaling=0.3)
    assert got.shape == expected.shape == (3, q, 6, 8)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_packed_gqa_compiles_with_a_symbolic_query_length():
    """torch.compile with dynamic shapes (what transformers' compiled verification forward reaches once its widths
    vary) traces the packed path for one token without a mask and several with one, and gives the eager result."""
    module = _Module(groups=3)
    compiled = torch.compile(packed_gqa_attention, backend="eager", dynamic=True)
    for q in (1, 3, 5):
        query, key, value = _inputs(q=q)
        mask = None if q == 1 else _ragged_mask(3, q, 11)
        torch.testing.assert_close(compiled(module, query, key, value, mask, scaling=0.3)[0],
                                   packed_gqa_attention(module, query, key, value, mask, scaling=0.3)[0])


@pytest.mark.parametrize("kv", [4, 9])
def test_packed_gqa_leaves_several_tokens_without_a_mask_to_sdpa(kv):
    """Without a mask, several query tokens mean a causal prefill: over as many keys (a dynamic cache) or over a
    static cache's whole length, whose unfilled tail transformers' SDPA drops. Both are SDPA's own result."""
    module = _Module(groups=3)
    query, key, value = _inputs(q=4, kv=kv)
    expected, _ = sdpa_attention_forward(module, query, key, value, None)
    got, _ = packed_gqa_attention(module, query, key, value, None)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_packed_gqa_one_token_without_mask_sees_every_key():
    module = _Module(groups=3)
    query, key, value = _inputs(q=1, kv=9)
    expected, _ = sdpa_attention_forward(module, query, key, value, None)
    got, _ = packed_gqa_attention(module, query, key, value, None)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_packed_gqa_hands_uncovered_cases_to_sdpa(monkeypatch):
    calls = []
    import hf_dspark.attention as attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    query, key, value = _inputs(q=1)
    packed_gqa_attention(_Module(3), query, key, value, _ragged_mask(3, 1, 11))  # one token: transformers packs it
    query, key, value = _inputs(heads=2, kv_heads=2, q=3)
    packed_gqa_attention(_Module(1), query, key, value, _ragged_mask(3, 3, 11))  # no grouped heads
    query, key, value = _inputs(q=3)
    additive = torch.zeros(3, 1, 3, 11)
    packed_gqa_attention(_Module(3), query, key, value, additive)  # an additive float mask
    assert len(calls) == 3


def test_packed_attention_switches_sdpa_models_only_and_restores():
    target = make_target("llama", seed=0)
    target.config._attn_implementation = "sdpa"
    with packed_attention(target) as switched:
        assert switched and target.config._attn_implementation == PACKED_ATTENTION
    assert target.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with packed_attention(target):
            raise RuntimeError("boom")
    assert target.config._attn_implementation == "sdpa"
    target.config._attn_implementation = "eager"
    with packed_attention(target) as switched:
        assert not switched and target.config._attn_implementation == "eager"


def test_packed_attention_gives_the_targets_logits_on_a_wide_ragged_step():
    """A whole model: a cached batch with holes, then a 5-token step per row, with and without the switch."""
    from transformers import DynamicCache

    target = make_target("llama", seed=0).float()
    target.config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, target.config.vocab_size, (3, 12), generator=g)
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[0, 8:], valid[2, 5:7] = False, False
    block = torch.randint(0, target.config.vocab_size, (3, 5), generator=g)
    logits = []
    for packed in (False, True):
        cache = DynamicCache(config=target.config)
        with torch.no_grad():
            target(input_ids=prompt, attention_mask=valid, cache=cache, use_cache=True)
            positions = valid.sum(1, keepdim=True) + torch.arange(5)
            mask = torch.cat([valid, torch.ones(3, 5, dtype=torch.bool)], dim=1)
            with packed_attention(target) if packed else torch.no_grad():
                logits.append(target(input_ids=block, attention_mask=mask, position_ids=positions, cache=cache,
                                     use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)


def test_packed_gqa_leaves_a_causal_prefill_to_sdpa(monkeypatch):
    """A prefill without a mask (keys == queries) takes SDPA's own causal kernel, as plain decoding's prefill does."""
    module = _Module(groups=3)
    query, key, value = _inputs(q=6, kv=6)
    calls = []
    import hf_dspark.attention as attention

    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(1) or sdpa_attention_forward(*a, **k))
    got, _ = packed_gqa_attention(module, query, key, value, None)
    expected, _ = sdpa_attention_forward(module, query, key, value, None)
    assert calls == [1]
    torch.testing.assert_close(got, expected)


def test_dspark_generate_verifies_under_packed_attention():
    """generate(assistant_model=drafter) runs the target's forwards packed and leaves the model as it was; plain
    generate() is untouched."""
    import hf_dspark  # noqa: F401  (the generate() dispatch)
    from tests.helpers import make_drafter

    target = make_target("llama", seed=0).float().eval()
    target.config._attn_implementation = "sdpa"
    drafter = make_drafter(target).eval()
    seen = []
    hook = target.model.layers[0].self_attn.register_forward_pre_hook(
        lambda module, args: seen.append(target.config._attn_implementation))
    ids = torch.tensor([[1, 5, 9, 3]])
    target.generate(ids, max_new_tokens=6, do_sample=False, assistant_model=drafter)
    assert seen and set(seen) == {PACKED_ATTENTION}
    assert target.config._attn_implementation == "sdpa"
    seen.clear()
    target.generate(ids, max_new_tokens=3, do_sample=False)
    assert set(seen) == {"sdpa"}
    hook.remove()
