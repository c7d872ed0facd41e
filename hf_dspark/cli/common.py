"""What several commands share: the model flags, loading the target, refusing empty inputs before anything loads."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from transformers.hf_argparser import HfArg

from .arguments import UsageError

if TYPE_CHECKING:  # torch loads where a command runs, not while its flags are read (--help, refused flags)
    import torch

DType = Literal["bfloat16", "float16", "float32"]
# block_source.DRAFT_ROUNDS, spelled out so that building the parser does not import torch (a test keeps them equal)
DRAFT_ROUNDS = ("auto", "eager", "static", "graph")
DraftRound = Literal["auto", "eager", "static", "graph"]
# token_tree.DRAFT_TREES, spelled out for the same reason (a test keeps them equal)
DRAFT_TREES = ("chain", "auto", "always")
DraftTree = Literal["chain", "auto", "always"]
DRAFT_TREE_HELP = ("token trees (greedy): chain (never; the default unless the drafter says otherwise) | auto (a round "
                   "verifies the tree of the block's alternatives where the cost model prices it above the chain) | "
                   "always (every block round, for measurements)")
DRAFT_ROUND_HELP = ("how a drafting round runs: auto (a CUDA graph on CUDA where the round allows it, else eager) | "
                    "eager | static (the graph's fixed-shape round run eagerly) | graph; default: the drafter's own")
EXCLUDE_HELP = ("prompts to skip: regenerated data folders, calibrated drafter folders (their calibration prompts) "
                "or text files of prompt ids, one per line")
PROMPTS_HELP = ("prompt sources: .jsonl files or folders (one prompt per line), 'bundled' or 'bundled:<set>' (the "
                "package's chat, code, math and repetitive sets), or 'hf:<dataset>?split=<split>&field=<column>' (a Hub "
                "dataset); docs/guide/prompts.md")
TARGET_HELP = "target model folder or Hub id (default: SmolLM2-135M-Instruct)"
DRAFTER_HELP = "drafter folder or Hub id (default: the embedded drafter)"
THREADS_HELP = "torch CPU threads (default: torch's choice)"
OptimizeMode = Literal["auto", "on", "off"]
OPTIMIZE_HELP = ("the target's CPU linears on oneDNN-prepacked weights (hf_dspark.optimize_target): auto (where a "
                 "one-time measurement on this machine finds them faster) | on | off (torch's stock linears)")
SEED_HELP = "random seed (prompt sampling, sampled decoding)"
DEFAULT_TARGETS = (None, "smollm2", "SmolLM2-135M-Instruct")
# settings fields naming a model folder or Hub repo id
MODEL_FIELDS = ("target", "drafter", "init_drafter", "ablation")


@dataclass
class Output:
    """Flags every command takes."""

    verbose: bool = HfArg(default=False, help="show the weight-loading and download progress bars")


def looks_like_path(value: str) -> bool:
    """A local path rather than a Hub repo id (``name`` or ``namespace/name``: at most one ``/``)."""
    separators = tuple({"/", os.sep} | ({os.altsep} if os.altsep else set()))
    return (value.startswith((".", "~", *separators)) or value.endswith(separators) or value.count("/") > 1
            or any(sep in value for sep in separators if sep != "/"))


def _model_path(value: str, flag: str) -> str:
    """A model value as the loaders get it: a local path with ``~`` expanded, refused when it does not exist (the
    Hub would only say that it is not a valid repo id); anything else unchanged."""
    if not looks_like_path(value):
        return value
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        raise UsageError(f"{flag}: no such folder: {value}")
    return path


def check_model_paths(settings, flag_of) -> None:
    """Expand and check every model folder among ``settings``' fields; ``flag_of(field)`` names its flag."""
    for name in MODEL_FIELDS:
        value = getattr(settings, name, None)
        if isinstance(value, list):
            setattr(settings, name, [_model_path(v, flag_of(name)) for v in value])
        elif value is not None:
            setattr(settings, name, _model_path(value, flag_of(name)))


def require_prompts(paths: list[str], flag: str) -> None:
    """Refuse prompt files / folders that are missing or hold no prompt."""
    from ..prompts import load_prompts

    try:
        prompts = load_prompts(paths)
    except FileNotFoundError as err:
        raise UsageError(f"{flag}: {err}") from None
    if not prompts:
        raise UsageError(f"{flag}: no prompts in {' '.join(paths)}")


def require_shards(folders: list[str], flag: str) -> None:
    """Refuse regenerated-data folders that are missing or hold no finished shard."""
    from ..training.settings import list_shards

    missing = [folder for folder in folders if not Path(folder).is_dir()]
    if missing:
        raise UsageError(f"{flag}: no such folder: {missing[0]}")
    try:
        list_shards(folders)
    except FileNotFoundError as err:
        raise UsageError(f"{flag}: {err}") from None


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    import torch

    return getattr(torch, name)


def warn_if_slow_dtype(dtype_name: str, device_type: str = "cpu") -> None:
    """One line on stderr where a model in ``dtype_name`` runs slowly on this CPU, naming the faster dtype."""
    from ..cpu_features import cpu_flags, slow_dtype_warning

    message = slow_dtype_warning(dtype_name, device_type, cpu_flags())
    if message:
        print(f"hf-dspark: warning: {message}", file=sys.stderr, flush=True)


def load_target(name: str | None, dtype: torch.dtype):
    """The target and its tokenizer: SmolLM2-135M-Instruct by default, else any causal LM folder or Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in DEFAULT_TARGETS:
        from ..target import load_smollm2

        return load_smollm2(dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(name)


def device(name: str) -> torch.device:
    """``auto``: the GPU where CUDA is available, else the CPU; otherwise the named device."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chosen = torch.device(name)
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    return chosen


def setup_target(settings, dtype_name: str | None = None):
    """Thread count, dtype and the target (+ tokenizer) for commands that run it; commands with
    ``--optimize-target`` get the target optimised as it says (``target.hf_dspark_optimization`` tells how); a
    warning where the dtype is slow on the CPU the target runs on."""
    import torch

    if getattr(settings, "threads", None):
        torch.set_num_threads(settings.threads)
    dtype_name = dtype_name or settings.dtype
    warn_if_slow_dtype(dtype_name, device(getattr(settings, "device", "cpu")).type)
    dtype = torch_dtype(dtype_name)
    target, tokenizer = load_target(settings.target, dtype)
    mode = getattr(settings, "optimize_target", None)
    if mode is not None:
        from ..optimization import optimize_target, verdict_path

        if mode == "auto" and not verdict_path(target).is_file():
            print("[hf-dspark] timing the target's stock and oneDNN-prepacked linears (once per machine, dtype and "
                  "thread count; a few seconds)", file=sys.stderr, flush=True)
        optimize_target(target, mode)
    return target, tokenizer, dtype
