"""Verification-length policies: how many of a round's draft tokens the target verifies.

A policy sees the drafter's per-position confidences ``c_k`` (the probability that draft token k is accepted given
that tokens 1..k-1 were) and returns a length ``l`` in ``[0, max_drafts]``. To stay lossless under sampling a policy
must be *non-anticipating*: whether token k is admitted may depend only on information available before ``x_k`` was
sampled. ``c_k`` is computed from ``h_k`` and ``x_{k-1}`` only, so a left-to-right rule over the c's qualifies
(fixed length, first-below-threshold cut, Algorithm 1 with its early stop); a search that looks at all positions and
goes back (no early stop) does not.

A policy's rule gives lengths for R rows at once (``verify_lengths``); ``hf_dspark.planner.Planner`` applies it (and,
for a policy priced by SPS, Algorithm 1 with its skip and pay-off rules) for ``generate()``'s one row and the batched
engine's rows alike, and its name (``register_verification_policy``) selects it in both (``verification_policy`` in the
drafter's generation config, ``DSparkEngine(policy=)``, ``bench --policies``, ``bench-serve --policies``).

This file is self-contained (torch + its siblings ``budget``, ``clock``, ``draft_sources`` and ``gate``): exported drafter folders carry it in
``custom_generate/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # inside the hf_dspark package, or a custom_generate/ folder carrying the siblings next to this file
    from .budget import (
        SCHEDULES,
        StepsPerSecond,
        capped_confidences,
        dynamic_topk_capacity,
        prefix_schedule,
        schedule_batch,
        topk_schedule,
        use_schedule_kernels,
        width_schedule,
    )
    from .clock import EMA_WEIGHT, ema
    from .draft_sources import LookupSurvival, check_lookup_ngram, registrar
    from .gate import EXPLORE_BUDGET, RealizedGate
except ImportError:  # pragma: no cover - loaded as a top-level module
    from budget import (  # type: ignore[no-redef]
        SCHEDULES,
        StepsPerSecond,
        capped_confidences,
        dynamic_topk_capacity,
        prefix_schedule,
        schedule_batch,
        topk_schedule,
        use_schedule_kernels,
        width_schedule,
    )
    from clock import EMA_WEIGHT, ema  # type: ignore[no-redef]
    from draft_sources import LookupSurvival, check_lookup_ngram, registrar  # type: ignore[no-redef]
    from gate import EXPLORE_BUDGET, RealizedGate  # type: ignore[no-redef]

VERIFICATION_POLICIES: dict[str, type["VerificationPolicy"]] = {}
# Class decorator: make a policy selectable as ``drafter.generation_config.verification_policy = name``.
register_verification_policy = registrar(VERIFICATION_POLICIES)


class VerificationPolicy:
    """Interface. A policy implements ``verify_lengths`` (R rows at once) or, for a rule that looks at one row at a
    time, ``num_to_verify``; each is the other's default. Settings come from the drafter's ``generation_config``
    (``from_generation_config``)."""

    name = "base"
    needs_confidences = False
    needs_sps = False  # prices verification by the SPS profile: the engine shares its verification budget by it
    uses_realized_gate = False  # True: the planner asks a shared ``RealizedGate`` before drafting
    max_verify: int | None = None  # the most drafts a round verifies, whatever the rule says (None: no cap)
    draft_sources: tuple[str, ...] = ()  # sources (``draft_sources.DRAFT_SOURCES``) it prices against the block

    @classmethod
    def from_generation_config(cls, generation_config: Any, block_size: int) -> "VerificationPolicy":
        return cls()

    def verify_lengths(self, confidences: torch.Tensor | None, caps: torch.Tensor) -> torch.Tensor:
        """Leading draft tokens each row verifies ([R] long, row r within ``[0, caps[r]]``).

        Args:
            confidences: [R, g] conditional acceptance confidences ``c_1..c_g`` of this round's drafts (None when the
                drafter has no confidence head, or the policy decides before drafting).
            caps: [R] hard caps (the drafts available, the remaining length budget).
        """
        lengths = [self.num_to_verify(None if confidences is None else confidences[r], int(cap))
                   for r, cap in enumerate(caps.tolist())]
        return torch.tensor(lengths, dtype=torch.long, device=caps.device)

    def num_to_verify(self, confidences: torch.Tensor | None, max_drafts: int) -> int:
        """``verify_lengths`` for one row: ``confidences`` [g] (or None), ``max_drafts`` its cap."""
        rows = None if confidences is None else confidences.view(1, -1)
        return int(self.verify_lengths(rows, torch.tensor([max_drafts]))[0])

    def set_context(self, context_length: int) -> None:
        """The number of tokens the sequence holds before this round (called before every decision): policies that
        price rounds by the SPS profile read it at this context; the default ignores it."""


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

    def verify_lengths(self, confidences, caps):
        return torch.minimum(threshold_lengths(confidences, self.threshold).to(caps.device), caps.long())


def threshold_lengths(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Leading positions before each row's first ``c_k < threshold`` ([R, g] -> [R])."""
    return (confidences >= threshold).long().cumprod(dim=-1).sum(dim=-1)


