"""``hf-dspark export``: a drafter folder for a serving engine (vLLM, SGLang, TensorRT-LLM, reference DeepSpec)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from transformers.hf_argparser import HfArg

from .common import DEFAULT_TARGETS, DType, load_target, torch_dtype

HELP = "write a drafter folder for a serving engine (vllm, sglang, trtllm, reference)"


@dataclass
class ExportSettings:
    engine: Literal["vllm", "sglang", "trtllm", "reference"] = HfArg(help="the serving engine the folder is for")
    output: str = HfArg(help="folder to write")
    drafter: str | None = HfArg(default=None, help="drafter folder (default: the embedded drafter)")
    target: str | None = HfArg(default=None, help="the drafter's target, whose embedding / LM head are copied "
                               "(default: SmolLM2-135M-Instruct)")
    dtype: DType = HfArg(default="bfloat16", help="weight dtype of the export")
    sps: str | None = HfArg(default=None, help="SPS profile JSON (hf-dspark profile --export, or its cache file)")
    sts: str | None = HfArg(default=None, help="calibration JSON (default: the drafter folder's sts.json, if any)")


SETTINGS = (ExportSettings,)


def run(settings: ExportSettings) -> int:
    import torch

    from ..defaults import embedded_drafter_path, load_drafter_for
    from ..export import STS_FILE, export_for_engine

    if settings.target in DEFAULT_TARGETS:
        target, _ = load_target(settings.target, torch.float32)
    else:  # only the embedding and LM head are exported: no tokenizer needed
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(settings.target, dtype=torch.float32).eval()
    drafter, origin = load_drafter_for(target, settings.drafter, dtype=torch.float32)
    sts = settings.sts
    source = Path(settings.drafter) if settings.drafter else embedded_drafter_path()
    if sts is None and settings.engine != "vllm" and source is not None and (source / STS_FILE).is_file():
        sts = source / STS_FILE  # what `hf-dspark calibrate` wrote next to the drafter
    result = export_for_engine(drafter, settings.output, settings.engine, dtype=torch_dtype(settings.dtype), sts=sts,
                               sps=settings.sps)
    print(f"exported {origin} for {result.engine} to {result.folder}: {', '.join(result.files)}")
    print(f"serve: {result.launch}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
