"""``hf-dspark profile``: the target's SPS(B) curve (cached per device/dtype/threads)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from .common import OPTIMIZE_HELP, OptimizeMode
from .common import TARGET_HELP, THREADS_HELP, DType, setup_target

HELP = "profile the target's SPS(B) curve: steps per second by verification width (cached per device/dtype/threads)"


@dataclass
class ProfileSettings:
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    dtype: DType = HfArg(default="float32", help="the target's weight dtype")
    max_batch_tokens: int = HfArg(default=8, help="widest verification forward profiled (tokens)",
                                  metadata={"bounds": (1, None)})
    time_budget_s: float = HfArg(default=60.0, help="seconds the profiling may take",
                                 metadata={"deprecated": ["--time-budget"], "bounds": (0, None)})
    repeats: int = HfArg(default=5, help="timed repeats of each width",
                         metadata={"bounds": (1, None)})
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    optimize_target: OptimizeMode = HfArg(default="auto", help=OPTIMIZE_HELP)
    remeasure: bool = HfArg(default=False, help="measure again even where a cached profile exists (one measured on a "
                            "busy machine, or one that generate()'s rounds contradicted, is re-measured anyway)")
    export: str | None = HfArg(default=None, help="also write the serving-engine SPS JSON here")


SETTINGS = (ProfileSettings,)


def run(settings: ProfileSettings) -> int:
    from ..profiling import export_sps, load_or_profile, profile_path

    target, _, _ = setup_target(settings)
    sps = load_or_profile(target, settings.max_batch_tokens, time_budget_s=settings.time_budget_s,
                          repeats=settings.repeats, remeasure=settings.remeasure)
    path = profile_path(target)
    cached = json.loads(path.read_text())
    print(json.dumps({"cache": str(path), "linears": cached["key"]["linears"],
                      "others_load": cached.get("others_load"), **sps.to_dict()}))
    if settings.export:
        export_sps(sps, settings.export)
    return 0
