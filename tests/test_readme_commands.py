"""The README's own `data`, `calibrate`, `eval`, `bench` and `bench-serve` examples run from a clone: each command is
read out of the README's bash blocks and run as written, its outputs moved under a temporary folder and its sizes cut
down by flags appended after the documented ones (the later value wins)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

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


def documented_commands() -> dict[str, list[str]]:
    """The first ``hf-dspark <command>`` of each kind in the README's bash blocks, continuation lines joined and
    comments dropped; lines with ``[optional]`` syntax are not runnable as written and are left out."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands: dict[str, list[str]] = {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #", 1)[0].strip()
            if not line.startswith("hf-dspark ") or "[" in line:
                continue
            words = shlex.split(line)
            if words[1] in TINY:
                commands.setdefault(words[1], words[1:])
    return commands


def test_the_readme_documents_each_command():
    assert sorted(documented_commands()) == sorted(TINY)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(TINY))
def test_a_documented_command_runs(command, tmp_path):
    require_smollm2()
    words = documented_commands()[command]
    outputs = []
    for i, word in enumerate(words[:-1]):
        if word in OUTPUT_FLAGS:
            words[i + 1] = str(tmp_path / words[i + 1])
            outputs.append(words[i + 1])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DSPARK_CACHE": os.environ.get("HF_DSPARK_CACHE", "")}
    env = {k: v for k, v in env.items() if v != ""}
    done = subprocess.run([sys.executable, "-m", "hf_dspark.cli", *words, *TINY[command]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(words)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert outputs and all(os.path.exists(path) for path in outputs), outputs
