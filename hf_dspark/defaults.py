"""The embedded default: SmolLM2-135M-Instruct plus the drafter committed in ``hf_dspark/drafters/``."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

DRAFTERS_DIR = Path(__file__).parent / "drafters"
DEFAULT_DRAFTER = "smollm2-135m-instruct-dspark"


def embedded_drafter_path(name: str = DEFAULT_DRAFTER) -> Path | None:
    path = DRAFTERS_DIR / name
    return path if (path / "config.json").is_file() else None


def weights_digest(folder: str | Path) -> str | None:
    """The first 12 hex digits of the SHA-256 over a local drafter folder's ``*.safetensors`` files (sorted by name),
    or None for a folder without any (e.g. a Hub id): what a report names so that it says which weights it
    measured, even after the folder is re-packaged with new ones."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    sha = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
    return sha.hexdigest()[:12]


def load_drafter_for(target, drafter: str | None = None, dtype: torch.dtype | None = None, seed: int = 0):
    """Return ``(drafter, origin)``: the given folder, else the embedded drafter, else (with a clear label) a
    randomly initialised drafter shaped for ``target``. ``origin`` names a local folder with its weights' digest."""
    from .configuration_dspark import DSparkConfig
    from .modeling_dspark import DSparkDrafter

    dtype = dtype or target.dtype
    path = drafter or embedded_drafter_path()
    if path is not None:
        model = DSparkDrafter.from_pretrained(path, dtype=dtype).eval()
        digest = weights_digest(path)
        origin = str(path) + (f" (weights sha256 {digest})" if digest else "")
    else:
        torch.manual_seed(seed)
        model = DSparkDrafter(DSparkConfig.for_target(target.config, num_hidden_layers=2)).to(dtype).eval()
        origin = "randomly initialised (no trained drafter is embedded yet)"
    model.attach_target(target)
    return model, origin


def load_default(dtype: torch.dtype | None = None, device: str | torch.device = "cpu", optimize: str = "auto"):
    """``(target, tokenizer, drafter)``: SmolLM2-135M-Instruct and the embedded DSpark drafter.

    ``optimize`` is :func:`hf_dspark.optimize_target`'s mode for the target (``"auto"``: oneDNN-prepacked linears
    where they measure faster on this machine); what it did is ``target.hf_dspark_optimization``."""
    from .optimization import optimize_target
    from .target import load_smollm2

    target, tokenizer = load_smollm2(dtype=dtype or torch.float32, device=device)
    optimize_target(target, optimize)
    drafter, _ = load_drafter_for(target, dtype=target.dtype)
    return target, tokenizer, drafter.to(device)