def threshold_length(confidences: torch.Tensor, threshold: float) -> int:
    """``threshold_lengths`` of one row ([g] -> int)."""
    return int(threshold_lengths(confidences.view(1, -1), threshold)[0])


# ------------------------------------------------------------------------------------------------------------------
# Hardware-aware prefix scheduling (DSpark Algorithm 1): SPS curves and the batched schedules are in ``budget``
# ------------------------------------------------------------------------------------------------------------------
class OnlineSurvivalCorrection:
    """Keeps the scheduler's expected gains honest when the prompts drift from the calibration set.

    The drafter's (STS-calibrated) prefix survivals a_k are calibrated on the calibration prompts; on other prompts
    they can be systematically high or low, and the scheduler then verifies too much or too little. The engine
    records, for every verified draft position k, the survival it was scheduled with and whether the prefix 1..k
    was accepted, and scales survivals by ``f_k = (accepted_k + m f_{k-1}) / (predicted_k + m)``: ``m``
    pseudo-observations at the previous position's factor (at ratio 1 for the first position), so a deep position
    the scheduler rarely verifies inherits the bias measured just before it instead of falling back to the drafter's
    own survival (on SmolLM2 the calibrated survivals grow more pessimistic with depth, factors rising from 1.0 to 1.9
    over positions 1-7, and a tail priced too low is never verified, so never corrected). Survivals are kept in
    [0, 1], non-increasing, and zero where they were zero. Only past outcomes are used, so the scheduling decision
    still does not depend on the drafts being verified.
    """

    def __init__(self, block_size: int, prior: float = 16.0):
        self.prior = prior
        self.predicted = torch.zeros(block_size, dtype=torch.float64)
        self.accepted = torch.zeros(block_size, dtype=torch.float64)
        self._factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (predicted, accepted, factors)

    def factors(self) -> torch.Tensor:
        """The per-position factors [g] (kept until the next ``observe``: the engine reads them a few times a step)."""
        cached = self._factors
        if cached is not None and cached[0] is self.predicted and cached[1] is self.accepted:
            return cached[2].clone()
        out, previous = [], 1.0
        for accepted, predicted in zip(self.accepted.tolist(), self.predicted.tolist()):
            previous = (accepted + self.prior * previous) / (predicted + self.prior)
            out.append(previous)
        factors = torch.tensor(out, dtype=self.predicted.dtype)
        self._factors = (self.predicted, self.accepted, factors)
        return factors.clone()

    def correct(self, confidences: torch.Tensor) -> torch.Tensor:
        """Corrected conditional confidences [R, g] (the schedulers take conditionals and form the products)."""
        survival = torch.cumprod(confidences.float().clamp(0, 1), dim=-1)
        adjusted = (survival * self.factors().to(survival)).clamp(max=1.0)
        adjusted = torch.cummin(adjusted, dim=-1).values
        previous = torch.cat([torch.ones_like(adjusted[:, :1]), adjusted[:, :-1]], dim=-1)
        return torch.where(previous > 0, adjusted / previous.clamp(min=1e-30), 0.0).clamp(0, 1)

    def observe(self, confidences: torch.Tensor, lengths: torch.Tensor, accepted: torch.Tensor) -> None:
        """Record one step: scheduled conditionals [D, g], verified lengths [D] and accepted drafts [D]."""
        survival = on_host(torch.cumprod(confidences.double().clamp(0, 1), dim=-1))
        k = torch.arange(survival.shape[1])
        verified = k < on_host(lengths)[:, None]
        # new tensors (not in place): ``factors`` keeps its result while these are the same objects
        self.predicted = self.predicted + (survival * verified).sum(dim=0)
        self.accepted = self.accepted + ((k < on_host(accepted)[:, None]) & verified).sum(dim=0)


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the CPU: a copy from an accelerator, the tensor itself when it is there already."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


