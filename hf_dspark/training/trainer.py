"""DSpark drafter trainer: online target features (or a feature cache), CE / TV / confidence losses, AdamW with
transformers' warm-up + cosine schedule, gradient clipping and accumulation, bf16/fp32, exact resume, JSONL (+ TensorBoard) logs.

Runs the same code on one CPU or, through ``accelerate launch``, on several GPUs / nodes: ``Accelerator`` handles
device placement, data-parallel gradients and mixed precision.

Resume is exact: a checkpoint holds the drafter, optimizer, scheduler, every RNG state and the data position
(epoch, batches consumed). It is written to ``checkpoint-tmp``, marked complete once on disk, then swapped in as
``checkpoint-last`` (``checkpoints.promote``); a restarted run continues from the newest complete checkpoint, so
``kill -9`` at any moment loses at most the steps since the last save. The optimizer / scheduler / RNG file loads
without unpickling objects (``torch.load(weights_only=True)``): a file holding anything else is refused.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import get_cosine_schedule_with_warmup

from ..allocator import keep_freed_memory
from ..configuration_dspark import DSparkConfig
from ..cpu_features import cpu_flags, multiplies_natively
from ..modeling_dspark import DSparkDrafter
from .checkpoints import INIT_CARD, STATE, TMP, latest_checkpoint, mark_complete, promote, remove_checkpoint, write_atomic
from .data import load_sequences
from .features import FeatureStore
from .initialization import grow_layers, init_layers_from_target, init_output_norm_from_target
from .losses import drafter_training_step, leading_matches
from .settings import TrainingArguments, list_shards
from .vocab import frequent_tokens, special_token_ids

logger = logging.getLogger(__name__)


MIXED_PRECISION = ("no", "bf16", "auto")


def bf16_is_fast(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or
    AMX-BF16 instructions. Elsewhere bf16 matrix products are emulated and slower than float32 (on an AVX2-only CPU,
    by two orders of magnitude), so autocast would cost instead of pay."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and multiplies_natively("bfloat16", cpu_flags())


def resolve_mixed_precision(choice: str, device: torch.device | str) -> str:
    """``"auto"`` -> ``"bf16"`` where ``bf16_is_fast(device)``, else ``"no"``; the other choices as they are."""
    if choice not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {choice!r}")
    if choice == "auto":
        return "bf16" if bf16_is_fast(device) else "no"
    return choice


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------
def collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for row, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[row, :n] = torch.tensor(b["input_ids"])
        mask[row, :n] = torch.tensor(b["loss_mask"], dtype=torch.bool)
        attention[row, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attention}


def epoch_order(num_sequences: int, seed: int, epoch: int) -> list[int]:
    order = list(range(num_sequences))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def _make_accelerator(args: TrainingArguments):
    """The resolved mixed precision and the ``Accelerator`` of a run (after applying ``args.threads``)."""
    from accelerate import Accelerator

    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and keep_freed_memory():
        logger.info("glibc keeps freed memory for reuse (no fresh pages per step)")
    mixed_precision = resolve_mixed_precision(args.mixed_precision, device)
    accelerator = Accelerator(
        mixed_precision=mixed_precision, gradient_accumulation_steps=args.gradient_accumulation_steps
    )
    if args.mixed_precision == "auto":
        logger.info("mixed precision: %s (%s bfloat16 products on %s)", mixed_precision,
                    "native" if mixed_precision == "bf16" else "no native", device)
    return mixed_precision, accelerator


# ------------------------------------------------------------------------------------------------------------------
# Trainer
# ------------------------------------------------------------------------------------------------------------------
class DSparkTrainer:
    def __init__(self, args: TrainingArguments, target=None, tokenizer=None):
        self.args = args
        self.mixed_precision, self.accelerator = _make_accelerator(args)
        self.output_dir = Path(args.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.resume_dir = latest_checkpoint(self.output_dir)  # None: a new run
        state = self._read_state()
        if target is None:
            target, tokenizer = _load_target(args.target, args.target_dtype)
        self.target = target.to(self.accelerator.device).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self._set_up_drafter(state)
        self._load_data(state)
        if not state and not args.init_drafter and self.drafter.draft_vocab is not None:
            self._choose_draft_vocab()
        self.optimizer = self._build_optimizer()
        if args.torch_compile:
            for layer in self.drafter.layers:  # regional compilation: the layers compiled, the rest eager
                layer.compile()
        # transformers' schedule (the one its Trainer uses): linear warm-up from 0, then a half cosine to 0. Its
        # LambdaLR saves and restores with the checkpoint, so a resumed run continues the same curve.
        self.scheduler = get_cosine_schedule_with_warmup(
            self.optimizer, num_warmup_steps=max(1, int(args.warmup_ratio * args.max_steps)),
            num_training_steps=args.max_steps)
        # The whole loss runs inside one module's forward, so data-parallel wrappers see every parameter used.
        loss_module = _LossModule(self.drafter, args.num_anchors, args.gamma, args.loss_weights,
                                  args.confidence_target, args.torch_compile)
        self.loss_module, self.optimizer = self.accelerator.prepare(loss_module, self.optimizer)
        self.step, self.epoch, self.position = 0, 0, 0
        # training seconds of earlier sessions of this run (kept in the checkpoint, so a resumed run's logs and card
        # report the whole budget), and when this session's clock started
        self.elapsed_before = 0.0
        self._started: float | None = None  # when train() started its clock; None outside train()
        if state:
            self._load_checkpoint(state)
        self.pad_id = (tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
        self.hidden_indices = self._unwrapped.target_hidden_states_indices()
        self.last_index = self.target.config.get_text_config().num_hidden_layers

    @property
    def _unwrapped(self) -> DSparkDrafter:
        return self.accelerator.unwrap_model(self.loss_module).drafter

    # -- construction ------------------------------------------------------------------------------------------
    def _read_state(self) -> dict | None:
        if self.resume_dir is None:
            return None
        state = json.loads((self.resume_dir / STATE).read_text())
        saved = state["args"]
        for key in ("sequential_head", "block_size", "num_hidden_layers", "markov_rank", "max_steps", "seed",
                    "batch_size", "gradient_accumulation_steps", "num_anchors", "confidence_target", "train_modules",
                    "init_layers_from_target", "add_layers"):
            if saved.get(key, 0 if key == "add_layers" else None) != getattr(self.args, key):
                raise ValueError(
                    f"{self.output_dir} holds a run with {key}={saved.get(key)!r}, now {getattr(self.args, key)!r}; "
                    "resume with the same settings or use a new --output"
                )
        return state

    def _freeze_except(self, modules: list[str]) -> None:
        """Train only the parameters under ``modules`` (names of the drafter's submodules); freeze the rest."""
        if self.args.lora:
            raise ValueError("train_modules and lora both choose what trains: pass one of them")
        names = {name for name, _ in self.drafter.named_modules() if name}
        unknown = [m for m in modules if m not in names]
        if unknown:
            top = sorted(name for name in names if "." not in name)
            raise ValueError(f"train_modules: no drafter module named {unknown}; top-level modules are {top}")
        trained = 0
        for name, param in self.drafter.named_parameters():
            param.requires_grad_(any(name == m or name.startswith(m + ".") for m in modules))
            trained += param.numel() if param.requires_grad else 0
        if not trained:
            raise ValueError(f"train_modules {modules} hold no trainable parameters")
        logger.info("training %d parameters of %s; the rest of the drafter is frozen", trained, modules)

    def _apply_lora(self, state: dict | None):
        """Inject LoRA adapters in place (the drafter keeps its class; only adapter weights train)."""
        from peft import LoraConfig, PeftModel, get_peft_model

        if not self.args.init_drafter:
            raise ValueError("--lora fine-tunes an existing drafter: pass --init-drafter")
        if state:
            return PeftModel.from_pretrained(self.drafter, self.resume_dir / "adapter", is_trainable=True)
        config = LoraConfig(r=self.args.lora_rank, lora_alpha=self.args.lora_alpha,
                            target_modules=self.args.lora_target_modules, lora_dropout=0.0, bias="none")
        return get_peft_model(self.drafter, config)

    def _keep_init_card(self) -> None:
        """Copy the starting drafter's model card into the run folder, so the run's card quotes how that drafter was
        trained even after its folder is re-packaged with this run's weights."""
        card = Path(self.args.init_drafter) / "README.md"
        if card.is_file() and self.accelerator.is_main_process:
            write_atomic(self.output_dir / INIT_CARD, card.read_text(encoding="utf-8"))

    def _build_drafter(self, state: dict | None) -> DSparkDrafter:
        if state and not self.args.lora:
            return DSparkDrafter.from_pretrained(self.resume_dir / "drafter", dtype=torch.float32)
        if self.args.init_drafter:
            if self.args.init_layers_from_target is not None:
                raise ValueError("init_layers_from_target starts a new drafter; it cannot be combined with "
                                 "init_drafter")
            drafter = DSparkDrafter.from_pretrained(self.args.init_drafter, dtype=torch.float32)
            if self.args.add_layers:
                if self.args.lora:
                    raise ValueError("add_layers grows the drafter's backbone; LoRA trains adapters on the layers it "
                                     "has: pass one of them")
                grow_layers(drafter, self.args.add_layers)
            if self._trains_confidence_head():  # an untouched head keeps its temperatures and its label
                if drafter.config.confidence_temperatures is not None:
                    # STS temperatures were fitted to the old head; they would miscalibrate the new one.
                    logger.warning("dropping the STS temperatures of %s: the confidence head trains, so they no "
                                   "longer fit it (recalibrate with hf-dspark calibrate)", self.args.init_drafter)
                    drafter.config.confidence_temperatures = None
                drafter.config.confidence_target = self.args.confidence_target
            return drafter
        if self.args.add_layers:
            raise ValueError("add_layers grows an existing drafter: pass init_drafter")
        overrides = dict(
            num_hidden_layers=self.args.num_hidden_layers, block_size=self.args.block_size,
            sequential_head=self.args.sequential_head, markov_rank=self.args.markov_rank,
            enable_confidence_head=self.args.enable_confidence_head,
            confidence_head_with_markov=self.args.sequential_head != "none",
            draft_vocab_size=self.args.draft_vocab_size,
        )
        if self.args.target_layer_ids is not None:
            overrides["target_layer_ids"] = self.args.target_layer_ids
        torch.manual_seed(self.args.seed)
        overrides["confidence_target"] = self.args.confidence_target
        config = DSparkConfig.for_target(self.target.config, **overrides)
        drafter = DSparkDrafter(config).to(torch.float32)
        init_output_norm_from_target(drafter, self.target)
        if self.args.init_layers_from_target is not None:
            kept = init_layers_from_target(drafter, self.target, self.args.init_layers_from_target)
            logger.info("drafter layers start from target layers %s (kept their own init: %s)",
                        self.args.init_layers_from_target, kept)
        return drafter

    def _set_up_drafter(self, state: dict | None) -> None:
        """The drafter (resumed, loaded or new) attached to the target, with LoRA adapters or frozen modules as the
        arguments ask, in training mode."""
        self.drafter = self._build_drafter(state)
        self.drafter.attach_target(self.target)
        if not state and self.args.init_drafter:
            self._keep_init_card()
        self.peft_model = self._apply_lora(state) if self.args.lora else None
        if self.args.train_modules:
            self._freeze_except(self.args.train_modules)
        self.drafter.train()

    def _choose_draft_vocab(self) -> None:
        """Give a new drafter the draft vocabulary of the tokens most frequent in the training responses."""
        vocab, coverage = frequent_tokens(self.sequences, self.args.draft_vocab_size, self._special_ids())
        self.drafter.set_draft_vocab(vocab)
        self.draft_vocab_coverage = coverage
        logger.info("draft vocabulary: %d tokens cover %.2f%% of response tokens", len(vocab), 100 * coverage)

    def _build_optimizer(self) -> torch.optim.AdamW:
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        # The fused AdamW updates every tensor in one kernel per step (CPU and CUDA; the same arithmetic).
        fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
        return torch.optim.AdamW(params, lr=self.args.learning_rate, weight_decay=self.args.weight_decay,
                                 betas=(0.9, 0.95), fused=fused or None)

    def _trains_confidence_head(self) -> bool:
        if self.args.lora or not self.args.enable_confidence_head:
            return False
        modules = self.args.train_modules
        return not modules or any(m == "confidence_head" or m.startswith("confidence_head.") for m in modules)

    def _special_ids(self) -> list[int]:
        return special_token_ids(self.target.generation_config)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if not self.accelerator.is_main_process:
            return
        tmp = self.output_dir / TMP
        if latest_checkpoint(self.output_dir) == tmp:
            promote(self.output_dir)  # this run resumed from a checkpoint a crash left before its swap
        remove_checkpoint(tmp)
        tmp.mkdir()
        if self.peft_model is not None:
            self.peft_model.save_pretrained(tmp / "adapter")
        else:
            self._unwrapped.save_pretrained(tmp / "drafter")
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            },
            tmp / "training_state.pt",
        )
        state = {"args": asdict(self.args), "step": self.step, "epoch": self.epoch, "position": self.position,
                 "shards": self.shards, "elapsed_s": self._elapsed()}
        (tmp / STATE).write_text(json.dumps(state, indent=2))
        mark_complete(tmp, self.step)
        promote(self.output_dir)

    def _elapsed(self) -> float:
        """Seconds of training so far, over every session of this run (the clock runs only inside train())."""
        return self.elapsed_before + (0.0 if self._started is None else time.time() - self._started)

    def _load_checkpoint(self, state: dict) -> None:
        blob = load_training_state(self.resume_dir / "training_state.pt")
        self.optimizer.load_state_dict(blob["optimizer"])
        self.scheduler.load_state_dict(blob["scheduler"])
        torch.set_rng_state(blob["rng"]["torch"])
        random.setstate(blob["rng"]["python"])
        self.step, self.epoch, self.position = state["step"], state["epoch"], state["position"]
        self.elapsed_before = state.get("elapsed_s", 0.0)  # absent in checkpoints written before it was kept
        logger.info("resumed from step %d", self.step)

    def _log_eval(self, writer) -> dict | None:
        """Evaluate on the main process and append the result to ``eval_log.jsonl`` (and TensorBoard)."""
        result = None
        if self.accelerator.is_main_process:
            result = {"step": self.step, **self.evaluate()}
            with open(self.output_dir / "eval_log.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
            if writer is not None:
                for k, v in result.items():
                    if isinstance(v, float):
                        writer.add_scalar(f"eval/{k[5:]}", v, self.step)
            logger.info("step %d: held-out accepted length %.3f, accuracy %.3f", self.step,
                        result["eval_accepted_length"], result["eval_accuracy"])
        self.accelerator.wait_for_everyone()
        return result

    # -- data --------------------------------------------------------------------------------------------------
    def _load_data(self, state: dict | None) -> None:
        """The training sequences (from the shards a resumed run started with), the features cache if given, and
        the held-out sequences if given."""
        self.shards = state["shards"] if state else list_shards(self.args.data_dirs)
        self.sequences = load_sequences(self.shards, self.args.max_length)
        self.features = None
        if self.args.features_dir:
            self.features = FeatureStore(self.args.features_dir, self.shards, self.drafter.config.target_layer_ids,
                                         self.args.max_length)
        self.eval_sequences = self._load_eval_sequences() if self.args.eval_data_dirs else None

    def _next_batch(self) -> dict[str, torch.Tensor]:
        per_step = self.args.batch_size * self.accelerator.num_processes
        order = epoch_order(len(self.sequences), self.args.seed, self.epoch)
        if self.position + per_step > len(order):
            self.epoch, self.position = self.epoch + 1, 0
            order = epoch_order(len(self.sequences), self.args.seed, self.epoch)
        chunk = order[self.position : self.position + per_step]
        self.position += per_step
        mine = chunk[self.accelerator.process_index :: self.accelerator.num_processes]
        batch = collate([self.sequences[i] for i in mine], self.pad_id)
        batch["index"] = torch.tensor(mine)
        return batch

    def _load_eval_sequences(self) -> list[dict]:
        """Held-out sequences (a fixed sample of ``eval_sequences``), refused if any shares a prompt with the
        training data."""
        if self.args.eval_sequences < 1:
            raise ValueError(f"eval_sequences must be >= 1, got {self.args.eval_sequences}")
        if self.args.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: evaluate at the start and the end only), got "
                             f"{self.args.eval_every}")
        sequences = load_sequences(list_shards(self.args.eval_data_dirs), self.args.max_length)
        train_ids = {seq["id"] for seq in self.sequences if seq["id"] is not None}
        shared = sorted({seq["id"] for seq in sequences if seq["id"] in train_ids})
        if shared:
            raise ValueError(f"the evaluation data shares {len(shared)} prompts with the training data (e.g. "
                             f"{shared[:3]}): held-out metrics need prompts the drafter does not train on")
        order = list(range(len(sequences)))
        random.Random(self.args.seed).shuffle(order)
        return [sequences[i] for i in sorted(order[: self.args.eval_sequences])]

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out metrics of the drafter as it is now, on the fixed evaluation sample with fixed anchors: the
        losses, token accuracy, ``eval_position_match`` (per block position, the fraction of blocks where the draft's
        argmax is the target's, previous tokens teacher-forced: unconditional, unlike the paper's position-wise
        acceptance), and the accepted length tau a whole-block greedy verification would give (one plus the mean
        number of leading matches, over blocks with all g positions inside the response)."""
        if not self.eval_sequences:
            raise ValueError("no evaluation data: pass eval_data_dirs (--eval-data)")
        drafter = self._unwrapped
        was_training = drafter.training
        drafter.eval()
        generator = torch.Generator()
        totals: dict[str, float] = {}
        matches = torch.zeros(drafter.config.block_size, dtype=torch.float64)  # per position, over all blocks
        valid = torch.zeros_like(matches)
        accepted, blocks, batches = 0, 0, 0
        size = self.args.batch_size
        for start in range(0, len(self.eval_sequences), size):
            chunk = self.eval_sequences[start : start + size]
            batch = {k: v.to(self.accelerator.device) for k, v in collate(chunk, self.pad_id).items()}
            features, last_hidden = self._online_features(batch)
            generator.manual_seed(self.args.seed * 7919 + 104_729 + start)  # the same anchors at every evaluation
            out = drafter_training_step(drafter, features, last_hidden, batch["input_ids"], batch["loss_mask"],
                                        num_anchors=self.args.num_anchors, gamma=self.args.gamma,
                                        weights=self.args.loss_weights, generator=generator,
                                        confidence_target=self.args.confidence_target)
            for k, v in out.items():
                if v.dim() == 0:
                    totals[k] = totals.get(k, 0.0) + float(v)
            batches += 1
            m = out["greedy_matches"].flatten(0, 1)  # [blocks, g]
            v = out["valid"].flatten(0, 1)
            matches += m.sum(0).double().cpu()
            valid += v.sum(0).double().cpu()
            leading = leading_matches(m, v)
            accepted += int(leading.sum())
            blocks += leading.numel()
        if was_training:
            drafter.train()
        result = {f"eval_{k}": v / batches for k, v in totals.items()}
        result["eval_position_match"] = (matches / valid.clamp(min=1)).tolist()
        result["eval_accepted_length"] = 1.0 + accepted / max(blocks, 1)
        result["eval_blocks"] = blocks
        result["eval_sequences"] = len(self.eval_sequences)
        return result

    @torch.no_grad()
    def _online_features(self, batch):
        out = self.target(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=self.hidden_indices + [self.last_index],
            logits_to_keep=1,
        )
        hidden = self._unwrapped.gather_target_hidden(out.hidden_states, self._unwrapped.config.target_layer_ids)
        return hidden.float(), out.hidden_states[self.last_index]

    @torch.no_grad()
    def _target_features(self, batch):
        """``(hidden, last, lse, argmax)`` of a batch: from the features cache (``lse``/``argmax`` when it stores
        them), else from the target online (``lse``/``argmax`` None: the losses compute them)."""
        if self.features is not None:
            cached = self.features.batch(batch["index"].tolist(), batch["input_ids"].shape[1])
            return tuple(None if t is None else t.to(self.accelerator.device) for t in cached)
        return (*self._online_features(batch), None, None)

    def _clock(self) -> float:
        """``perf_counter`` after the device's queued work is done (phases are timed by their completion)."""
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        return time.perf_counter()

    # -- loop --------------------------------------------------------------------------------------------------
    def train(self, progress: bool = True, stop_at_step: int | None = None) -> dict:
        """Train to ``max_steps`` (or pause at ``stop_at_step`` after checkpointing, like an interruption)."""
        from tqdm.auto import tqdm

        args = self.args
        log_path = self.output_dir / "train_log.jsonl"
        writer = _tensorboard(self.output_dir) if self.accelerator.is_main_process else None
        bar = tqdm(total=args.max_steps, initial=self.step, desc="train", unit="step",
                   disable=not (progress and self.accelerator.is_main_process))
        generator = torch.Generator()
        totals: dict[str, float] = {}
        phases = dict.fromkeys(PHASES, 0.0)
        self._started = time.time()
        last = {}
        if self.eval_sequences and self.step == 0:
            self._log_eval(writer)  # where the drafter starts, for comparing initialisations
        while self.step < min(args.max_steps, stop_at_step or args.max_steps):
            generator.manual_seed(args.seed * 7919 + self.step)  # anchors depend only on (seed, step): exact resume
            for _ in range(args.gradient_accumulation_steps):
                _add_losses(totals, self._micro_step(generator, phases))
            self.scheduler.step()
            self.step += 1
            bar.update(1)
            if self.step % args.log_every == 0 or self.step == args.max_steps:
                last = self._train_summary(totals, phases)
                totals, phases = {}, dict.fromkeys(PHASES, 0.0)
                if self.accelerator.is_main_process:
                    _write_train_log(last, log_path, writer, bar)
            if self.eval_sequences and ((args.eval_every and self.step % args.eval_every == 0)
                                        or self.step == args.max_steps):
                self._log_eval(writer)
            if self.step % args.save_every == 0 or self.step in (args.max_steps, stop_at_step):
                self.save_checkpoint()
        bar.close()
        # stop the clock: a later train() call continues the count, and a checkpoint saved in between adds nothing
        self.elapsed_before, self._started = self._elapsed(), None
        if self.step < args.max_steps:
            return {"step": self.step, "paused": True, **last}
        if writer is not None:
            writer.close()
        return {"step": self.step, "final": str(self._save_final_drafter()), **last}

    def _micro_step(self, generator: torch.Generator, phases: dict[str, float]) -> dict[str, torch.Tensor]:
        """One micro-batch: target features, the drafter's losses and backward, and the optimizer step once the
        accumulated gradients sync (clipped first); each phase's time is added to ``phases``. Returns the losses."""
        clock = self._clock()
        batch = {k: v.to(self.accelerator.device) for k, v in self._next_batch().items()}
        features, last_hidden, lse, argmax = self._target_features(batch)
        clock = _lap(phases, "target", clock, self._clock())
        with self.accelerator.accumulate(self.loss_module), self.accelerator.autocast():
            losses = self.loss_module(features, last_hidden, batch["input_ids"], batch["loss_mask"], generator,
                                      lse, argmax)
            self.accelerator.backward(losses["loss"])
            clock = _lap(phases, "drafter", clock, self._clock())
            if self.accelerator.sync_gradients:
                self.accelerator.clip_grad_norm_(self.loss_module.parameters(), self.args.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad()
            _lap(phases, "optimizer", clock, self._clock())
        return losses

    def _train_summary(self, totals: dict[str, float], phases: dict[str, float]) -> dict:
        """The log line of the steps since the last one: mean losses, learning rate, position, elapsed time and
        throughput."""
        n, blocks = totals.pop("n"), totals.pop("blocks")
        last = {k: v / n for k, v in totals.items()}
        last.update(step=self.step, lr=self.scheduler.get_last_lr()[0], epoch=self.epoch,
                    elapsed_s=self._elapsed(), **throughput(blocks, phases))
        return last

    def _save_final_drafter(self) -> Path:
        """Save the trained drafter (LoRA: the adapter, and the drafter with it merged) on the main process; returns
        the drafter's folder."""
        final = self.output_dir / "drafter"
        if self.accelerator.is_main_process:
            if self.peft_model is not None:
                self.peft_model.save_pretrained(self.output_dir / "adapter")
                merged = self.peft_model.merge_and_unload()
                merged.save_pretrained(final)
            else:
                self._unwrapped.save_pretrained(final)
        return final


def _add_losses(totals: dict[str, float], losses: dict[str, torch.Tensor]) -> None:
    """Add a micro-batch's scalar losses, its supervised block count and one to its count to ``totals``."""
    for k, v in losses.items():
        if v.dim() == 0:
            totals[k] = totals.get(k, 0.0) + float(v.detach())
    totals["blocks"] = totals.get("blocks", 0.0) + float(losses["valid"].any(-1).sum())
    totals["n"] = totals.get("n", 0) + 1


def _write_train_log(last: dict, log_path: Path, writer, bar) -> None:
    """Append a training log line to ``log_path`` (its floats to TensorBoard too) and show it on the progress
    bar."""
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(last) + "\n")
    if writer is not None:
        for k, v in last.items():
            if isinstance(v, float):
                writer.add_scalar(f"train/{k}", v, last["step"])
    bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['accuracy']:.3f}",
                    blocks_s=f"{last['blocks_per_s']:.0f}",
                    split="/".join(f"{100 * last[f'time_{k}']:.0f}" for k in PHASES))


