"""``hf-dspark push``: a drafter folder to the Hugging Face Hub with its model card."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers.hf_argparser import HfArg

from .arguments import UsageError

HELP = "push a drafter folder to the Hugging Face Hub with its model card"


@dataclass
class PushSettings:
    drafter: str = HfArg(help="drafter folder (save_pretrained / hf-dspark calibrate output)")
    repo_id: str = HfArg(help="the Hub repository, ORG/NAME", metadata={"metavar": "ORG/NAME"})
    revision: str | None = HfArg(default=None, help="branch to push to (created from main if missing; default: main)",
                                 aliases=["--branch"])
    private: bool = HfArg(default=False, help="create the repo as private")
    token: str | None = HfArg(default=None, help="Hub token with write access (default: HF_TOKEN / hf auth login)")
    report: str | None = HfArg(default=None, help="evaluation report JSON for the card (hf-dspark bench --output)")
    run: str | None = HfArg(default=None, help="training run folder for the card's training section")
    target_name: str | None = HfArg(default=None, help="the target's Hub id for the card (default: from the "
                                    "folder's README.md)")
    commit_message: str | None = HfArg(default=None, help="the Hub commit's message (default: huggingface_hub's)")


SETTINGS = (PushSettings,)


def check(settings: PushSettings) -> None:
    if not Path(settings.drafter, "config.json").is_file():
        raise UsageError(f"--drafter: not a drafter folder (no config.json): {settings.drafter}")


def run(settings: PushSettings) -> int:
    """Pushes weights, code, custom_generate/, sts.json when calibrated, and the model card."""
    from ..hub import load_report, push_drafter, training_text
    from ..modeling_dspark import DSparkDrafter

    drafter = DSparkDrafter.from_pretrained(settings.drafter, dtype="auto")
    info = push_drafter(
        drafter, settings.repo_id, revision=settings.revision, private=True if settings.private else None,
        token=settings.token, commit_message=settings.commit_message,
        report=load_report(settings.report) if settings.report else None,
        training=training_text(settings.run) if settings.run else None, target_name=settings.target_name,
    )
    print(f"pushed {settings.drafter} to {info.repo_url.repo_id}@{settings.revision or 'main'}: commit {info.oid}")
    return 0