# ------------------------------------------------------------------------------------------------------------------
# Whether drafting pays: the rules generate()'s scheduler and the engine's share
# ------------------------------------------------------------------------------------------------------------------
def check_probe_settings(probe_interval: int, max_probe_interval: int, confidence_smoothing: float) -> None:
    """Refuse ``ConfidenceMemory`` settings out of range: ``1 <= probe_interval <= max_probe_interval``,
    ``confidence_smoothing`` in (0, 1]. The one check of these settings (the memory, ``EngineConfig``)."""
    if probe_interval < 1:
        raise ValueError(f"probe_interval must be >= 1, got {probe_interval}")
    if max_probe_interval < probe_interval:
        raise ValueError(f"max_probe_interval ({max_probe_interval}) must be >= probe_interval ({probe_interval})")
    if not 0.0 < confidence_smoothing <= 1.0:
        raise ValueError(f"confidence_smoothing must be in (0, 1], got {confidence_smoothing}")


def check_explore_settings(explore_interval: int, max_explore_interval: int, explore_budget: float) -> None:
    """Refuse realized-gate settings out of range: ``1 <= explore_interval <= max_explore_interval``,
    ``explore_budget`` in [0, 1). The one check of these settings (``PrefixSchedulerPolicy``, ``EngineConfig``)."""
    if explore_interval < 1:
        raise ValueError(f"explore_interval must be >= 1, got {explore_interval}")
    if max_explore_interval < explore_interval:
        raise ValueError(f"max_explore_interval ({max_explore_interval}) must be >= explore_interval "
                         f"({explore_interval})")
    if not 0.0 <= explore_budget < 1.0:
        raise ValueError(f"explore_budget must be in [0, 1), got {explore_budget}")


class ConfidenceMemory:
    """What a sequence's earlier drafts predict about its next one, and when it probes.

    ``smoothed``: an exponential moving average of its drafts' confidences [g], the newest weighted by
    ``smoothing`` (1: the last draft alone); ``last``: the last draft's. A sequence whose prediction says "do not
    draft" drafts anyway once it has skipped ``wait`` rounds (a probe, refreshing the prediction); each probe that
    verifies nothing doubles the wait, up to ``max_probe_interval``, and a draft that is used resets it. The
    scheduler policy keeps one for its sequence, the batched engine one per request.
    """

    def __init__(self, probe_interval: int = 4, max_probe_interval: int = 64, smoothing: float = 0.1,
                 prior: torch.Tensor | None = None):
        check_probe_settings(probe_interval, max_probe_interval, smoothing)
        self.probe_interval, self.max_probe_interval, self.smoothing = probe_interval, max_probe_interval, smoothing
        self.smoothed = self.last = prior
        self.idle = 0  # rounds since the last draft
        self.wait = probe_interval  # idle rounds before the next probe

    @property
    def probe_due(self) -> bool:
        return self.idle >= self.wait

    def drafted(self, confidences: torch.Tensor, verified: int) -> None:
        """A round drafted with ``confidences`` [g] and verified ``verified`` of its drafts."""
        previous, w = self.smoothed, self.smoothing
        same = previous is not None and previous.shape == confidences.shape
        self.smoothed = (1.0 - w) * previous + w * confidences if same else confidences
        self.last, self.idle = confidences, 0
        self.wait = self.probe_interval if verified > 0 else min(2 * self.wait, self.max_probe_interval)

    def skipped(self) -> None:
        """A round that did not draft."""
        self.idle += 1


