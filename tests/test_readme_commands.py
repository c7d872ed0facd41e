"""The documented `data`, `calibrate`, `eval`, `bench` and `bench-serve` examples run from a clone: every such
command in a bash block of the README or a user-guide page (``docs/guide/*.md``) is read out and run as written, its
outputs moved under a temporary folder and its sizes cut down by flags appended after the documented ones (the later
value wins)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, require_smollm2

# Appended to each documented command: the same work on a few prompts and tokens
TINY = {
    "data": ["--max-prompts", "2", "--shard-size", "2", "--batch-size", "2", "--max-new-tokens", "4"],
    "calibrate": ["--num-prompts", "6", "--max-new-tokens", "8", "--cv-folds", "2", "--concurrency", "2"],
    # the quality phase only: the timed comparison is bench's, run below
    "eval": ["--num-prompts", "1", "--speed-prompts", "1", "--max-new-tokens", "8", "--temperatures", "0",
             "--concurrency", "2", "--phases", "quality"],
    "bench": ["--num-prompts", "1", "--max-new-tokens", "8"],
    "bench-serve": ["--num-prompts", "2", "--max-new-tokens", "4", "--concurrency", "1", "2"],
}
OUTPUT_FLAGS = ("--output", "--plot", "--markdown", "--export")


def documentation() -> list[Path]:
    """The pages a user reads commands from: the README, then the user guide."""
    return [REPO / "README.md", *sorted((REPO / "docs" / "guide").glob("*.md"))]


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(page, words)`` for every ``hf-dspark <command>`` of the kinds in TINY in the pages' bash blocks,
    continuation lines joined and comments dropped; lines with ``[optional]`` syntax are not runnable as written and
    are left out."""
    commands = []
    for page in documentation():
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #", 1)[0].strip()
                if not line.startswith("hf-dspark ") or "[" in line:
                    continue
                words = shlex.split(line)
                if words[1] in TINY:
                    commands.append((str(page.relative_to(REPO)), words[1:]))
    return commands


def test_the_documentation_shows_each_command():
    assert sorted({words[0] for _, words in documented_commands()}) == sorted(TINY)


@pytest.mark.slow
@pytest.mark.parametrize("page, words", documented_commands(), ids=lambda x: x if isinstance(x, str) else x[0])
def test_a_documented_command_runs(page, words, tmp_path):
    require_smollm2()
    words = list(words)
    outputs = []
    for i, word in enumerate(words[:-1]):
        if word in OUTPUT_FLAGS:
            words[i + 1] = str(tmp_path / words[i + 1])
            outputs.append(words[i + 1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DSPARK_CACHE": os.environ.get("HF_DSPARK_CACHE", "")}
    env = {k: v for k, v in env.items() if v != ""}
    done = subprocess.run([sys.executable, "-m", "hf_dspark.cli", *words, *TINY[words[0]]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{page}: {shlex.join(words)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert outputs and all(os.path.exists(path) for path in outputs), (page, outputs)
