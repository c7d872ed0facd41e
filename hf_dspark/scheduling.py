"""Verification-length policies: how many of a round's draft tokens the target verifies.

A policy sees the drafter's per-position confidences ``c_k`` (the probability that draft token k is accepted given
that tokens 1..k-1 were) and returns a length ``l`` in ``[0, max_drafts]``. To stay lossless under sampling a policy
must be *non-anticipating*: whether token k is admitted may depend only on information available before ``x_k`` was
sampled. ``c_k`` is computed from ``h_k`` and ``x_{k-1}`` only, so a left-to-right rule over the c's qualifies
(fixed length, first-below-threshold cut, Algorithm 1 with its early stop); a search that looks at all positions and
goes back (no early stop) does not.

This file is self-contained (torch only): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

from typing import Any

import torch

VERIFICATION_POLICIES: dict[str, type["VerificationPolicy"]] = {}


def register_verification_policy(name: str):
    """Class decorator: make a policy selectable as ``drafter.generation_config.verification_policy = name``."""

    def decorator(cls: type["VerificationPolicy"]) -> type["VerificationPolicy"]:
        VERIFICATION_POLICIES[name] = cls
        cls.name = name
        return cls

    return decorator


class VerificationPolicy:
    """Interface. Subclasses implement ``num_to_verify`` and may read their settings from the drafter's
    ``generation_config`` in ``from_generation_config``."""

    name = "base"
    needs_confidences = False

    @classmethod
    def from_generation_config(cls, generation_config: Any, block_size: int) -> "VerificationPolicy":
        return cls()

    def num_to_verify(self, confidences: torch.Tensor | None, max_drafts: int) -> int:
        """Number of leading draft tokens to verify.

        Args:
            confidences: [g] conditional acceptance confidences ``c_1..c_g`` of this round (None when the drafter
                has no confidence head).
            max_drafts: hard cap (block size, remaining length budget).
        """
        raise NotImplementedError

    def observe(self, verified: int, accepted: int) -> None:
        """Feedback after verification (for adaptive policies); the default ignores it."""


@register_verification_policy("fixed")
class FixedLengthPolicy(VerificationPolicy):
    """Verify a fixed number of drafts (default: the whole block)."""

    def __init__(self, num_tokens: int | None = None):
        if num_tokens is not None and num_tokens < 0:
            raise ValueError(f"num_verify_tokens must be >= 0, got {num_tokens}")
        self.num_tokens = num_tokens

    @classmethod
    def from_generation_config(cls, generation_config, block_size):
        return cls(getattr(generation_config, "num_verify_tokens", None))

    def num_to_verify(self, confidences, max_drafts):
        return max_drafts if self.num_tokens is None else min(self.num_tokens, max_drafts)


@register_verification_policy("threshold")
class ConfidenceThresholdPolicy(VerificationPolicy):
    """Static confidence threshold: verify drafts up to (not including) the first position with ``c_k < t``."""

    needs_confidences = True

    def __init__(self, threshold: float = 0.5):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    @classmethod
    def from_generation_config(cls, generation_config, block_size):
        threshold = getattr(generation_config, "confidence_threshold", None)
        return cls(0.5 if threshold is None else float(threshold))

    def num_to_verify(self, confidences, max_drafts):
        return threshold_length(confidences[:max_drafts], self.threshold)


def threshold_length(confidences: torch.Tensor, threshold: float) -> int:
    """Leading positions before the first ``c_k < threshold`` ([g] -> int)."""
    below = (confidences < threshold).nonzero()
    return int(below[0, 0]) if below.numel() else int(confidences.shape[-1])


def policy_from_generation_config(generation_config: Any, block_size: int, has_confidence_head: bool) -> VerificationPolicy:
    """Build the policy named by ``generation_config.verification_policy`` (default ``"fixed"``)."""
    name = getattr(generation_config, "verification_policy", None) or "fixed"
    if isinstance(name, VerificationPolicy):
        policy = name
    elif name in VERIFICATION_POLICIES:
        policy = VERIFICATION_POLICIES[name].from_generation_config(generation_config, block_size)
    else:
        raise ValueError(f"unknown verification_policy {name!r}; registered: {sorted(VERIFICATION_POLICIES)}")
    if policy.needs_confidences and not has_confidence_head:
        raise ValueError(
            f"verification_policy {policy.name!r} needs confidences but this drafter has no confidence head "
            "(enable_confidence_head=False); use verification_policy='fixed'"
        )
    return policy


__all__ = [
    "ConfidenceThresholdPolicy",
    "FixedLengthPolicy",
    "VERIFICATION_POLICIES",
    "VerificationPolicy",
    "policy_from_generation_config",
    "register_verification_policy",
    "threshold_length",
]
