"""``hf-dspark serve``: an OpenAI-compatible HTTP server (chat and text completions, streamed or not) in front of
the batched engine, with the drafter."""

from __future__ import annotations

from dataclasses import dataclass

from transformers.hf_argparser import HfArg

from .arguments import UsageError
from .common import DRAFT_TREE_HELP, OPTIMIZE_HELP, DraftTree, OptimizeMode
from .common import DRAFTER_HELP, TARGET_HELP, THREADS_HELP, DType, setup_target
from .policies import DEFAULT_POLICY, current_spec, drafter_policy, engine_spec

HELP = "OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models) on the batched engine"


@dataclass
class ServeSettings:
    host: str = HfArg(default="127.0.0.1", help="address to serve on (0.0.0.0: every interface)")
    port: int = HfArg(default=8000, help="port", metadata={"bounds": (1, 65535)})
    target: str | None = HfArg(default=None, help=TARGET_HELP)
    drafter: str | None = HfArg(default=None, help=DRAFTER_HELP)
    draft_tree: DraftTree | None = HfArg(default=None, help=DRAFT_TREE_HELP)
    dtype: DType = HfArg(default="float32", help="weight dtype of target and drafter")
    max_concurrency: int = HfArg(default=16, help="most requests in the batch at once; more wait and join as others "
                                 "finish", metadata={"bounds": (1, None)})
    policy: str = HfArg(default=DEFAULT_POLICY, help="the engine's policy: hybrid (the scheduler plus a prompt lookup "
                        "per request; a drafter without a confidence head verifies whole blocks instead) | plain (no "
                        "drafter) | fixed | scheduler")
    model_name: str | None = HfArg(default=None, help="the model name clients send and /v1/models lists (default: "
                                   "the target's folder name)")
    threads: int | None = HfArg(default=None, help=THREADS_HELP, metadata={"bounds": (1, None)})
    optimize_target: OptimizeMode = HfArg(default="auto", help=OPTIMIZE_HELP)


SETTINGS = (ServeSettings,)


def check(settings: ServeSettings) -> None:
    """Refuse what the server cannot run before anything loads."""
    settings.policy = engine_spec(current_spec(settings.policy, "--policy"), "--policy")
    if settings.policy != "plain" and "=" in settings.policy:
        raise UsageError("--policy takes a policy name (plain, fixed, scheduler or hybrid), no options")
    try:
        import fastapi  # noqa: F401
        import openai  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise UsageError(f"hf-dspark serve needs fastapi, uvicorn and openai: pip install 'hf-dspark[serve]' "
                         f"({err})") from None


def run(settings: ServeSettings) -> int:
    """Serves until interrupted."""
    from pathlib import Path

    from ..defaults import load_drafter_for
    from ..serving import serve

    from ..optimization import optimization_report

    target, tokenizer, dtype = setup_target(settings)
    print(f"hf-dspark serve: target {optimization_report(target).summary()}", flush=True)
    drafter = None
    if settings.policy != "plain":
        drafter, origin = load_drafter_for(target, settings.drafter, dtype=dtype)
        print(f"hf-dspark serve: drafter {origin}", flush=True)
        if settings.draft_tree is not None:
            drafter.generation_config.draft_tree = settings.draft_tree
        settings.policy = drafter_policy(settings.policy, drafter)
    name = settings.model_name or Path(str(getattr(target.config, "_name_or_path", "") or "target")).name
    print(f"hf-dspark serve: {name} on http://{settings.host}:{settings.port}/v1 (policy {settings.policy}, at most "
          f"{settings.max_concurrency} requests at once)", flush=True)
    serve(target, tokenizer, drafter, name, host=settings.host, port=settings.port, policy=settings.policy,
          max_concurrency=settings.max_concurrency, optimize_target=None,
          announce=lambda line: print(f"hf-dspark serve: {line}", flush=True))
    return 0
