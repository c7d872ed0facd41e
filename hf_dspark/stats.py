"""Per-round statistics: ``DSparkStats`` (one ``generate`` call's rounds, ``drafter.last_stats``, and each engine
request's), ``DSparkRound`` (one round as a ``round_callback`` sees it), and ``totals_by_source``, the per-source
sums it and the evaluation's rollouts report.

This file is self-contained (torch + its sibling ``clock``): exported drafter folders carry it in ``custom_generate/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying its siblings next to this file
    from .clock import seconds_between
except ImportError:  # pragma: no cover - loaded as a top-level module
    from clock import seconds_between  # type: ignore[no-redef]


def totals_by_source(sources: list[str], **per_round: list[int]) -> dict[str, dict[str, int]]:
    """Rounds and the sum of each per-round count (``drafted=[...]``, ``verified=[...]``, ...) per draft source."""
    out: dict[str, dict[str, int]] = {}
    for i, source in enumerate(sources):
        row = out.setdefault(source, {"rounds": 0, **{name: 0 for name in per_round}})
        row["rounds"] += 1
        for name, counts in per_round.items():
            row[name] += counts[i]
    return out


@dataclass
class DSparkRound:
    """One verification round as seen live by ``drafter.round_callback`` (optional, for observers such as the demo).

    Set ``drafter.round_callback = fn`` before ``generate``; ``fn(round)`` then runs after each round's verification,
    in the generating thread. It only observes: drafting and verification are the same with or without it.
    """

    index: int
    draft_ids: list[int]  # the whole drafted block; [] when nothing fit in the length budget
    verified: int  # leading drafts the target verified (the policy's choice)
    accepted: int  # leading verified drafts the target accepted
    emitted_ids: list[int]  # tokens the round appended: the accepted drafts, then the target's own token
    confidences: list[float] | None  # c_1..c_g of the block (None: no confidence head, or nothing drafted)
    source: str = "block"  # "block" (the drafter), "tree" (its token tree), "lookup" (prompt lookup) or "none"
    # a token-tree round's tree: {"tokens": [...], "parents": [...] (-1: the anchor), "path": [...] (accepted nodes)}
    tree: dict | None = None


def stats_lists(confidences: torch.Tensor | None, logits: torch.Tensor | None) -> tuple[list | None, list | None]:
    """A block's calibrated confidences [g] and raw confidence logits [1, g] as Python lists for the round's stats,
    read back in one transfer."""
    if confidences is None or logits is None:
        return (None if confidences is None else confidences.tolist(),
                None if logits is None else logits[0].tolist())
    listed, raw = torch.stack([confidences.float(), logits[0].float()]).tolist()  # float32 holds either exactly
    return listed, raw


@dataclass
class DSparkStats:
    """Per-round statistics of one ``generate`` call (``drafter.last_stats``).

    A round is one target forward after the prefill: it verifies ``verified[i]`` of ``drafted[i]`` draft tokens and
    accepts ``accepted[i]`` of them, then emits one more token from the target (the bonus or the correction).
    ``sources[i]`` says where its drafts came from: ``"block"`` (the drafter), ``"lookup"`` (prompt lookup) or
    ``"none"`` (the target decoded alone).

    ``time_split()`` divides the rounds' wall time into drafting (everything the candidate generator does to propose:
    lookup search, policy, drafter forward), verification (the target's forward and transformers' acceptance) and
    bookkeeping (the assisted loop between a verdict and the next round: cache crop, stopping criteria, streamer).
    On CUDA the stamps are CUDA events, read once when the split is asked for, so timing adds no sync to a round.
    """

    block_size: int
    drafted: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    confidence_logits: list[list[float]] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    # Per round: [drafting start, drafting end, verdict, next round start or None] (floats, or CUDA events).
    stamps: list[list[Any]] = field(default_factory=list, repr=False)

    def add_round(self, drafted: int, verified: int, accepted: int, confidences: list[float] | None = None,
                  confidence_logits: list[float] | None = None, source: str | None = None) -> None:
        self.drafted.append(drafted)
        self.verified.append(verified)
        self.accepted.append(accepted)
        self.confidences.append(confidences or [])
        self.confidence_logits.append(confidence_logits or [])
        self.sources.append(source or ("block" if drafted else "none"))

    def by_source(self) -> dict[str, dict[str, int]]:
        """Rounds, drafted, verified and accepted draft tokens per draft source."""
        return totals_by_source(self.sources, drafted=self.drafted, verified=self.verified, accepted=self.accepted)

    def add_stamps(self, started: Any, drafted: Any, verified: Any) -> None:
        """The clock stamps of the round just recorded; the previous round's bookkeeping ends at ``started``."""
        if self.stamps and self.stamps[-1][3] is None:
            self.stamps[-1][3] = started
        self.stamps.append([started, drafted, verified, None])

    def time_split(self) -> dict[str, float]:
        """Seconds spent drafting, verifying and in the loop's bookkeeping over the rounds (the last round's
        bookkeeping, after its verdict, is outside every round and not counted)."""
        split = {"drafting_s": 0.0, "verification_s": 0.0, "bookkeeping_s": 0.0}
        if not self.stamps:
            return split
        if not isinstance(self.stamps[0][0], float):
            torch.cuda.synchronize()  # CUDA events: every stamp reached
        for stamp in self.stamps:
            for key, (a, b) in zip(split, zip(stamp, stamp[1:])):
                if b is not None:
                    split[key] += seconds_between(a, b)
        return split

    @property
    def rounds(self) -> int:
        return len(self.verified)

    @property
    def accepted_length(self) -> float:
        """tau: tokens emitted per round, accepted drafts plus the target's own token (the paper's definition)."""
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens."""
        verified = sum(self.verified)
        return sum(self.accepted) / verified if verified else 0.0

    def position_acceptance(self) -> list[float | None]:
        """Conditional acceptance per block position k = 1..g: P(token k accepted | tokens 1..k-1 accepted and k
        verified). None where no round reached that position."""
        rates: list[float | None] = []
        for k in range(1, self.block_size + 1):
            reached = sum(1 for v, a in zip(self.verified, self.accepted) if v >= k and a >= k - 1)
            hit = sum(1 for v, a in zip(self.verified, self.accepted) if v >= k and a >= k)
            rates.append(hit / reached if reached else None)
        return rates

    def to_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "rounds": self.rounds,
            "drafted": list(self.drafted),
            "verified": list(self.verified),
            "accepted": list(self.accepted),
            "confidences": [list(c) for c in self.confidences],
            "confidence_logits": [list(c) for c in self.confidence_logits],
            "sources": list(self.sources),
            "by_source": self.by_source(),
            "accepted_length": self.accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "position_acceptance": self.position_acceptance(),
            "time_split": self.time_split(),
        }

    def __repr__(self) -> str:
        return (
            f"DSparkStats(rounds={self.rounds}, accepted_length={self.accepted_length:.3f}, "
            f"verified={sum(self.verified)}, accepted={sum(self.accepted)})"
        )


__all__ = ["DSparkRound", "DSparkStats", "stats_lists", "totals_by_source"]
