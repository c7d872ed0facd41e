"""hf-dspark: DSpark speculative decoding (confidence-scheduled, semi-autoregressive drafting) for transformers.

Importing the package registers ``DSparkConfig`` / ``DSparkDrafter`` with ``AutoConfig`` / ``AutoModel`` and
installs the ``generate(..., assistant_model=drafter)`` dispatch (see ``hf_dspark.generation``). The public names
below load with their modules on first use; the registration imports torch and transformers' modeling code, so the
``hf-dspark`` command (``hf_dspark_entry``) defers it until a command runs, and its ``--help`` and flag errors never
load them.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .configuration_dspark import DSparkConfig
    from .draft_sampling import DSparkDraft
    from .generation import DSparkCandidateGenerator
    from .modeling_dspark import DSparkContextCache, DSparkDrafter, DSparkOutput
    from .scheduling import (
        ConfidenceThresholdPolicy,
        FixedLengthPolicy,
        VerificationPolicy,
        register_verification_policy,
    )
    from .stats import DSparkStats

__version__ = "0.1.0"

# Set by the command-line entry point (hf_dspark_entry) around its import of hf_dspark.cli only, so that the package
# imports without registering; hf_dspark.cli.main calls _register() before a command runs.
DEFER_REGISTRATION = "HF_DSPARK_DEFER_REGISTRATION"

# public name -> the module that defines it
_PUBLIC = {
    "ConfidenceThresholdPolicy": "scheduling",
    "DSparkCandidateGenerator": "generation",
    "DSparkConfig": "configuration_dspark",
    "DSparkContextCache": "modeling_dspark",
    "DSparkDraft": "draft_sampling",
    "DSparkDrafter": "modeling_dspark",
    "DSparkOutput": "modeling_dspark",
    "DSparkStats": "stats",
    "FixedLengthPolicy": "scheduling",
    "VerificationPolicy": "scheduling",
    "register_verification_policy": "scheduling",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


_registered = False


def _register() -> None:
    """Register ``DSparkConfig`` / ``DSparkDrafter`` with the Auto classes and install the ``generate()`` dispatch
    (idempotent; importing the package does it, except under the command line, which calls it before a command)."""
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModel

    from .configuration_dspark import DSparkConfig
    from .generation import install_generate_dispatch
    from .modeling_dspark import DSparkDrafter

    AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
    AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
    # Saving a drafter writes its code files and `auto_map`, so the folder loads with trust_remote_code alone.
    DSparkConfig.register_for_auto_class()
    DSparkDrafter.register_for_auto_class("AutoModel")
    install_generate_dispatch()
    _registered = True


if os.environ.get(DEFER_REGISTRATION) != "1":
    _register()


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
