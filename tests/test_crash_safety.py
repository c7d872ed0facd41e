"""A crash at any point of writing a checkpoint, a data shard or a features shard loses nothing that was finished,
and the files a run reads back hold no pickled objects."""

import builtins
import contextlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hf_dspark import DSparkDrafter
from hf_dspark.hub import training_text
from hf_dspark.training import data as data_module
from hf_dspark.training import features as features_module
from hf_dspark.training.checkpoints import LAST, MARKER, OLD, TMP, checkpoint_step, latest_checkpoint
from hf_dspark.training.data import RegenerationSettings, regenerate
from hf_dspark.training.features import FeatureStore, cache_features
from hf_dspark.training.trainer import DSparkTrainer, list_shards
from tests.test_trainer import make_args, write_regenerated


class Crash(BaseException):
    """A ``kill -9``: a BaseException, so no ``except Exception`` in the code under test runs anything after it."""


class _CrashingFile:
    """A file opened for writing whose ``write`` calls are crash points; the crashing call writes half its data."""

    def __init__(self, file, point):
        self._file, self._point = file, point

    def write(self, data):
        try:
            self._point("write", self._file.name)
        except Crash as crash:
            if crash.args[1]:  # the first failing operation: the process dies halfway through this write
                self._file.write(data[: len(data) // 2])
                self._file.flush()
            raise
        return self._file.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


@contextlib.contextmanager
def crash_points(crash_at: int | None = None):
    """Record the file operations run inside the block (``ops``: (kind, path) pairs) and, with ``crash_at``, crash
    at operation number ``crash_at`` (1-based) and at every one after it, like a dead process. ``save_pretrained``,
    ``torch.save``, safetensors' ``save_file`` and ``shutil.rmtree`` count as one operation each. ``fsync`` is no
    crash point: a killed process loses nothing the page cache holds, so dying there is dying before the next one."""
    ops: list[tuple[str, str]] = []
    depth = [0]  # > 0 inside an operation counted as one

    def point(kind, path):
        if depth[0]:
            return
        ops.append((kind, str(path)))
        if crash_at is not None and len(ops) >= crash_at:
            raise Crash(f"crash at operation {len(ops)}: {kind} {path}", len(ops) == crash_at)

    def step(kind, fn, whole=False):
        def wrapper(*args, **kwargs):
            point(kind, next((a for a in args if isinstance(a, (str, os.PathLike))), ""))
            depth[0] += whole
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= whole
        return wrapper

    real_open = builtins.open

    def crashing_open(file, mode="r", *args, **kwargs):
        if depth[0] or not any(c in mode for c in "wax+"):
            return real_open(file, mode, *args, **kwargs)
        point("open", file)
        return _CrashingFile(real_open(file, mode, *args, **kwargs), point)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "open", crashing_open)
        mp.setattr(io, "open", crashing_open)  # pathlib's write_text
        for name in ("replace", "unlink"):
            mp.setattr(os, name, step(name, getattr(os, name)))
        mp.setattr(shutil, "rmtree", step("rmtree", shutil.rmtree, whole=True))
        mp.setattr(torch, "save", step("torch.save", torch.save, whole=True))
        mp.setattr(DSparkDrafter, "save_pretrained", step("save_pretrained", DSparkDrafter.save_pretrained, whole=True))
        mp.setattr(features_module, "save_file", step("save_file", features_module.save_file, whole=True))
        yield ops


# ------------------------------------------------------------------------------------------------------------------
# Trainer checkpoints
# ------------------------------------------------------------------------------------------------------------------
MAX_STEPS = 8


@pytest.fixture(scope="module")
def template(tiny_targets, tmp_path_factory):
    """Run folders to crash in: ``clean`` holds a complete checkpoint of step 1 (one real optimizer step);
    ``mid-swap`` is what a crash between the two renames of the next save leaves: ``checkpoint-old`` (step 1) and a
    complete ``checkpoint-tmp`` (step 2), no ``checkpoint-last``."""
    root = tmp_path_factory.mktemp("crash")
    target = tiny_targets["llama"]
    write_regenerated(root / "data", target, n=8)
    trainer = DSparkTrainer(run_args(root, root / "clean"), target=target)
    trainer.train(progress=False, stop_at_step=1)
    stamp(trainer, 1)
    trainer.save_checkpoint()
    shutil.copytree(root / "clean", root / "mid-swap")
    trainer = resume(root, root / "mid-swap", target)
    trainer.step = 2
    stamp(trainer, 2)
    real_replace = os.replace

    def die_at_swap(src, dst):
        if Path(src).name == TMP:
            raise Crash("between the renames", True)
        return real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", die_at_swap)
        with pytest.raises(Crash):
            trainer.save_checkpoint()
    assert not (root / "mid-swap" / LAST).exists() and checkpoint_step(root / "mid-swap" / OLD) == 1
    assert checkpoint_step(root / "mid-swap" / TMP) == 2
    return root, target


def run_args(root: Path, output: Path):
    return make_args(root, "", output_dir=str(output), max_steps=MAX_STEPS, save_every=100)


def stamp(trainer, step):
    """Mark the drafter's weights with the step, so a resumed run shows which checkpoint its weights came from."""
    with torch.no_grad():
        trainer._unwrapped.norm.weight.fill_(float(step))


def resume(root, output, target):
    trainer = DSparkTrainer(run_args(root, output), target=target)
    assert torch.all(trainer._unwrapped.norm.weight == float(trainer.step)), "weights of another checkpoint"
    return trainer


@pytest.mark.parametrize("start", ["clean", "mid-swap"])
@pytest.mark.parametrize("kinds", [("open", "write"), ("save_pretrained", "torch.save"), ("replace",),
                                   ("unlink", "rmtree")], ids=lambda k: "+".join(k))
def test_checkpoint_survives_a_crash_at_every_point(template, tmp_path, start, kinds):
    """A save (of step n + 1, from a run resumed at step n) dies at each file operation of ``kinds`` in turn; the
    next run resumes from step n + 1 once the new checkpoint's marker is in place, from step n before, and its own
    save leaves one clean checkpoint."""
    root, target = template
    previous = {"clean": 1, "mid-swap": 2}[start]

    def crashing_save(case: Path, crash_at=None):
        shutil.copytree(root / start, case)
        trainer = resume(root, case, target)
        assert trainer.step == previous
        trainer.step += 1
        stamp(trainer, trainer.step)
        with crash_points(crash_at) as ops:
            trainer.save_checkpoint()
        return ops

    ops = crashing_save(tmp_path / "dry")
    assert checkpoint_step(tmp_path / "dry" / LAST) == previous + 1
    marker = next(i for i, (kind, path) in enumerate(ops, 1)
                  if kind == "replace" and Path(path).parent.name == TMP and Path(path).name.startswith(MARKER))
    points = [i for i, (kind, _) in enumerate(ops, 1) if kind in kinds]
    assert points, f"no {kinds} operation in a save: {ops}"
    for crash_at in points:
        case = tmp_path / f"crash-{crash_at}"
        with pytest.raises(Crash):
            crashing_save(case, crash_at)
        expected = previous + 1 if crash_at > marker else previous
        resumed = resume(root, case, target)
        assert resumed.step == expected, f"crash at {ops[crash_at - 1]}"
        resumed.step += 1
        stamp(resumed, resumed.step)
        resumed.save_checkpoint()
        assert sorted(p.name for p in case.glob("checkpoint-*")) == [LAST], f"crash at {ops[crash_at - 1]}"
        assert checkpoint_step(case / LAST) == expected + 1


def test_hub_and_resume_read_the_newest_complete_checkpoint(template, tmp_path):
    """Model cards describe the checkpoint a run would resume from; a checkpoint-last without a marker (the
    rename-only scheme before markers) counts as complete, an unmarked checkpoint-tmp never does."""
    root, target = template
    run = tmp_path / "run"
    shutil.copytree(root / "mid-swap", run)
    assert latest_checkpoint(run) == run / TMP
    assert "- Budget: 2 steps x" in training_text(run)
    shutil.rmtree(run / TMP)
    os.replace(run / OLD, run / LAST)
    (run / LAST / MARKER).unlink()
    (run / TMP).mkdir()
    (run / TMP / "trainer_state.json").write_text(json.dumps({"step": 9}))
    assert latest_checkpoint(run) == run / LAST
    assert "- Budget: 1 steps x" in training_text(run)
    assert resume(root, run, target).step == 1


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_tampered_training_state_is_refused(template, tmp_path, capsys, how):
    root, target = template
    shutil.copytree(root / "clean", tmp_path / "run")
    path = tmp_path / "run" / LAST / "training_state.pt"
    blob = torch.load(path, weights_only=True)
    blob["scheduler"]["lr_lambdas"] = [_Payload()]
    if how == "torch.save":
        torch.save(blob, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(blob, f)
    with pytest.raises(ValueError, match=r"training_state\.pt holds objects other than tensors") as info:
        DSparkTrainer(run_args(root, tmp_path / "run"), target=target)
    assert str(path) in str(info.value)
    assert "unpickled" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------------------------
# Data and features shards
# ------------------------------------------------------------------------------------------------------------------
class _CharTokenizer:
    """Just what regeneration asks of a tokenizer: one id per character of the conversation, a decode, a pad id."""

    pad_token_id, eos_token_id = 0, None

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [2 + ord(c) % 100 for m in messages for c in m["content"]][-12:]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def finished_files(folder: Path, finished) -> dict:
    """What a reader sees of a folder: the contents of its finished files (a safetensors file's tensors and
    metadata, whose byte order is not fixed; any other file's bytes)."""
    contents = {}
    for path in sorted(folder.iterdir()) if folder.exists() else []:
        if not finished(path.name):
            continue
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as f:
                contents[path.name] = (f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()})
        else:
            contents[path.name] = path.read_bytes()
    return contents


def check_crashes(run, finished, tmp_path) -> dict:
    """Crash ``run(folder)`` at every file operation in turn: every finished file it leaves is the one a clean run
    writes, and running again completes the folder."""
    with crash_points() as ops:
        run(tmp_path / "clean")
    reference = finished_files(tmp_path / "clean", finished)
    for crash_at in range(1, len(ops) + 1):
        folder = tmp_path / f"crash-{crash_at}"
        with pytest.raises(Crash):
            with crash_points(crash_at):
                run(folder)
        left = finished_files(folder, finished)
        assert all(reference[n] == c for n, c in left.items()), f"partial file after a crash at {ops[crash_at - 1]}"
        run(folder)
        assert finished_files(folder, finished) == reference, f"after a crash at {ops[crash_at - 1]}"
    return reference


def test_data_shards_are_whole_or_absent_after_a_crash(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "domain": "chat", "turns": [f"say {i}"]}) + "\n"
                               for i in range(3)))
    settings = RegenerationSettings(prompt_paths=[str(prompts)], shard_size=2, batch_size=2, dtype="float32")
    # the target's answer: the prompt's last two ids (what is written matters here, not how it is sampled)
    monkeypatch.setattr(data_module, "_generate_batch", lambda target, tokenizer, batch, *_: [p[-2:] for p in batch])

    def run(folder):
        regenerate(None, _CharTokenizer(), folder, settings, progress=False)

    def finished(name):
        return name.startswith("shard-") and name.endswith(".jsonl") or name == "manifest.json"

    reference = check_crashes(run, finished, tmp_path)
    assert sorted(reference) == ["manifest.json", "shard-00000.jsonl", "shard-00001.jsonl"]


def test_features_shards_are_whole_or_absent_after_a_crash(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    write_regenerated(tmp_path / "a", target, n=3)
    write_regenerated(tmp_path / "b", target, n=2, seed=5)
    shards = list_shards([str(tmp_path / "a"), str(tmp_path / "b")])

    def run(folder):
        cache_features(target, shards, folder, [0, 2], 64, dtype=torch.float32, progress=False)

    def finished(name):
        return name.endswith(".safetensors") or name == "features.json"

    reference = check_crashes(run, finished, tmp_path)
    assert len(reference) == 3
    assert len(FeatureStore(tmp_path / "crash-1", shards, [0, 2], 64)) == 5
