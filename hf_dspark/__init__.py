"""hf-dspark: DSpark speculative decoding (confidence-scheduled, semi-autoregressive drafting) for transformers.

Importing the package registers ``DSparkConfig`` / ``DSparkDrafter`` with ``AutoConfig`` / ``AutoModel`` and
installs the ``generate(..., assistant_model=drafter)`` dispatch (see ``hf_dspark.generation``).
"""

from transformers import AutoConfig, AutoModel

from .configuration_dspark import DSparkConfig
from .draft_sampling import DSparkDraft
from .modeling_dspark import DSparkContextCache, DSparkDrafter, DSparkOutput
from .drafting import DSparkStats
from .generation import DSparkCandidateGenerator, install_generate_dispatch
from .scheduling import (
    ConfidenceThresholdPolicy,
    FixedLengthPolicy,
    VerificationPolicy,
    register_verification_policy,
)

__version__ = "0.1.0"

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
# Saving a drafter writes its code files and `auto_map`, so the folder loads with trust_remote_code alone.
DSparkConfig.register_for_auto_class()
DSparkDrafter.register_for_auto_class("AutoModel")
install_generate_dispatch()


def load_default(dtype=None, device="cpu", optimize="auto"):
    """The embedded default: ``(target, tokenizer, drafter)`` for SmolLM2-135M-Instruct, the target optimised by
    ``optimize_target(target, optimize)``."""
    from .defaults import load_default as _load_default

    return _load_default(dtype=dtype, device=device, optimize=optimize)


def optimize_target(model, mode="auto"):
    """Make ``model``'s multi-token CPU forward cheap, in place (see ``hf_dspark.optimization.optimize_target``)."""
    from .optimization import optimize_target as _optimize_target

    return _optimize_target(model, mode)


__all__ = [
    "ConfidenceThresholdPolicy",
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkContextCache",
    "DSparkDraft",
    "DSparkDrafter",
    "DSparkOutput",
    "DSparkStats",
    "FixedLengthPolicy",
    "VerificationPolicy",
    "load_default",
    "optimize_target",
    "register_verification_policy",
]
