"""scripts/device_stage.sh trim / restore on a throwaway repository: the tree a device call sends keeps only the
package's code, the scripts and the tests (no weights), ignored files stay where they are, and restore puts every
moved file back unchanged, untracked ones included."""

import os
import shutil
import subprocess

from tests.helpers import REPO


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def _files(root):
    out = {}
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in names:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def test_trim_keeps_what_the_run_needs_and_restore_puts_everything_back(tmp_path):
    repo = tmp_path / "repo"
    files = {
        "hf_dspark/__init__.py": b"x = 1\n",
        "hf_dspark/drafters/d/config.json": b"{}",
        "hf_dspark/drafters/d/model.safetensors": b"weights",
        "scripts/device_stage.sh": (REPO / "scripts" / "device_stage.sh").read_bytes(),
        "tests/helpers.py": b"",
        "pyproject.toml": b"[project]\n",
        ".gitignore": b"/runs/\n",
        "data/shard.jsonl": b"{}\n" * 100,
        "README.md": b"# r\n",
    }
    for name, content in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(content)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "init")
    (repo / "reports").mkdir()
    (repo / "reports" / "untracked.json").write_text("{}")  # untracked, not ignored: it would travel
    (repo / "runs").mkdir()
    (repo / "runs" / "ckpt.safetensors").write_bytes(b"ignored weights")  # ignored: never sent, never moved
    before = _files(repo)
    trim = tmp_path / "trim"
    env = {**os.environ, "TRIM": str(trim)}
    result = subprocess.run(["bash", "scripts/device_stage.sh", "trim"], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=60)
    assert "moved 4 files" in result.stdout, result.stdout + result.stderr
    assert ".device1 is missing" in result.stdout  # sizes: nothing built here
    assert sorted(_files(repo)) == sorted(["hf_dspark/__init__.py", "hf_dspark/drafters/d/config.json",
                                           "scripts/device_stage.sh", "tests/helpers.py", "pyproject.toml",
                                           ".gitignore", "runs/ckpt.safetensors"])
    again = subprocess.run(["bash", "scripts/device_stage.sh", "trim"], cwd=repo, env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 2 and "restore" in again.stdout  # a second trim would mix two trims
    subprocess.run(["bash", "scripts/device_stage.sh", "restore"], cwd=repo, env=env, check=True, capture_output=True,
                   timeout=60)
    assert _files(repo) == before
    assert not trim.exists() or not any(trim.rglob("*"))
    shutil.rmtree(repo)