class _LossModule(torch.nn.Module):
    def __init__(self, drafter: DSparkDrafter, num_anchors: int | None = None, gamma: float = 4.0, weights=None,
                 confidence_target: str = "sampling", compiled: bool = False):
        super().__init__()
        self.drafter = drafter
        self.compiled = compiled
        self.num_anchors, self.gamma, self.weights = num_anchors, gamma, weights
        self.confidence_target = confidence_target

    def forward(self, features, last_hidden, input_ids, loss_mask, generator, lse=None, argmax=None):
        return drafter_training_step(self.drafter, features, last_hidden, input_ids, loss_mask,
                                     num_anchors=self.num_anchors, gamma=self.gamma, weights=self.weights,
                                     generator=generator, confidence_target=self.confidence_target,
                                     target_lse=lse, target_argmax=argmax, compiled=self.compiled)


# Where a training step's time goes: target features (online forward or cache read), the drafter's forward and
# backward (losses included), the optimizer (clipping, step, zeroing).
PHASES = ("target", "drafter", "optimizer")


def _lap(phases: dict[str, float], name: str, start: float, now: float) -> float:
    phases[name] += now - start
    return now


def throughput(blocks: float, phases: dict[str, float]) -> dict[str, float]:
    """``blocks_per_s`` over the timed phases and each phase's share of them (``time_<phase>``)."""
    total = sum(phases.values())
    out = {"blocks_per_s": blocks / total if total > 0 else 0.0}
    out.update({f"time_{k}": (v / total if total > 0 else 0.0) for k, v in phases.items()})
    return out


def seconds_per_step(run_dir: str | Path) -> tuple[float, dict]:
    """A run's seconds per step from its ``train_log.jsonl`` (the trainer's ``elapsed_s``, which leaves out loading),
    between the first and the last logged step so that the first steps' warm-up is left out too when there are two
    lines; and the last line."""
    path = Path(run_dir) / "train_log.jsonl"
    entries = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    if not entries:
        raise ValueError(f"{path} has no logged step yet")
    first, last = entries[0], entries[-1]
    if last["step"] > first["step"]:
        return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"]), last
    return last["elapsed_s"] / last["step"], last


def load_training_state(path: Path) -> dict:
    """The optimizer, scheduler and RNG states of a checkpoint: tensors and plain values only. Loading them never runs
    code a checkpoint carries (a run folder may come from someone else)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(f"{path} holds objects other than tensors and plain values: not a training state this "
                         "trainer wrote, or an altered one; refusing to unpickle it") from err


def _tensorboard(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(output_dir / "tensorboard"))


def _load_target(name: str | None, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    if name in (None, "smollm2", "SmolLM2-135M-Instruct"):
        from ..target import load_smollm2

        return load_smollm2(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype), AutoTokenizer.from_pretrained(name)