def expected_round(conditionals: torch.Tensor, lengths: Sequence[int], sps_table: torch.Tensor,
                   padded: bool = True) -> tuple[float, float]:
    """What verifying ``lengths`` drafts (one per row, on the host) of R rows with these conditional acceptances
    [R, g] is expected to deliver: ``(R + sum of the admitted prefix survivals, seconds of the verify forward)``, the
    forward priced at ``SPS(B)`` with B the padded batch ``R * (1 + longest)`` (or the packed ``R + sum of
    lengths``)."""
    survival = torch.cumprod(conditionals.float().clamp(0, 1), dim=-1)
    limits = torch.tensor(list(lengths), device=survival.device)
    admitted = torch.arange(survival.shape[-1], device=survival.device) < limits[:, None]
    rows = survival.shape[0]
    batch = rows * (1 + max(lengths)) if padded else rows + sum(lengths)
    return rows + float((survival * admitted).sum()), 1.0 / float(sps_table[min(batch, sps_table.shape[0] - 1)])


def drafting_pays(tokens: float, verify_seconds: float, draft_seconds: float, plain_rate: float,
                  drafting_factor: float = 1.0, plain_factor: float = 1.0) -> bool:
    """Whether a drafting round expected to deliver ``tokens`` in ``verify_seconds + draft_seconds`` beats plain
    decoding's ``plain_rate`` tokens per second, each side scaled by what its recent rounds delivered against this
    prediction (the engine's ``EngineMeasurements.model_factor``; 1 in ``generate()``)."""
    return tokens / (verify_seconds + draft_seconds) * drafting_factor > plain_rate * plain_factor


# Tokens per step of the context at which a scheduling policy re-reads its SPS table (``set_context``): at 7k tokens of
# SmolLM2-135M on CPU a forward gains ~1% of its time per 128 tokens.
CONTEXT_BUCKET = 128


