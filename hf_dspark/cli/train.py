"""``hf-dspark train``: train a DSpark drafter (resumable: re-run the same command)."""

from __future__ import annotations

import json

from ..training.settings import TrainingArguments
from .common import require_shards

HELP = "train a DSpark drafter (resumable: re-run the same command)"
SETTINGS = (TrainingArguments,)
# the command line trains in bf16 where the device multiplies it natively; the Python API keeps float32
DEFAULTS = {"mixed_precision": "auto"}


def check(settings: TrainingArguments) -> None:
    require_shards(settings.data_dirs, "--data")
    if settings.eval_data_dirs:
        require_shards(settings.eval_data_dirs, "--eval-data")


def run(settings: TrainingArguments) -> int:
    from ..training.trainer import DSparkTrainer

    print(json.dumps(DSparkTrainer(settings).train()))
    return 0
