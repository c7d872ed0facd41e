"""Publishing the converted SmolLM2 folder when several processes convert it at the same time."""

from pathlib import Path

from hf_dspark.target import _publish


def _folder(path: Path, marker: str, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_text(marker)
    if complete:
        (path / "tokenizer.json").write_text(marker)
    return path


def test_publish_moves_a_finished_conversion_into_place(tmp_path):
    tmp = _folder(tmp_path / ".tmp-a", "a")
    _publish(tmp, tmp_path / "target")
    assert (tmp_path / "target" / "model.safetensors").read_text() == "a"
    assert not tmp.exists()


def test_publish_keeps_a_complete_folder_another_process_published(tmp_path):
    # The other process's readers may already hold this folder's files: it must not be deleted or replaced.
    folder = _folder(tmp_path / "target", "other")
    tmp = _folder(tmp_path / ".tmp-a", "a")
    _publish(tmp, folder)
    assert (folder / "model.safetensors").read_text() == "other"
    assert (folder / "tokenizer.json").read_text() == "other"


def test_publish_replaces_an_incomplete_leftover(tmp_path):
    folder = _folder(tmp_path / "target", "half", complete=False)
    tmp = _folder(tmp_path / ".tmp-a", "a")
    _publish(tmp, folder)
    assert (folder / "model.safetensors").read_text() == "a"
    assert (folder / "tokenizer.json").read_text() == "a"
