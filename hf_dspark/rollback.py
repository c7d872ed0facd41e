"""Targets whose cache a rejected draft cannot be taken back from: ``rollback_refusal``, which both routes ask before
speculative decoding starts.

This file is self-contained (no imports): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

# transformers' cache layer kinds that hold a recurrent or convolution state: a forward folds every token it reads
# into the state, so the tokens of rejected drafts cannot be removed from it afterwards.
RECURRENT_LAYER_KINDS = ("conv", "linear_attention", "hybrid", "hybrid_sliding")


def rollback_refusal(target) -> str | None:
    """Why speculative decoding cannot serve ``target`` (None when it can): a layer kind whose state cannot roll back
    (``RECURRENT_LAYER_KINDS``, named with its layer indices), or a model whose cache is not transformers'
    ``DynamicCache`` at all (RWKV, xLSTM, the original MiniMax, ...)."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    kinds = list(getattr(config, "layer_types", None) or [])
    recurrent = sorted({kind for kind in kinds if kind in RECURRENT_LAYER_KINDS})
    if recurrent:
        where = {kind: [i for i, k in enumerate(kinds) if k == kind] for kind in recurrent}
        return (f"{type(target).__name__} has {', '.join(f'{k!r} layers {v}' for k, v in where.items())}: their "
                "recurrent state absorbs every token a verification forward reads, so rejected drafts cannot be "
                "rolled back")
    supports = getattr(type(target), "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return (f"{type(target).__name__} keeps a model-specific (recurrent) cache instead of transformers' "
                "DynamicCache, which cannot be rolled back past rejected drafts")
    return None


__all__ = ["RECURRENT_LAYER_KINDS", "rollback_refusal"]
