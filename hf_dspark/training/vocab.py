"""The drafter's draft vocabulary: the most frequent tokens of the responses it trains on, always with the special
tokens, and the share of response tokens they cover."""

from __future__ import annotations

from collections import Counter

import torch


def response_token_counts(sequences: list[dict]) -> Counter:
    """How often each token occurs at the supervised (response) positions of ``sequences``."""
    counts: Counter = Counter()
    for seq in sequences:
        counts.update(t for t, m in zip(seq["input_ids"], seq["loss_mask"]) if m)
    return counts


def top_tokens(counts: Counter, size: int, always: list[int] = ()) -> list[int]:
    """``always`` (e.g. EOS), then the most frequent tokens of ``counts``, up to ``size`` ids (sorted); fewer
    distinct tokens than that are padded with the lowest unused ids."""
    chosen = list(dict.fromkeys([int(t) for t in always]))
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if token not in chosen:
            chosen.append(token)
    filler = 0
    while len(chosen) < size:  # fewer distinct tokens than requested: pad with unused ids
        if filler not in chosen:
            chosen.append(filler)
        filler += 1
    return sorted(chosen[:size])


def token_coverage(vocab, counts: Counter) -> float:
    """The share of the tokens counted in ``counts`` that ``vocab`` holds."""
    vocab = set(vocab)
    total = sum(counts.values())
    return sum(n for t, n in counts.items() if t in vocab) / total if total else 0.0


def special_token_ids(generation_config) -> list[int]:
    """The EOS, BOS and pad ids of a generation config (each may be a list or unset)."""
    ids = []
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(generation_config, key, None)
        ids += value if isinstance(value, list) else ([value] if value is not None else [])
    return ids


def frequent_tokens(sequences: list[dict], size: int, always: list[int] = ()) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent response tokens (plus ``always``, e.g. EOS), and the fraction of response
    tokens they cover."""
    counts = response_token_counts(sequences)
    chosen = top_tokens(counts, size, always)
    return torch.tensor(chosen), token_coverage(chosen, counts)


__all__ = ["frequent_tokens", "response_token_counts", "special_token_ids", "token_coverage", "top_tokens"]
