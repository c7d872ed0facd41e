"""The converted SmolLM2 folder: publishing it when several processes convert at once, and the conversion's shortcut
(``gguf_parsed_once``) giving what transformers gives without it."""

from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_parsing_the_gguf_once_loads_the_same_model_and_tokenizer():
    """``gguf_parsed_once`` (the conversion's shortcut) gives the weights, config and tokenizer transformers gives
    without it, and puts gguf and transformers back as they were."""
    import gguf
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dspark.target import gguf_parsed_once, smollm2_gguf_path
    from tests.helpers import require_smollm2

    require_smollm2()
    path = smollm2_gguf_path()

    def load():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return model, tokenizer

    originals = (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.load_gguf_checkpoint)
    with gguf_parsed_once():
        model, tokenizer = load()
    assert (gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.load_gguf_checkpoint) == originals
    stock_model, stock_tokenizer = load()
    assert model.config.to_dict() == stock_model.config.to_dict()
    ours, stock = model.state_dict(), stock_model.state_dict()
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in ours)
    text = "def f(x):\n    return x ** 2  # Hello, world!"
    assert tokenizer(text)["input_ids"] == stock_tokenizer(text)["input_ids"]
    assert tokenizer.get_vocab() == stock_tokenizer.get_vocab()
