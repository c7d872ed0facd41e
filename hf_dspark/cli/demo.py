"""``hf-dspark demo``: the Gradio demo, plain and DSpark generate() streaming side by side, offline."""

from __future__ import annotations

import time
from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from .common import DRAFT_TREE_HELP, OPTIMIZE_HELP, DraftTree, OptimizeMode
from .common import THREADS_HELP, DType, torch_dtype, warn_if_slow_dtype
from .policies import DEFAULT_POLICY, POLICIES

HELP = "Gradio demo: plain vs DSpark streaming side by side, drafts per round"


@dataclass
class DemoSettings:
    host: str = HfArg(default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    port: int | None = HfArg(default=None, help="port (default: the first free one from 7860)",
                             metadata={"bounds": (1, 65535)})
    drafter: str | None = HfArg(default=None, help="drafter folder (default: the embedded drafter)")
    dtype: DType = HfArg(default="float32", help="weight dtype of target and drafter")
    max_new_tokens: int = HfArg(default=128, help="the UI's initial max new tokens", metadata={"bounds": (1, None)})
    policy: str = HfArg(default=DEFAULT_POLICY, help="the verification policy the UI starts on (fixed for a drafter "
                        "without a confidence head)", metadata={"choices": list(POLICIES)})
    draft_tree: DraftTree = HfArg(default="chain", help="the token-tree setting the UI starts on: " + DRAFT_TREE_HELP)
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    optimize_target: OptimizeMode = HfArg(default="auto", help=OPTIMIZE_HELP)


SETTINGS = (DemoSettings,)


def run(settings: DemoSettings) -> int:
    """Serves the demo on SmolLM2-135M-Instruct until interrupted, printing its address (and not Gradio's hint
    about public links: the demo never shares one)."""
    import torch

    from ..demo import launch_default

    if settings.threads:
        torch.set_num_threads(settings.threads)
    warn_if_slow_dtype(settings.dtype)  # the demo runs on the CPU
    _, url, _ = launch_default(host=settings.host, port=settings.port, drafter=settings.drafter,
                               dtype=torch_dtype(settings.dtype), max_new_tokens=settings.max_new_tokens,
                               policy=settings.policy, draft_tree=settings.draft_tree, quiet=True,
                               optimize_target=settings.optimize_target,
                               prevent_thread_lock=True)
    print(f"hf-dspark demo: serving on {url} (Ctrl+C stops it)", flush=True)
    while True:  # the server runs in its own thread; Ctrl+C ends the command
        time.sleep(1)
