"""Evaluation: rollouts over prompt sets, the paper's metrics, the ``hf-dspark eval`` report, ``evaluate`` modules."""

from pathlib import Path

from . import metrics
from .rollouts import MethodResult, chat_inputs, rollout_record, run_rollouts, summarise

MODULES_DIR = Path(__file__).parent / "modules"


def evaluate_module_path(name: str) -> str:
    """Local path of a shipped ``evaluate`` module (``dspark_acceptance``, ``dspark_calibration``), for
    ``evaluate.load(path)`` without the Hub."""
    path = MODULES_DIR / name
    if not (path / f"{name}.py").is_file():
        available = sorted(p.name for p in MODULES_DIR.iterdir() if (p / f"{p.name}.py").is_file())
        raise ValueError(f"no evaluate module named {name!r}; available: {available}")
    return str(path)


__all__ = ["evaluate_module_path", "MethodResult", "chat_inputs", "metrics", "rollout_record", "run_rollouts", "summarise"]
