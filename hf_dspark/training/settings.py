"""The training commands' settings, and the regenerated shards they read: standard library and
``transformers.hf_argparser`` only, so that ``hf-dspark data`` / ``train`` build their flags and refuse bad ones
without loading torch. ``data`` and ``trainer`` re-export what they used to define.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers.hf_argparser import HfArg

from ..prompts import SAMPLINGS

DEFAULT_LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "confidence": 1.0}  # the paper's defaults


@dataclass
class RegenerationSettings:
    """What the target regenerates: which prompts, in what order, sampled how (``help`` is the flag's text)."""

    prompt_paths: list[str] = field(metadata={
        "flag": "--prompts",
        "help": "prompt .jsonl files or folders (JSON Lines, one prompt per line: see data/README.md)"})
    shard_size: int = field(default=64, metadata={"help": "prompts per shard (the unit a rerun resumes from)",
                                                  "bounds": (1, None)})
    batch_size: int = field(default=16, metadata={"help": "prompts sampled at once", "bounds": (1, None)})
    max_new_tokens: int = field(default=256, metadata={"help": "longest response per turn", "bounds": (1, None)})
    temperature: float = field(default=0.2, metadata={"help": "sampling temperature (SmolLM2-Instruct's "
                                                                "recommended 0.2)", "bounds": (0, None)})
    top_p: float = field(default=0.9, metadata={"help": "nucleus sampling mass", "bounds": (0, 1)})
    seed: int = field(default=0, metadata={"help": "seed of the prompt order and the sampling"})
    max_prompts: int | None = field(default=None, metadata={"help": "regenerate at most this many prompts "
                                                                      "(default: all)", "bounds": (1, None)})
    dtype: str = field(default="bfloat16", metadata={"help": "the target's weight dtype",
                                                     "choices": ["bfloat16", "float16", "float32"]})
    exclude: list[str] = field(default_factory=list, metadata={
        "help": "prompts to skip: regenerated data folders, calibrated drafter folders (their calibration prompts) "
                "or text files of prompt ids, one per line (see prompts.excluded_prompt_ids)", "nargs": "*"})
    sampling: str = field(default="shuffled", metadata={
        "help": "order the prompts are taken in (and cut by --max-prompts): uniformly shuffled, or balanced "
                "round-robin over the prompt sets", "choices": SAMPLINGS})


@dataclass
class TrainingArguments:
    """A training run's settings; each field's ``help`` is its ``hf-dspark train`` flag's text."""

    output_dir: str = HfArg(help="run folder: checkpoints, logs, final drafter", metadata={"flag": "--output"})
    data_dirs: list[str] = HfArg(help="regenerated data folders (hf-dspark data)", metadata={"flag": "--data"})
    target: str | None = HfArg(default=None, help="target model folder or Hub id (default: SmolLM2-135M-Instruct)")
    features_dir: str | None = HfArg(default=None, help="cached target features (hf-dspark features); default: run "
                                     "the target online", metadata={"flag": "--features"})
    init_drafter: str | None = HfArg(default=None, help="start from this drafter folder instead of a fresh one")
    add_layers: int = HfArg(default=0, help="grow --init-drafter by N decoder layers, each a copy of its last layer "
                            "with zeroed output projections (attention o_proj, MLP down_proj): the grown drafter "
                            "starts as the same function", metadata={"metavar": "N", "bounds": (0, None)})
    # drafter shape (ignored with init_drafter)
    sequential_head: str = HfArg(default="markov", help="the drafter's sequential head",
                                 metadata={"choices": ["none", "markov", "gated", "rnn"]})
    block_size: int = HfArg(default=7, help="tokens the drafter proposes per round", metadata={"bounds": (1, None)})
    num_hidden_layers: int = HfArg(default=2, help="the drafter's decoder layers", metadata={"flag": "--num-layers"})
    markov_rank: int = HfArg(default=256, help="rank of the Markov sequential head")
    target_layer_ids: list[int] | None = HfArg(default=None, help="target layers whose hidden states the drafter "
                                               "reads, comma-separated, reference numbering (default: the "
                                               "drafter's)", metadata={"comma": True})
    enable_confidence_head: bool = HfArg(default=True, help="train a confidence head (--no-confidence-head: none)",
                                         metadata={"negative": "--no-confidence-head"})
    draft_vocab_size: int | None = HfArg(default=None, help="draft over the N most frequent response tokens of the "
                                         "training data (cheap drafting; default: the full vocabulary)")
    lora: bool = HfArg(default=False, help="PEFT LoRA fine-tuning of --init-drafter, merged into the final drafter")
    lora_rank: int = HfArg(default=16, help="LoRA rank")
    lora_alpha: int = HfArg(default=32, help="LoRA alpha")
    lora_target_modules: list[str] = HfArg(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc"],
        help="modules LoRA adapts")
    # optimisation
    max_steps: int = HfArg(default=1000, help="optimizer steps", metadata={"bounds": (1, None)})
    learning_rate: float = HfArg(default=6e-4, help="peak learning rate (warm-up, then cosine decay)",
                                 aliases=["--lr"], metadata={"bounds": (0, None)})
    warmup_ratio: float = HfArg(default=0.04, help="share of the steps spent warming up", metadata={"bounds": (0, 1)})
    weight_decay: float = HfArg(default=0.0, help="AdamW weight decay")
    max_grad_norm: float = HfArg(default=1.0, help="gradient clipping norm")
    batch_size: int = HfArg(default=4, help="sequences per micro-batch (per process)", metadata={"bounds": (1, None)})
    gradient_accumulation_steps: int = HfArg(default=1, help="micro-batches per optimizer step",
                                             aliases=["--grad-accum"], metadata={"bounds": (1, None)})
    max_length: int = HfArg(default=512, help="longest training sequence (tokens)", metadata={"bounds": (1, None)})
    num_anchors: int = HfArg(default=64, help="anchor positions sampled per sequence", metadata={"bounds": (1, None)})
    gamma: float = HfArg(default=4.0, help="decay of the loss weight along the block")
    loss_weights: dict[str, float] = HfArg(default_factory=lambda: dict(DEFAULT_LOSS_WEIGHTS),
                                           help="weights of the loss terms", metadata={"cli": False})
    confidence_target: str = HfArg(default="sampling", help="what the confidence head predicts: the sampling "
                                   "acceptance rate 1 - TV (the paper's) or the greedy argmax match (0/1)",
                                   metadata={"choices": ["sampling", "greedy"]})
    train_modules: list[str] | None = HfArg(default=None, help="train only the parameters under these module names "
                                            "(e.g. confidence_head), the rest frozen (default: all)",
                                            metadata={"metavar": "MODULE"})
    mixed_precision: str = HfArg(default="no", help="bf16 autocast; auto: where the device multiplies bf16 natively "
                                 "(CUDA, AVX512-BF16 or AMX CPUs: bf16_is_fast), else float32",
                                 metadata={"choices": ["no", "bf16", "auto"]})
    target_dtype: str = HfArg(default="float32", help="the target's weight dtype",
                              metadata={"choices": ["bfloat16", "float16", "float32"]})
    torch_compile: bool = HfArg(default=False, help="compile the drafter's decoder layers and the vocabulary-wide "
                                "loss terms with torch.compile (the first steps compile: pays on runs of more than a "
                                "few hundred steps)")
    seed: int = HfArg(default=0, help="seed of the initialization, data order and anchors")
    # bookkeeping
    save_every: int = HfArg(default=100, help="steps between checkpoints", metadata={"bounds": (1, None)})
    log_every: int = HfArg(default=10, help="steps between log lines", metadata={"bounds": (1, None)})
    eval_data_dirs: list[str] | None = HfArg(default=None, help="held-out regenerated-data folders: held-out "
                                             "accepted length, per-position acceptance and losses in "
                                             "OUTPUT/eval_log.jsonl (at the start, every --eval-every steps, the end)",
                                             metadata={"flag": "--eval-data"})
    eval_every: int = HfArg(default=0, help="steps between held-out evaluations (0: only at the start and the end)",
                            metadata={"bounds": (0, None)})
    eval_sequences: int = HfArg(default=64, help="held-out sequences evaluated (a fixed sample)",
                                metadata={"bounds": (1, None)})
    init_layers_from_target: list[int] | None = HfArg(default=None, help="comma-separated target layer per drafter "
                                                      "layer (0-based), e.g. 28,29: start the drafter's layers from "
                                                      "those target layers instead of random weights",
                                                      metadata={"comma": True, "metavar": "IDS"})
    threads: int | None = HfArg(default=None, help="torch CPU threads (default: torch's choice)",
                                metadata={"bounds": (1, None)})


def list_shards(data_dirs: list[str]) -> list[str]:
    """The finished shards of regenerated folders, folder by folder in shard order."""
    shards = []
    for d in data_dirs:
        found = sorted(str(p) for p in Path(d).glob("shard-*.jsonl"))
        if not found:
            raise FileNotFoundError(f"no finished shards (shard-*.jsonl) in {d}")
        shards.extend(found)
    return shards


__all__ = ["DEFAULT_LOSS_WEIGHTS", "RegenerationSettings", "TrainingArguments", "list_shards"]
