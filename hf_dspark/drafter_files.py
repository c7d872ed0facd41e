"""A drafter folder's files besides the weights: reading its JSON files and a reference-format folder's shared
weights, and writing the code a folder carries for ``trust_remote_code``.

A folder's code is written, never committed: ``save_pretrained`` copies ``modeling_dspark.py`` with every module it
imports relatively (transformers' ``custom_object_save``), and ``write_custom_generate`` copies the generation module
with every module beside it that it imports. Both follow the imports, so a new sibling module travels without a
list to update.

Self-contained (torch + transformers + safetensors): drafter folders carry it beside ``modeling_dspark.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from torch import nn

# Weights that reference-format folders carry as copies of the target's; hf-dspark checkpoints never store them.
TARGET_OWNED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
CUSTOM_GENERATE = "custom_generate"
# transformers' custom_generate route loads this file of the folder's custom_generate/.
CUSTOM_GENERATE_ENTRY = "generate.py"
CUSTOM_GENERATE_REQUIREMENTS = "torch>=2.4\ntransformers>=5.24,<6\n"


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------
def _hub_kwargs(kwargs: dict) -> dict:
    keys = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")
    return {k: kwargs[k] for k in keys if k in kwargs}


def _resolve(path_or_repo, filename: str, kwargs: dict) -> str | None:
    from transformers.utils import cached_file

    return cached_file(
        path_or_repo,
        filename,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        **_hub_kwargs(kwargs),
    )


def read_json(path_or_repo, filename: str, kwargs: dict) -> dict | None:
    """``filename`` of a local folder or Hub repo as JSON (None when it has no such file); ``kwargs``: the Hub
    options of a ``from_pretrained`` call."""
    resolved = _resolve(path_or_repo, filename, kwargs)
    if resolved is None:
        return None
    with open(resolved, encoding="utf-8") as f:
        return json.load(f)


def load_reference_shared(path_or_repo, config, kwargs: dict) -> tuple[nn.Embedding, nn.Linear]:
    """The embedding / LM head copies a reference-format folder carries (possibly sharded)."""
    from safetensors import safe_open

    index = read_json(path_or_repo, "model.safetensors.index.json", kwargs)
    files = {name: "model.safetensors" for name in TARGET_OWNED_WEIGHTS}
    if index is not None:
        files = {name: index["weight_map"][name] for name in TARGET_OWNED_WEIGHTS if name in index["weight_map"]}
    tensors = {}
    for name, filename in files.items():
        resolved = _resolve(path_or_repo, filename, kwargs)
        if resolved is not None:
            with safe_open(resolved, framework="pt") as f:
                if name in f.keys():
                    tensors[name] = f.get_tensor(name)
    missing = [n for n in TARGET_OWNED_WEIGHTS if n not in tensors]
    if missing:
        raise ValueError(f"reference-format checkpoint {path_or_repo} lacks {missing}")
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else tensors["lm_head.weight"].dtype
    embed.weight = nn.Parameter(tensors["embed_tokens.weight"].to(dtype), requires_grad=False)
    lm_head.weight = nn.Parameter(tensors["lm_head.weight"].to(dtype), requires_grad=False)
    return embed, lm_head


# --------------------------------------------------------------------------------------------------------------
# Writing the code
# --------------------------------------------------------------------------------------------------------------
def sibling_imports(path: Path) -> set[str]:
    """The modules beside ``path`` that it imports relatively (``from .x import ...``, ``from . import x``), at
    module level or inside a function alike: either runs where the folder is loaded."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names.update([node.module.split(".")[0]] if node.module else (alias.name for alias in node.names))
    return {name for name in names if (path.parent / f"{name}.py").is_file()}


def module_closure(entry: Path) -> list[Path]:
    """``entry`` and every module beside it that it imports, directly or through another, sorted by path."""
    entry = Path(entry).resolve()
    found, pending = {entry}, [entry]
    while pending:
        for name in sibling_imports(pending.pop()):
            path = entry.parent / f"{name}.py"
            if path not in found:
                found.add(path)
                pending.append(path)
    return sorted(found)


def generation_module(source_name_or_path: str | None) -> Path:
    """The file a folder's ``custom_generate/generate.py`` is copied from: hf_dspark's ``generation.py`` where
    hf-dspark is installed, else the ``custom_generate/generate.py`` of the local folder the drafter was loaded
    from (a drafter loaded with ``trust_remote_code`` and saved again)."""
    # Found, not imported: the package imports this module.
    spec = importlib.util.find_spec("hf_dspark")
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent / "generation.py"
    if source_name_or_path and (Path(source_name_or_path) / CUSTOM_GENERATE / CUSTOM_GENERATE_ENTRY).is_file():
        return Path(source_name_or_path) / CUSTOM_GENERATE / CUSTOM_GENERATE_ENTRY
    raise RuntimeError("cannot write custom_generate/: neither hf_dspark nor a source custom_generate/ is available")


def write_custom_generate(save_directory, source_name_or_path: str | None) -> None:
    """Write ``custom_generate/`` next to a saved drafter: the generation module as ``generate.py``, every module
    beside it that it imports (``module_closure``), and ``requirements.txt``."""
    entry = generation_module(source_name_or_path).resolve()
    folder = Path(save_directory) / CUSTOM_GENERATE
    folder.mkdir(parents=True, exist_ok=True)
    for source in module_closure(entry):
        target = folder / (CUSTOM_GENERATE_ENTRY if source == entry else source.name)
        if source != target.resolve():  # saving a folder over itself: the file is already there
            shutil.copyfile(source, target)
    (folder / "requirements.txt").write_text(CUSTOM_GENERATE_REQUIREMENTS, encoding="utf-8")
