"""Export drafters: the reference (DeepSpec ``Qwen3DSparkModel``) checkpoint format that serving engines read."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .modeling_dspark import DSparkDrafter


def export_reference_format(drafter: DSparkDrafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``drafter`` as a reference-format folder: ``config.json`` (Qwen3 copy with ``architectures:
    ["Qwen3DSparkModel"]``, DSpark fields, ``sample_from_anchor`` and ``dflash_config``) and ``model.safetensors``
    with un-prefixed names plus copies of the target's embedding and LM head (the format requires them, so the
    drafter must be attached to its target or loaded from a reference folder)."""
    if drafter.embed_tokens is None or drafter.lm_head is None:
        raise ValueError("export needs the target's embedding and LM head: call drafter.attach_target(target) first")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.dtype
    tensors = {name: t.detach().to(dtype).contiguous() for name, t in drafter.state_dict().items()}
    tensors["embed_tokens.weight"] = drafter.embed_tokens.weight.detach().to(dtype).contiguous().clone()
    tensors["lm_head.weight"] = drafter.lm_head.weight.detach().to(dtype).contiguous().clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = drafter.config.to_reference_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder
