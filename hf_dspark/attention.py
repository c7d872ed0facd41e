"""Grouped-query attention for verification forwards, without copying the KV cache per query head.

transformers' SDPA attention (``integrations/sdpa_attention.py``) serves a grouped-query model (fewer key/value heads
than query heads) in one of three ways: ``enable_gqa`` when there is no mask, folding the query heads of a group into
the query length when one token is decoded (``pack_gqa``), and otherwise ``repeat_kv``, which copies every cached key
and value once per query head of its group before each layer's attention. A verification forward has a mask (the
batched engine's rows have holes and padding) and several query tokens per row, so it takes the last way: SmolLM2-135M
(9 query heads over 3 key/value heads) copies three times its whole cache at every layer of every step. That copy
grows with batch size times context and dominates a wide step. On CPU the ``enable_gqa`` kernel is also slow for
batches.

``packed_gqa_attention`` extends the single-token fold to any query length: the ``n_rep`` query heads of a group
and the ``q`` query tokens become ``n_rep * q`` query rows against the group's own key/value head, with the (head
independent) mask repeated per head of the group. Every query row attends to exactly the keys it did before, so the
result is the same attention; only the kernel's grouping of the work changes (in bfloat16 the last bits can differ,
as between any two SDPA kernels). One token without a mask (a batch without holes) is folded the same way instead
of taking ``enable_gqa``, which on CPU costs about twice as much for a batch of 16. Cases it does not cover (no
grouped heads, one token with a mask (transformers folds it already), several tokens without a mask (a causal
prefill: transformers' SDPA takes the kernel's own causal path, as plain decoding's prefill does, and over a static
cache keeps the filled keys only), dropout, per-head or additive masks, position biases) go to transformers' SDPA
unchanged.

It is registered with transformers' ``AttentionInterface`` (and the SDPA mask builder with ``AttentionMaskInterface``)
as ``"hf_dspark_packed_sdpa"``. ``packed_attention(model)`` switches a model that uses ``"sdpa"`` to it for the
duration of a block; DSpark-assisted ``generate()``, the batched engine and the SPS profile run their target forwards
inside it, so the model a user passed in is left as it was. On CPU, at a 7k-token context, this makes verifying two
tokens cost 1.5x one token's forward instead of 2x: the copy grows with the context, the kernel's work barely does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_ATTENTION = "hf_dspark_packed_sdpa"


def packed_gqa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA attention with the query heads of each key/value group folded into the query length (see the module
    docstring). ``query`` [B, H, q, d], ``key`` / ``value`` [B, H_kv, kv, d], ``attention_mask`` a boolean
    [B, 1, q, kv] mask, or None for one query token (several without a mask go to SDPA); returns [B, q, H, d] as
    transformers' SDPA does."""
    n_rep = int(getattr(module, "num_key_value_groups", 1) or 1)
    batch, heads, q_length, dim = query.shape
    kv_length = key.shape[2]
    # one query token goes without a mask, several with one. Spelled as a branch on q_length, not as a comparison of
    # two booleans: under torch.compile with dynamic shapes q_length is symbolic, and dynamo cannot compare the
    # symbolic ``q_length > 1`` with a Python bool (sympy refuses Eq(s > 1, True)); a branch is an ordinary guard.
    mask_as_expected = (attention_mask is None) if q_length == 1 else (attention_mask is not None)
    covered = (
        n_rep > 1 and mask_as_expected and dropout == 0.0
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None and key.shape[1] * n_rep == heads and value.shape[-1] == dim
        and (attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.dim() == 4
                                        and attention_mask.shape[1] == 1 and attention_mask.shape[2] == q_length))
    )
    if not covered:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask  # None only for one token, which sees every key
    if mask is not None:
        mask = mask[:, :, None].expand(mask.shape[0], 1, n_rep, q_length, kv_length)
        mask = mask.reshape(mask.shape[0], 1, n_rep * q_length, kv_length)
    packed = query.reshape(batch, heads // n_rep, n_rep * q_length, dim)  # head h = group * n_rep + r
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_length, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_ATTENTION, packed_gqa_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)


def _configs(model) -> list:
    configs = [model.config]
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if text is not model.config:
        configs.append(text)
    return configs


@contextlib.contextmanager
def packed_attention(model) -> Iterator[bool]:
    """Run ``model`` with ``packed_gqa_attention`` inside the block when it uses transformers' ``"sdpa"``; any other
    implementation (eager, flash, flex, a custom one) is left alone. Yields whether the switch was made; the
    previous implementation is restored on exit, also after an exception. The switch is on the model's config, so
    another thread running the same model meanwhile runs with it too (the same attention, another kernel grouping)."""
    configs = [c for c in _configs(model) if getattr(c, "_attn_implementation", None) == "sdpa"]
    for config in configs:
        config._attn_implementation = PACKED_ATTENTION
    try:
        yield bool(configs)
    finally:
        for config in configs:
            config._attn_implementation = "sdpa"


__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_gqa_attention"]
