"""Evaluation: rollouts over prompt sets, the paper's metrics, the ``hf-dspark eval`` report, ``evaluate`` modules,
and the batched engine's bench (``engine_bench``, ``hf-dspark bench-serve``).

``metrics`` and the rollout functions load (with torch) on first use: the command line reads ``evaluation.settings``
and ``evaluation.bench_report`` through this package without loading torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from . import metrics
    from .rollouts import MethodResult, chat_inputs, rollout_record, run_rollouts, summarise

MODULES_DIR = Path(__file__).parent / "modules"
_ROLLOUTS = ("MethodResult", "chat_inputs", "rollout_record", "run_rollouts", "summarise")


def __getattr__(name: str):
    if name == "metrics":
        return importlib.import_module(".metrics", __name__)
    if name not in _ROLLOUTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(".rollouts", __name__), name)
    globals()[name] = value
    return value


def evaluate_module_path(name: str) -> str:
    """Local path of a shipped ``evaluate`` module (``dspark_acceptance``, ``dspark_calibration``), for
    ``evaluate.load(path)`` without the Hub."""
    path = MODULES_DIR / name
    if not (path / f"{name}.py").is_file():
        available = sorted(p.name for p in MODULES_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise ValueError(f"no evaluate module named {name!r}; available: {available}")
    return str(path)


__all__ = ["evaluate_module_path", "MethodResult", "chat_inputs", "metrics", "rollout_record", "run_rollouts", "summarise"]
