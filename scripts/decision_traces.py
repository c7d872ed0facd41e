"""What ``scripts/engine_decisions.py`` and ``scripts/generate_decisions.py`` share: the drafter both versions load,
importing ``hf_dspark`` from another checkout, the digests, the command-line arguments and their checks, and loading
the target, the drafter and the prompts."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

DRAFTER = Path(__file__).resolve().parents[1] / "hf_dspark" / "drafters" / "smollm2-135m-instruct-dspark"
PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def digest(value) -> str:
    return hashlib.sha1(json.dumps(value).encode()).hexdigest()[:12]


def import_package(tree: str | None):
    """``hf_dspark`` from ``tree`` (bypassing an installed or editable copy), or the installed one."""
    if tree is not None:
        root = Path(tree).resolve()
        sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
        sys.path.insert(0, str(root))
        for name in [name for name in sys.modules if name == "hf_dspark" or name.startswith("hf_dspark.")]:
            del sys.modules[name]
    import hf_dspark

    if tree is not None and not Path(hf_dspark.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"--tree {tree}: imported hf_dspark from {hf_dspark.__file__} instead")
    return hf_dspark


def add_arguments(parser: argparse.ArgumentParser, sps_help: str, num_prompts: int, max_new_tokens: int) -> None:
    """The arguments both traces take."""
    parser.add_argument("--sps", required=True, help=sps_help)
    parser.add_argument("--output", required=True, help="trace JSON to write")
    parser.add_argument("--tree", help="checkout whose hf_dspark to import (default: the installed package)")
    parser.add_argument("--prompts", default=str(PROMPTS), help="prompt files or folders (default: ../shared/data/eval)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--drafter", default=str(DRAFTER),
                        help="drafter folder both versions load (default: this checkout's embedded DSpark drafter)")
    parser.add_argument("--threads", type=int, default=1)


def checked_inputs(parser: argparse.ArgumentParser, args, positive: tuple[str, ...]) -> tuple[dict, Path]:
    """The SPS file's JSON and the drafter's weights file, after checking that ``positive`` flags are >= 1 and that
    both files exist (``parser.error`` names what is wrong)."""
    for flag in positive:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    sps_path = Path(args.sps)
    if not sps_path.is_file():
        parser.error(f"--sps {args.sps}: no such file")
    drafter_weights = Path(args.drafter) / "model.safetensors"
    if not drafter_weights.is_file():
        parser.error(f"--drafter {args.drafter}: no model.safetensors there")
    return json.loads(sps_path.read_text()), drafter_weights


def load_run(args):
    """``(hf_dspark, target, drafter, prompts)``: the package from ``--tree``, the default target and ``--drafter`` in
    float32 on ``--threads`` threads, and the first ``--num-prompts`` prompts encoded."""
    hf_dspark = import_package(args.tree)
    import torch

    from hf_dspark.defaults import load_drafter_for
    from hf_dspark.prompts import load_prompts

    try:
        from hf_dspark.evaluation.engine_bench import encode_prompts
    except ImportError:  # a --tree from before the bench moved out of engine/
        from hf_dspark.engine.bench import encode_prompts

    torch.set_num_threads(args.threads)
    target, tokenizer, _ = hf_dspark.load_default(dtype=torch.float32)
    drafter, _ = load_drafter_for(target, args.drafter, dtype=torch.float32)
    prompts = [ids for _, ids in encode_prompts(tokenizer, load_prompts([args.prompts]), args.num_prompts)]
    return hf_dspark, target, drafter, prompts


def weights_digest(drafter_weights: Path) -> str:
    return hashlib.sha256(drafter_weights.read_bytes()).hexdigest()[:12]
