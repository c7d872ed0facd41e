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
    if drafter.draft_vocab is not None:
        # Draft-vocabulary drafters also carry EAGLE-3 style offsets (target id = draft index + d2t[draft index]).
        tensors["draft_vocab"] = drafter.draft_vocab.detach().clone()
        tensors["d2t"] = (drafter.draft_vocab - torch.arange(drafter.draft_vocab.numel())).detach().clone()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = drafter.config.to_reference_dict()
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


MODEL_CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "model_cards" / "dspark_drafter.md.jinja"


def render_model_card(drafter: DSparkDrafter, *, name: str, repo_id: str, target_name: str, training_text: str,
                      evaluation_text: str, template: str | Path | None = None) -> str:
    """Render the model card template with the drafter's config and the given training / evaluation texts."""
    import jinja2

    path = Path(template) if template else MODEL_CARD_TEMPLATE
    if not path.is_file():
        raise FileNotFoundError(f"model card template not found: {path}")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(path.read_text(encoding="utf-8")).render(
        name=name, repo_id=repo_id, target_name=target_name, config=drafter.config,
        num_parameters=sum(p.numel() for p in drafter.parameters()), training_text=training_text,
        evaluation_text=evaluation_text,
    )