@register_verification_policy("scheduler")
class PrefixSchedulerPolicy(VerificationPolicy):
    """Algorithm 1: verify the prefix length l maximising ``(1 + sum_{j<=l} a_j) * SPS(1 + l)`` found by greedy
    admission with early stop (R rows: the batched budget, ``schedule_batch``). Needs an SPS profile
    (``generation_config.sps_profile``, or profiled automatically for the target when hf_dspark is installed).

    The policy holds the rule's settings and the SPS curve at the sequence's context; ``hf_dspark.planner.Planner``
    applies them round by round (the survival correction, the skip and pay-off rules, the realized gate), for
    ``generate()``'s one row and the engine's R alike."""

    needs_confidences = True
    needs_sps = True

    def __init__(self, sps: StepsPerSecond | None = None, online_correction: bool = True, skip_drafting: bool = True,
                 probe_interval: int = 4, max_probe_interval: int = 64, confidence_smoothing: float = 0.1,
                 realized_gate: bool = False, explore_interval: int = 16, max_explore_interval: int = 256,
                 explore_budget: float = EXPLORE_BUDGET):
        """``online_correction``: rescale survivals by the acceptance observed so far (``OnlineSurvivalCorrection``).
        ``skip_drafting``: do not draft when the confidences of the drafts so far predict a zero length, or a gain
        that does not pay for the drafter's measured time; probe again after ``probe_interval`` skipped rounds (the
        wait doubles after each probe that verified nothing, up to ``max_probe_interval``).
        ``confidence_smoothing``: that prediction uses an exponential moving average of the drafts' confidences,
        the newest weighted by this (1: the last draft alone). One draft's confidences are a noisy guess of the
        next round's; on the SmolLM2 rollouts a slow average (0.1) skips less where drafting pays (math) and about
        as much where it does not (chat).
        ``realized_gate`` (opt-in, with ``skip_drafting``): a round the confidences would draft still decodes plain
        while the drafting rounds have not delivered ``DRAFTING_MARGIN`` (3%) more tokens per second than the plain
        rounds (``RealizedGate`` at one request, fed by the candidate generator); drafting is re-measured after
        ``explore_interval`` rounds, the wait doubling up to ``max_explore_interval`` while it keeps losing, and
        lasting until the re-measurement's expected loss is at most ``explore_budget`` of the plain rounds' time
        since (``RealizedGate.drafting_allowed``). The cost model prices the drafter and the verify forward; the gate
        also catches what it misprices (the context catch-up, the assisted loop's bookkeeping, confidences that
        promise more than the drafts deliver on this kind of text). The gate is shared by every ``generate()`` call
        with the same drafter and target, so short answers do not each pay to learn it again. It is off by default:
        on SmolLM2-135M (float32, 1 thread, 3 prompts x 256 tokens per eval set) it delivered 0.96x plain against
        the ungated scheduler's 1.00x in the same run (``hf-dspark bench --policies scheduler scheduler=gated``):
        one sequence gives it too few drafting rounds per verdict, and what it blocks includes the rounds that would
        have won."""
        check_probe_settings(probe_interval, max_probe_interval, confidence_smoothing)
        check_explore_settings(explore_interval, max_explore_interval, explore_budget)
        self.online_correction = online_correction
        self.skip_drafting = skip_drafting
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.confidence_smoothing = confidence_smoothing
        self.realized_gate = realized_gate
        self.explore_interval, self.max_explore_interval = explore_interval, max_explore_interval
        self.explore_budget = explore_budget
        self.sps: StepsPerSecond | None = None
        self.table: torch.Tensor | None = None  # SPS(B) at the sequence's context (``set_context``)
        self._context_bucket: int | None = None  # the context bucket ``table`` was read at
        if sps is not None:
            self.set_sps(sps)

    @classmethod
    def from_generation_config(cls, generation_config, block_size):
        return cls(**cls.generation_settings(generation_config))

    @classmethod
    def generation_settings(cls, generation_config: Any) -> dict[str, Any]:
        """The constructor's arguments from ``generation_config`` (unset: the defaults). ``sps_profile`` is a
        profile's dict, or a ``StepsPerSecond`` itself."""
        profile = getattr(generation_config, "sps_profile", None)
        sps = profile if isinstance(profile, StepsPerSecond) else StepsPerSecond.from_dict(profile) if profile else None
        return dict(sps=sps,
                    online_correction=bool(getattr(generation_config, "online_correction", True)),
                    skip_drafting=bool(getattr(generation_config, "skip_drafting", True)),
                    confidence_smoothing=float(getattr(generation_config, "confidence_smoothing", None) or 0.1),
                    realized_gate=bool(getattr(generation_config, "realized_gate", None)),
                    explore_interval=int(getattr(generation_config, "explore_interval", None) or 16),
                    max_explore_interval=int(getattr(generation_config, "max_explore_interval", None) or 256),
                    explore_budget=_explore_budget(generation_config))

    @property
    def memory_settings(self) -> tuple[int, int, float]:
        """The (probe_interval, max_probe_interval, smoothing) of a sequence's ``ConfidenceMemory``."""
        return self.probe_interval, self.max_probe_interval, self.confidence_smoothing

    @property
    def explore_settings(self) -> tuple[int, int, float]:
        """The realized gate's (explore_interval, max_explore_interval, explore_budget)."""
        return self.explore_interval, self.max_explore_interval, self.explore_budget

    def set_sps(self, sps: StepsPerSecond) -> None:
        self.sps, self.table = sps, sps.table()
        self._context_bucket = None

    def set_context(self, context_length: int) -> None:
        """Price rounds at this context: the SPS table is re-read from the profile's context model whenever the
        context enters another ``CONTEXT_BUCKET`` (a profile without one reads the same everywhere)."""
        if self.sps is None or not self.sps.models_context:
            return
        bucket = int(context_length) // CONTEXT_BUCKET
        if bucket == self._context_bucket:
            return
        self._context_bucket = bucket
        self.table = self.sps.at_context(bucket * CONTEXT_BUCKET + CONTEXT_BUCKET // 2).table()

    def sps_table(self) -> torch.Tensor:
        """SPS(B) at the sequence's context; an error naming the missing profile where there is none."""
        if self.table is None:
            raise ValueError(f"the {self.name} policy needs an SPS profile (generation_config.sps_profile)")
        return self.table

    @property
    def uses_realized_gate(self) -> bool:
        return self.skip_drafting and self.realized_gate

    def verify_lengths(self, confidences, caps):
        """Algorithm 1 over ``confidences`` [R, g] as they are (no correction, no skip rule: the planner adds
        those), the rows sharing one budget."""
        if confidences is None:
            raise ValueError(f"the {self.name} policy needs the drafts' confidences")
        return schedule_batch(confidences.float(), caps, self.sps_table(), "prefix").to(caps.device)


# The longest prompt-lookup draft the hybrid policy considers (``generation_config.lookup_max_tokens``): a lookup
# draft costs nothing to propose, and where verification width is nearly free (a host-bound GPU, AMX bf16) long copies
# pay; the cost model picks each round's length from the lookup's survival and the SPS profile, which covers it.
LOOKUP_MAX_TOKENS = 16


def check_lookup_settings(max_ngram: int, max_lookup_tokens: int) -> None:
    """Refuse the hybrid policy's prompt-lookup settings out of range: ``lookup_max_ngram`` (``check_lookup_ngram``)
    and ``lookup_max_tokens``, each at least 1."""
    check_lookup_ngram(max_ngram)
    if max_lookup_tokens < 1:
        raise ValueError(f"lookup_max_tokens must be >= 1, got {max_lookup_tokens}")


def lookup_max_tokens(generation_config: Any) -> int:
    """``generation_config.lookup_max_tokens``, ``LOOKUP_MAX_TOKENS`` when unset (a value given, 0 included, is
    kept for the policy to check)."""
    value = getattr(generation_config, "lookup_max_tokens", None)
    return LOOKUP_MAX_TOKENS if value is None else int(value)


@register_verification_policy("hybrid")
class HybridPolicy(PrefixSchedulerPolicy):
    """Several draft sources under one cost model: the drafter's block and the sources named in ``draft_sources``
    (by default the prompt lookup: the continuation of the latest earlier occurrence of the sequence's last tokens,
    free to propose; ``draft_sources.DRAFT_SOURCES``).

    Each round the planner prices every source's offer from its own confidences (the lookup's ``LookupSurvival``)
    as Algorithm 1 prices the block's, by expected tokens per second ``(1 + sum_j a_j) * SPS(1 + l)``; at one row
    the block is priced from its smoothed past confidences and the drafter's measured time (as the skip rule does);
    plain decoding at ``SPS(1)``. The best source drafts: a round an offer wins skips the drafter's forward (its
    context is still extended with the new target features, so the next block sees the whole sequence). Where
    nothing predicts the block yet, or a probe of it is due, a paying offer still goes first: the block is probed on
    a round without one.

    Lossless for greedy decoding and sampling: an offer's drafts are deterministic, so the target gets a one-hot q
    for them, and the choice of source and length uses only earlier rounds and the sequence's own tokens, never the
    target's verdict on the drafts being verified.
    """

    draft_sources = ("lookup",)

    def __init__(self, *args, max_ngram: int = 4, max_lookup_tokens: int = LOOKUP_MAX_TOKENS, **kwargs):
        super().__init__(*args, **kwargs)
        check_lookup_settings(max_ngram, max_lookup_tokens)
        self.max_ngram = max_ngram
        self.max_lookup_tokens = max_lookup_tokens
        self.lookup: LookupSurvival | None = None

    @classmethod
    def generation_settings(cls, generation_config):
        # Unset (None) takes the default; any value given, 0 included, is checked.
        ngram = getattr(generation_config, "lookup_max_ngram", None)
        return {**super().generation_settings(generation_config), "max_ngram": 4 if ngram is None else int(ngram),
                "max_lookup_tokens": lookup_max_tokens(generation_config)}

    def set_lookup_survival(self, survival: LookupSurvival) -> None:
        """The estimator this policy prices lookup drafts with (shared across calls, like the realized gate)."""
        self.lookup = survival


def _explore_budget(generation_config: Any) -> float:
    """``generation_config.explore_budget`` (unset or None: ``EXPLORE_BUDGET``; 0 is kept: no budget)."""
    value = getattr(generation_config, "explore_budget", None)
    return EXPLORE_BUDGET if value is None else float(value)


class _OverriddenSettings:
    """``generation_config``'s attributes, with ``overrides`` in place of those of the same name (None: only the
    overrides are set)."""

    def __init__(self, generation_config: Any, overrides: dict[str, Any]):
        self._generation_config, self._overrides = generation_config, overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._generation_config, name)


