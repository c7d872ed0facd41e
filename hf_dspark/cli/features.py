"""``hf-dspark features``: cache target features of regenerated data (resumable)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from .common import TARGET_HELP, THREADS_HELP, DType, device, require_shards, setup_target, torch_dtype

HELP = "cache target features of regenerated data (resumable)"


@dataclass
class FeaturesSettings:
    data: list[str] = HfArg(help="regenerated data folders (hf-dspark data)")
    output: str = HfArg(help="feature folder (re-run the same command to resume)")
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    target_layer_ids: list[int] | None = HfArg(default=None, help="target layers to cache, comma-separated "
                                               "(default: the drafter default)", metadata={"comma": True})
    max_length: int = HfArg(default=512, help="longest sequence cached (tokens)", metadata={"bounds": (1, None)})
    dtype: DType = HfArg(default="bfloat16", help="dtype the features are stored in")
    target_dtype: DType = HfArg(default="float32", help="the target's weight dtype")
    batch_size: int = HfArg(default=4, help="sequences per target forward", metadata={"bounds": (1, None)})
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    num_workers: int = HfArg(default=1, help="split the shards over this many processes",
                             metadata={"bounds": (1, None)})
    worker_index: int = HfArg(default=0, help="this process's share (0..num-workers-1)",
                              metadata={"bounds": (0, None)})
    device: str = HfArg(default="auto", help="where the target runs (auto: cuda if available, else cpu)")


SETTINGS = (FeaturesSettings,)


def check(settings: FeaturesSettings) -> None:
    require_shards(settings.data, "--data")


def run(settings: FeaturesSettings) -> int:
    from ..configuration_dspark import DSparkConfig
    from ..training.features import cache_features
    from ..training.settings import list_shards

    target, _, _ = setup_target(settings, settings.target_dtype)
    target = target.to(device(settings.device))
    layer_ids = settings.target_layer_ids or DSparkConfig.for_target(target.config).target_layer_ids
    summary = cache_features(target, list_shards(settings.data), settings.output, layer_ids, settings.max_length,
                             dtype=torch_dtype(settings.dtype), batch_size=settings.batch_size,
                             worker_index=settings.worker_index, num_workers=settings.num_workers)
    print(json.dumps(summary))
    return 0
