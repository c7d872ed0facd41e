"""The engine's settings (``EngineConfig``) and the verification policy its ``policy`` names."""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..draft_sources import LookupSurvival, check_lookup_ngram
from ..gate import EXPLORE_BUDGET
from ..policy_names import DEFAULT_POLICY, DEPRECATED_POLICIES, PLAIN, current_policy
from ..scheduling import (
    VERIFICATION_POLICIES,
    VerificationPolicy,
    build_policy,
    check_explore_settings,
    check_probe_settings,
)
from .admission import ADMISSION_HOLD, PrefillCost
from .measurements import EngineMeasurements
from ..scheduling import SCHEDULES
from ..token_tree import DRAFT_TREES, draft_tree_mode

# The engine's exploration budget (``EngineConfig.explore_budget``) and the longest wait between re-measurements of
# a losing drafting side (``max_explore_interval``). In a batch a re-measurement costs several times the shortfall of
# its own drafting steps (what ``RealizedGate.remeasure_loss`` prices): its extra tokens make requests finish apart
# (idle held slots, extra prefill forwards), which its steps do not show. Hence a fifth of single-sequence
# generation's budget, and a cap long enough that the budget, not the cap, times the re-measurements.
ENGINE_EXPLORE_BUDGET = EXPLORE_BUDGET / 5
ENGINE_MAX_EXPLORE_INTERVAL = 4096
GATE_TOKENS = ("progress", "emitted")  # what the realized gate counts as a step's output (``gate_tokens``)