def build_policy(name: str, generation_config: Any, block_size: int, **overrides: Any) -> VerificationPolicy:
    """The registered verification policy ``name``, built the one way every entry point builds it: its class's
    ``from_generation_config`` reading ``generation_config`` (None: every setting at its default), where each of
    ``overrides`` (a generation-config setting's name, e.g. ``num_verify_tokens=2``, ``sps_profile=sps``) replaces the
    value ``generation_config`` has. ``generate()``, the engine (``engine.config.engine_policy``) and the demo call
    it."""
    if name not in VERIFICATION_POLICIES:
        raise ValueError(f"unknown verification_policy {name!r}; registered: {sorted(VERIFICATION_POLICIES)}")
    settings = _OverriddenSettings(generation_config, overrides) if overrides else generation_config
    return VERIFICATION_POLICIES[name].from_generation_config(settings, block_size)


def policy_from_generation_config(generation_config: Any, block_size: int, has_confidence_head: bool) -> VerificationPolicy:
    """Build the policy named by ``generation_config.verification_policy`` (default ``"fixed"``)."""
    name = getattr(generation_config, "verification_policy", None) or "fixed"
    policy = name if isinstance(name, VerificationPolicy) else build_policy(name, generation_config, block_size)
    if policy.needs_confidences and not has_confidence_head:
        raise ValueError(
            f"verification_policy {policy.name!r} needs confidences but this drafter has no confidence head "
            "(enable_confidence_head=False); use verification_policy='fixed'"
        )
    return policy


__all__ = [
    "on_host",
    "ConfidenceMemory",
    "ConfidenceThresholdPolicy",
    "build_policy",
    "check_explore_settings",
    "check_lookup_settings",
    "check_probe_settings",
    "EMA_WEIGHT",
    "HybridPolicy",
    "LookupSurvival",
    "LOOKUP_MAX_TOKENS",
    "lookup_max_tokens",
    "PrefixSchedulerPolicy",
    "RealizedGate",
    "StepsPerSecond",
    "drafting_pays",
    "ema",
    "dynamic_topk_capacity",
    "expected_round",
    "prefix_schedule",
    "topk_schedule",
    "FixedLengthPolicy",
    "VERIFICATION_POLICIES",
    "VerificationPolicy",
    "policy_from_generation_config",
    "register_verification_policy",
    "threshold_length",
    "threshold_lengths",
]
