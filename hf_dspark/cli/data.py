"""``hf-dspark data``: regenerate training responses with the target (sharded, resumable)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from ..training.settings import RegenerationSettings
from .common import TARGET_HELP, THREADS_HELP, device, load_target, require_prompts, torch_dtype, warn_if_slow_dtype

HELP = "regenerate training responses with the target (sharded, resumable)"


@dataclass
class DataJob:
    """Where the regenerated shards go and how this process shares the work."""

    output: str = HfArg(help="output folder (re-run the same command to resume)")
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    num_workers: int = HfArg(default=1, help="split shards over this many processes", metadata={"bounds": (1, None)})
    worker_index: int = HfArg(default=0, help="this process's share (0..num-workers-1)", metadata={"bounds": (0, None)})
    device: str = HfArg(default="auto", help="where the target runs (auto: cuda if available, else cpu)")
    time_budget_s: float | None = HfArg(default=None, help="start no new shard after this many seconds (finished "
                                        "shards are kept; a rerun continues)", metadata={"bounds": (0, None)})


SETTINGS = (RegenerationSettings, DataJob)
# the command line regenerates in float32 by default (bf16 matrix products are slow on most CPUs)
DEFAULTS = {"dtype": "float32"}


def check(regeneration: RegenerationSettings, job: DataJob) -> None:
    require_prompts(regeneration.prompt_paths, "--prompts")


def run(regeneration: RegenerationSettings, job: DataJob) -> int:
    import torch

    from ..training.data import regenerate

    torch.set_num_threads(job.threads or torch.get_num_threads())
    where = device(job.device)
    warn_if_slow_dtype(regeneration.dtype, where.type)
    target, tokenizer = load_target(job.target, torch_dtype(regeneration.dtype))
    target = target.to(where)
    summary = regenerate(target, tokenizer, job.output, regeneration, worker_index=job.worker_index,
                         num_workers=job.num_workers, time_budget_s=job.time_budget_s)
    print(json.dumps(summary))
    return 0