@dataclass
class EngineConfig:
    """Settings of a ``DSparkEngine``.

    Args:
        policy: ``"plain"`` (no drafting: one token per request per step, the baseline) or the name of a
            registered verification policy (``scheduling.register_verification_policy``), the same names
            ``generate()`` takes: ``"fixed"`` (every request verifies ``num_verify_tokens`` drafts, default the
            whole block), ``"threshold"``, ``"scheduler"`` (a shared budget per step from the drafter's confidences
            and the SPS curve) or ``"hybrid"`` (the scheduler, and each request whose prompt lookup pays at this
            batch size verifies the lookup's drafts instead of the drafter's block). Default (or None):
            ``policy_names.DEFAULT_POLICY``, ``"hybrid"``, the default of every entry point; an engine built without
            a drafter runs the default as ``"plain"``. The old name ``"scheduled"`` still means ``"scheduler"``,
            with a ``FutureWarning``.
        method: the deprecated name of ``policy``: ``EngineConfig(method=...)`` sets ``policy`` with a
            ``FutureWarning`` (``ValueError`` where ``policy`` is given too, and differs); ``config.method`` reads
            ``policy``.
        num_verify_tokens: the drafts ``"fixed"`` verifies (default: the whole block). Where the drafter's
            ``generation_config.num_verify_tokens`` says otherwise, this one is used, with a warning.
    schedule: ``"padded"`` (the default: Algorithm 1 by width layers, for the padded batch this engine runs, whose
        cost is R * (1 + longest verification) tokens), ``"prefix"`` (Algorithm 1 over single entries, costed as
        if the batch were packed: R + sum of lengths) or ``"topk"`` (dynamic top-K: the capacity comes from the
        requests' previous confidences, the current step admits the top-K entries).
    sps: ``hf_dspark.profiling.BatchedStepsPerSecond`` or a ``StepsPerSecond`` used for every batch size; None
        profiles the target once (cached) at batch sizes 1, 2, 4, .. up to ``max_concurrency`` (default 64).
    max_concurrency: most requests in the batch at once; more wait and join as others finish.
    probe_interval: under the scheduler a request whose previous confidences predict a zero budget skips
        drafting, but drafts again after this many skipped steps to refresh its confidences; each probe that
        ends with nothing verified doubles the wait, up to ``max_probe_interval``.
    cost_aware: under the scheduler, skip drafting in a step when the drafts its requests' previous confidences
        predict would not pay for the drafter's forward (measured as the engine runs): the expected
        ``(R + sum a) / (1 / SPS(B) + t_draft)`` must beat plain decoding's ``R * SPS(R)``, each scaled by what the
        steps this model decided delivered against its prediction for them (``EngineMeasurements.model_factor``).
    realized_gate: under the scheduler with ``cost_aware``, also judge drafting by what it has actually delivered:
        per batch size R, tokens per second (counted as ``gate_tokens`` says) over recent whole steps (drafter,
        context catch-up, verification, bookkeeping) are kept for steps where some request drafted (a block, or
        a free source's offer under the hybrid) and steps where none did; while the gate rules drafting out, offers
        wait too. Once both are measured at R and drafting steps have not been ``DRAFTING_MARGIN`` (3%) faster (the
        last 4 plain steps against the drafting steps since the first of them, ``RealizedGate.compared_rates``:
        the two sides from the same stretch of a machine whose speed drifts), R decodes plain, drafting again
        after ``explore_interval`` steps to re-measure (the wait doubling, up to ``max_explore_interval``, each
        time drafting is still the slower; back to ``explore_interval`` once it wins). A re-measurement drafts
        ``REMEASURE_ROUNDS`` steps and is judged on those alone, not on the steps of the stretch that lost. Once
        drafting has been measured twice at R and plain not yet twice, the next steps decode plain to measure that
        side (a plain step costs nothing next to plain decoding). A batch size not yet measured takes the verdict
        of the nearest smaller one measured on both sides (a load rising past sizes where drafting lost does not
        draft at every new size to find out), and a loss at the nearest larger one up to twice its size (nor does
        a draining batch on its way down). This catches every cost the model in ``cost_aware`` leaves out or
        misprices. The decision uses past steps' timings only, so
        it is lossless.
    explore_interval, max_explore_interval: steps between re-measurements for ``realized_gate`` (defaults 16 and
        ``ENGINE_MAX_EXPLORE_INTERVAL``, 4096).
    explore_budget: ``realized_gate`` re-measures a losing drafting side only once its expected loss (two drafting
        steps at the measured shortfall, plus the context catch-up of the rows that would draft, at the measured
        seconds per pending position: ``EngineMeasurements.catch_up``) is at most this fraction of the plain
        steps' time since drafting last ran at that batch size, or after ``max_explore_interval`` steps
        (``RealizedGate.drafting_allowed``; 0: the doubling wait alone). Drafting that lost narrowly is
        re-measured soon, drafting that lost by 45% (SmolLM2 at 64 requests) rarely. Default
        ``ENGINE_EXPLORE_BUDGET`` (0.001, a fifth of single-sequence generation's: in a batch a re-measurement also
        desynchronises the requests, which its steps do not show).
    online_correction: under the scheduler, rescale the drafter's survivals by how often verified prefixes were
        actually accepted so far in this engine (``OnlineSurvivalCorrection``), for prompts unlike the
        calibration set.
    adapt_sps: under the scheduler, reprice the profile by the measured verify times: the profile's shape at the
        engine's measured level, each width run at the current batch size pulled toward its own measured time by
        how many times it was timed (``VerifyPricing.sps_table``) (default: True when the engine profiles the
        target itself, ``sps=None``; an SPS passed in is used as given unless this is True).
    confidence_prior: under the scheduler, a joining request starts from the mean confidences of every draft so
        far (when there are any; kept in ``measurements``, so an engine sharing them starts from what earlier
        engines drafted) instead of drafting at once: it drafts when those predict a budget (and the cost gate
        agrees), else it first probes after ``probe_interval`` steps. Short requests do not pay a drafter
        forward each just to learn what the others already show.
    confidence_smoothing: under the scheduler, a request's skip decisions use a moving average of its drafts'
        confidences (starting from the prior when there is one), the newest weighted by this; 1 uses its last
        draft alone (see ``PrefixSchedulerPolicy``).
    max_prefill_tokens: joining requests are prefilled together in right-padded batches of at most this many
        (padded) tokens.
    prefill_cost: a ``PrefillCost``, the price model that splits joining requests (sorted by prompt length)
        into prefill forwards: fewer forwards against less padding. Default: the one fitted on this project's
        CPU (``scripts/engine_prefill_batching.py --fit`` fits another device's).
    admission_hold: with ``max_concurrency`` set and more requests waiting than there are free slots, the free
        slots wait while an active request is sure to finish (its remaining ``max_new_tokens``) within the
        steps they may still wait, so that its successor joins in the same prefill forward: at most
        ``admission_hold * max_concurrency`` idle slot-steps per admission for this generation and for each later
        full batch the queue fills, up to ``ADMISSION_HOLD_GENERATIONS`` (``admission.hold_budget``;
        ``ADMISSION_HOLD``, 1: one batch of idle slot-steps prices about one prefill forward, whose fixed price is
        about a decode step's, and requests that joined apart keep finishing apart, each later generation paying
        again).
        Requests finishing at different steps (EOS, accepted drafts) would otherwise pay one prefill forward
        each. 0 admits at once. Outputs do not depend on it; the slot-steps held are counted in
        ``stats.held_slot_steps``.
    measurements: an ``EngineMeasurements`` holding the drafter, verify and whole-step timings this engine
        prices its decisions with, and adds to. Pass the same object to several engines (or one loaded from a
        file) and each starts from what the others measured instead of paying to learn it again; it must come
        from the same target, drafter, device, dtype and thread count (else ``ValueError``). Default: a fresh one.
    gate_tokens: what ``realized_gate`` counts as a step's output: ``"progress"`` (the default,
        ``batch_progress``) the batch's rows times how much the step lowered the most new tokens any of its
        requests has left: the steps the batch as a whole saved, which is what a drafting step buys when its
        requests finish together (those joining after them are prefilled together, ``admission_hold``; or none
        are waiting): at 16 requests in step, drafts accepted by some rows and not by the one furthest from done
        only make the others wait. A plain step counts its rows either way, one request what it emitted; where
        rows are out of step it is a lower bound. ``"emitted"``: the tokens the step emitted. The count is kept
        with the measurements (``EngineMeasurements.gate_tokens``): windows counted the other way are refused.
    lookup_max_ngram: under ``"hybrid"``, the longest suffix of a request's tokens that prompt lookup matches
        (``hf_dspark.generation.prompt_lookup``). Where the drafter's ``generation_config.lookup_max_ngram`` says
        otherwise, this one is used, with a warning.
    draft_tree: token trees for greedy requests (``token_tree.DRAFT_TREES``): ``"chain"``, ``"auto"`` (a row's
        tree where the planner prices it above its chain within the step) or ``"always"``. None (the default): the
        drafter's ``generation_config.draft_tree``; where that says otherwise, this one is used, with a warning.
    seed: seeds the engine's generator (drafting, acceptance and target sampling).
    optimize_target: ``hf_dspark.optimize_target``'s mode, applied to the target (in place) when the engine is
        built: ``"auto"`` (the default: oneDNN-prepacked linears where they measure faster on this machine; a target
        already optimised is kept as it is), ``"on"``, ``"off"``; None leaves the target exactly as given (several
        engines sharing one target, as ``bench-serve`` runs them, use None and optimise it once).
    clock: the time source of each request's timestamps (arrival, start, first token, finish: its
        ``RequestOutput.tokens_per_s``). Default ``time.perf_counter``. ``bench_serve(lockstep=True)`` gives each
        of several engines stepped in turn a clock that runs only during its own steps.
    """

    policy: str | None = DEFAULT_POLICY
    num_verify_tokens: int | None = None
    schedule: str = "padded"
    sps: Any = None
    max_concurrency: int | None = None
    probe_interval: int = 4
    max_probe_interval: int = 64
    cost_aware: bool = True
    realized_gate: bool = True
    explore_interval: int = 16
    max_explore_interval: int = ENGINE_MAX_EXPLORE_INTERVAL
    explore_budget: float = ENGINE_EXPLORE_BUDGET
    online_correction: bool = True
    adapt_sps: bool | None = None
    confidence_prior: bool = True
    confidence_smoothing: float = 0.1
    max_prefill_tokens: int = 16384
    prefill_cost: PrefillCost | None = None
    admission_hold: float = ADMISSION_HOLD
    measurements: EngineMeasurements | None = None
    gate_tokens: str = "progress"
    lookup_max_ngram: int = 4
    draft_tree: str | None = None
    seed: int = 0
    optimize_target: str | None = "auto"
    clock: Callable[[], float] = time.perf_counter
    tokenizer: Any = None

    @property
    def method(self) -> str:
        """The deprecated name of ``policy``."""
        return self.policy

    def __post_init__(self):
        if self.policy is None:
            self.policy = DEFAULT_POLICY
        if self.policy in DEPRECATED_POLICIES:
            warnings.warn(f"policy {self.policy!r} is deprecated; use {current_policy(self.policy)!r}", FutureWarning,
                          stacklevel=4)
            self.policy = current_policy(self.policy)
        if self.policy != PLAIN and self.policy not in VERIFICATION_POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; expected {PLAIN!r} or a registered verification "
                             f"policy: {sorted(VERIFICATION_POLICIES)}")
        if self.optimize_target not in (None, "auto", "on", "off"):
            raise ValueError(f"optimize_target must be 'auto', 'on', 'off' or None, got {self.optimize_target!r}")
        if self.draft_tree is not None and self.draft_tree not in DRAFT_TREES:
            raise ValueError(f"unknown draft_tree {self.draft_tree!r}; expected one of {DRAFT_TREES}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_verify_tokens is not None and self.num_verify_tokens < 0:
            raise ValueError(f"num_verify_tokens must be >= 0, got {self.num_verify_tokens}")
        check_probe_settings(self.probe_interval, self.max_probe_interval, self.confidence_smoothing)
        check_explore_settings(self.explore_interval, self.max_explore_interval, self.explore_budget)
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.prefill_cost is not None and not isinstance(self.prefill_cost, PrefillCost):
            raise ValueError(f"prefill_cost must be a PrefillCost, got {type(self.prefill_cost).__name__}")
        if not math.isfinite(self.admission_hold) or self.admission_hold < 0:
            raise ValueError(f"admission_hold must be a finite number >= 0, got {self.admission_hold}")
        if self.gate_tokens not in GATE_TOKENS:
            raise ValueError(f"unknown gate_tokens {self.gate_tokens!r}; expected one of {GATE_TOKENS}")
        check_lookup_ngram(self.lookup_max_ngram)


def _accepting_method(init: Callable) -> Callable:
    """``EngineConfig.__init__`` that also takes ``method=``, the deprecated name of ``policy``. Not a field: a field
    would be one more value for ``dataclasses.replace`` to carry over, and to set against a new ``policy``."""

    @functools.wraps(init)
    def __init__(self, *args, method: str | None = None, **kwargs):
        if method is not None:
            warnings.warn("EngineConfig(method=) is deprecated; use policy=", FutureWarning, stacklevel=2)
            if kwargs.get("policy") not in (None, method):
                raise ValueError(f"policy={kwargs['policy']!r} and method={method!r} disagree: method is the "
                                 f"deprecated name of policy; pass policy alone")
            kwargs["policy"] = method
        init(self, *args, **kwargs)

    return __init__


EngineConfig.__init__ = _accepting_method(EngineConfig.__init__)


def scheduled_policy(policy: str) -> bool:
    """Whether ``policy`` (old names too) shares a step's verification budget by the SPS curve (the scheduler, the
    hybrid)."""
    return getattr(VERIFICATION_POLICIES.get(current_policy(policy)), "needs_sps", False)


def engine_policy(config: EngineConfig, drafter) -> VerificationPolicy:
    """The verification policy ``config.policy`` names, for ``drafter``: built from the drafter's generation config
    as ``generate()`` builds it, with the engine's own settings where the engine has them (``num_verify_tokens``,
    ``lookup_max_ngram``: a warning where the generation config sets another value; a lookup survival estimate of
    its own)."""
    generation_config, overrides = drafter.generation_config, {}
    if config.policy == "fixed":
        overrides["num_verify_tokens"] = _engine_setting(config, generation_config, "num_verify_tokens")
    elif VERIFICATION_POLICIES[config.policy].draft_sources:
        overrides["lookup_max_ngram"] = _engine_setting(config, generation_config, "lookup_max_ngram")
    policy = build_policy(config.policy, generation_config, drafter.config.block_size, **overrides)
    if policy.draft_sources:
        policy.set_lookup_survival(LookupSurvival(drafter.config.block_size))
    return policy


def engine_draft_tree(config: EngineConfig, drafter) -> str:
    """The engine's token-tree setting: ``config.draft_tree`` (with a warning where the drafter's generation config
    sets another), else the drafter's (``token_tree.draft_tree_mode``)."""
    if config.draft_tree is None:
        return draft_tree_mode(drafter)
    return _engine_setting(config, drafter.generation_config, "draft_tree")


def _engine_setting(config: EngineConfig, generation_config, name: str):
    """``config``'s value of the setting ``name``, with a warning where the drafter's generation config sets
    another."""
    value, drafter_value = getattr(config, name), getattr(generation_config, name, None)
    if drafter_value is not None and drafter_value != value:
        warnings.warn(f"the engine uses EngineConfig.{name}={value!r}, not the drafter's generation_config.{name}="
                      f"{drafter_value!r}", UserWarning, stacklevel=5)
    return value
