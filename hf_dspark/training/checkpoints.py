"""Files that survive a crash: after ``kill -9`` or a power cut, a file or checkpoint folder is whole or ignored.

A file is written under a temporary name, flushed to disk and renamed over its final name, so readers, which look
only at final names, never see part of one. A checkpoint folder is complete once its ``COMPLETE`` marker, written
after every other file of the folder is on disk, holds its step. A run folder has up to three checkpoint folders;
``latest_checkpoint`` picks the complete one with the highest step, and ``promote`` swaps a new ``checkpoint-tmp``
in as ``checkpoint-last`` such that the newest complete checkpoint exists at every moment of the swap.

Standard library only: ``hub`` reads run folders through this module without importing the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

MARKER = "COMPLETE"
LAST, OLD, TMP = "checkpoint-last", "checkpoint-old", "checkpoint-tmp"
STATE = "trainer_state.json"
# the model card of the packaged drafter a run started from (--init-drafter), copied when the run starts: that folder
# may be re-packaged with this run's weights and card later, and the run's own card quotes how its start was trained
INIT_CARD = "init_drafter_card.md"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    """Put a folder's entries (creations, renames) on disk; POSIX only (Windows cannot open a folder)."""
    if os.name == "posix":
        _fsync(folder)


def publish(tmp: Path, final: Path) -> None:
    """Rename the fully written ``tmp`` to ``final`` once its bytes are on disk: ``final`` is absent or whole."""
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_atomic(path: Path, text: str) -> None:
    """Write a small text file through ``<name>.<pid>.tmp`` (workers of one job may write the same file at once) and
    ``publish``."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    publish(tmp, path)


def checkpoint_step(folder: Path) -> int | None:
    """The step of a complete checkpoint folder; None for an absent or unfinished one."""
    marker = folder / MARKER
    try:
        if marker.is_file():
            return int(marker.read_text(encoding="utf-8"))
        if folder.name in (LAST, OLD) and (folder / STATE).is_file():
            # No marker: a folder of the earlier rename-only scheme, which gave these names to finished folders only.
            return int(json.loads((folder / STATE).read_text(encoding="utf-8"))["step"])
    except (ValueError, KeyError, TypeError):
        pass
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint folder of a training run with the highest step (``checkpoint-last`` on a tie), or
    None when the run has none."""
    best, best_step = None, -1
    for name in (LAST, OLD, TMP):
        step = checkpoint_step(Path(run_dir) / name)
        if step is not None and step > best_step:
            best, best_step = Path(run_dir) / name, step
    return best


def mark_complete(folder: Path, step: int) -> None:
    """Declare ``folder`` the complete checkpoint of ``step``: every file in it reaches the disk before the marker."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            _fsync(path)
        else:
            _fsync_dir(path)
    _fsync_dir(folder)
    write_atomic(folder / MARKER, f"{step}\n")


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder, unmarked first: a crash midway leaves nothing that reads as complete."""
    if not folder.exists():
        return
    for name in (MARKER, STATE):
        (folder / name).unlink(missing_ok=True)
    _fsync_dir(folder)
    shutil.rmtree(folder)


def promote(run_dir: Path) -> None:
    """Make the complete ``checkpoint-tmp`` of ``run_dir`` its ``checkpoint-last``. The earlier ``checkpoint-last``
    is renamed to ``checkpoint-old`` and deleted only once the new one is in place; whatever ``checkpoint-old`` held
    before is older than ``checkpoint-tmp``."""
    tmp, last, old = run_dir / TMP, run_dir / LAST, run_dir / OLD
    if last.exists():
        remove_checkpoint(old)
        os.replace(last, old)
    os.replace(tmp, last)
    _fsync_dir(run_dir)
    remove_checkpoint(old)
