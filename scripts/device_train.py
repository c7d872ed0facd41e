"""Train the embedded SmolLM2 drafters on a GPU within one device session, and bring them back.

Here, once: `python scripts/device_train.py --prepare` writes the bundle the device needs into .device-train/ (the
unused training prompts and the committed regenerated data, xz-compressed, and the shipped drafters: about 55 MB, so
the large tracked paths can stay behind when the tree travels). On the GPU machine (after staging, see
scripts/device_train.sh), in at most ~9 minutes of command time:

    python scripts/device_train.py --bundle .device-train --slice K [--from-result DIR] [--budget-s 420]
        [--regen-s 90] [--output DIR]

  1. regenerates slice K of the carried training prompts with the target (large batches on the GPU, at most
     --regen-s seconds; a different slice each run: K is recorded, slices are disjoint);
  2. profiles a few batch sizes for a handful of steps and keeps the one with the most blocks per second, printing
     blocks/s and the share of step time in target, drafter and optimizer;
  3. trains each drafter (the DSpark drafter and the DFlash ablation: same data, sizes and wall-clock share) from
     where it is given (the shipped ones, or the last result brought back) for its share of --budget-s, with the
     held-out proxy (teacher-forced tau on data/regen-smollm2-heldout) logged before and after;
  4. writes the trained drafters (bfloat16 weights, config), their logs, the regenerated slice (xz) and
     summary.json into one tar, split into parts of at most 15 MiB in $OUT (or --output).

Here, after the run: `python scripts/device_train.py --unpack DIR_WITH_PARTS --output runs/device-K` reassembles the
parts; the next device run continues from them with `--from-result` (carried).

Each restart begins with a fresh AdamW, and from bfloat16 weights (what comes back). A fresh AdamW's moment
estimates start at zero, so its first updates are sign-like and full-sized; a linear warm-up over the first 10% of
steps (at least 20) keeps them small while the estimates settle. What a restart costs shows in train_log.jsonl: the
first logged losses of a run against the last ones of the run before (a jump means the warm-up is too short); the
held-out proxy at eval step 0 is the drafter exactly as brought back.

With --quick (the CPU test) everything is tiny: a few prompts, a few tokens, two training steps per arm. On a machine
without CUDA the run takes the CPU path (float32, small sizes); nothing is skipped, it is only slower.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from hf_dspark.training.trainer import seconds_per_step  # noqa: E402

DRAFTERS = {"dspark": REPO / "hf_dspark/drafters/smollm2-135m-instruct-dspark",
            "dflash": REPO / "hf_dspark/drafters/smollm2-135m-instruct-dflash"}
TRAIN_NAMES = ("regen-smollm2", "regen-smollm2-b", "regen-smollm2-c")
HELDOUT_NAME = "regen-smollm2-heldout"
TRAIN_DATA = [REPO / "data" / name for name in TRAIN_NAMES]
HELDOUT = REPO / "data" / HELDOUT_NAME
PART_BYTES = 15 * 1024 * 1024
SLICE_SEED = 0  # the order the slices are cut from; slice K is positions [K * size, (K + 1) * size) of it


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Prompts: prepared here, sliced there
# ------------------------------------------------------------------------------------------------------------------
def unused_prompts(prompt_paths: list[str]) -> list[dict]:
    """Training prompts that no committed regenerated folder and no calibration used, in a fixed shuffled order."""
    from hf_dspark.prompts import excluded_prompt_ids, load_prompts

    exclude = [str(p) for p in [*TRAIN_DATA, HELDOUT] if p.is_dir()]
    ids_file = REPO / "reports" / "calibration-smollm2" / "prompt_ids.txt"
    if ids_file.is_file():
        exclude.append(str(ids_file))
    excluded = excluded_prompt_ids(exclude)
    records = [r for r in load_prompts(prompt_paths) if r["id"] not in excluded]
    random.Random(SLICE_SEED).shuffle(records)
    return records


def prepare(args) -> int:
    """Write the bundle for the device: the unused training prompts and the committed regenerated data
    (xz-compressed), and the shipped drafters."""
    records = unused_prompts(args.prompts)
    bundle = Path(args.bundle)
    bundle.mkdir(parents=True, exist_ok=True)
    prompts = bundle / "prompts.jsonl.xz"
    with lzma.open(prompts, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"id": r["id"], "domain": r["domain"], "turns": r["turns"], "set": r["set"]}) + "\n")
    with tarfile.open(bundle / "data.tar.xz", "w:xz") as tar:
        for name in (*TRAIN_NAMES, HELDOUT_NAME):
            if (REPO / "data" / name).is_dir():
                tar.add(REPO / "data" / name, arcname=name)
    for name, folder in DRAFTERS.items():
        target = bundle / "drafters" / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns("__pycache__"))
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    log(f"{len(records)} unused prompts ({len(records) // args.slice_size} slices of {args.slice_size}), the "
        f"regenerated data and {len(DRAFTERS)} drafters -> {bundle} ({size / 2**20:.1f} MiB)")
    return 0


def prompt_slice(path: Path, index: int, size: int, folder: Path) -> Path:
    """Slice ``index`` of a prepared prompts file, written as a plain .jsonl under ``folder``."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    chosen = records[index * size : (index + 1) * size]
    if not chosen:
        raise SystemExit(f"slice {index} of {size} prompts is past the end of {path} ({len(records)} prompts)")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"slice-{index}.jsonl"
    with open(out, "w", encoding="utf-8") as f:
        for r in chosen:
            f.write(json.dumps({k: r[k] for k in ("id", "domain", "turns")}) + "\n")
    return out


# ------------------------------------------------------------------------------------------------------------------
# Results: one tar, split into parts
# ------------------------------------------------------------------------------------------------------------------
def write_parts(folder: Path, output: Path) -> list[Path]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(folder, arcname="result")
    data = buffer.getvalue()
    output.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, len(data), PART_BYTES):
        part = output / f"result.tar.part{i // PART_BYTES}"
        part.write_bytes(data[i : i + PART_BYTES])
        parts.append(part)
    return parts


def read_parts(folder: Path, destination: Path) -> Path:
    """Reassemble ``result.tar.part*`` of ``folder`` into ``destination``; returns the result folder."""
    parts = sorted(folder.glob("result.tar.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    if not parts:
        raise SystemExit(f"no result.tar.part* files in {folder}")
    data = b"".join(p.read_bytes() for p in parts)
    destination.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(destination, filter="data")
    return destination / "result"


def unpack(args) -> int:
    result = read_parts(Path(args.unpack), Path(args.output or "runs/device-result"))
    summary = json.loads((result / "summary.json").read_text())
    log(f"unpacked {result}: slice {summary['slice']}, arms {list(summary['arms'])}")
    for name, arm in summary["arms"].items():
        log(f"  {name}: held-out tau {arm['eval_before']:.3f} -> {arm['eval_after']:.3f} in {arm['steps']} steps "
            f"({arm['blocks_per_s']:.0f} blocks/s)")
    return 0


# ------------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------------
def training_args(output: Path, data_dirs, drafter: Path, batch_size: int, num_anchors: int, steps: int,
                  settings: dict):
    from hf_dspark.training.trainer import TrainingArguments

    config = json.loads((drafter / "config.json").read_text())
    blocks = batch_size * num_anchors
    return TrainingArguments(
        output_dir=str(output), data_dirs=[str(d) for d in data_dirs], init_drafter=str(drafter),
        confidence_target=config.get("confidence_target", "sampling"), max_steps=steps,
        # the shipped round's rate at 256 blocks a step, scaled with the square root of the batch
        learning_rate=min(2e-3, 5e-4 * math.sqrt(blocks / 256)),
        warmup_ratio=max(0.1, 20 / max(steps, 1)) if steps > 2 else 0.0,
        batch_size=batch_size, num_anchors=num_anchors, max_length=settings["max_length"],
        mixed_precision="auto", eval_data_dirs=[str(settings["heldout"])], eval_every=0,
        eval_sequences=settings["eval_sequences"], save_every=10**9, log_every=max(1, min(10, steps // 4)),
    )


def profile_sizes(target, tokenizer, data_dirs, drafter: Path, candidates, settings, scratch: Path) -> dict:
    """Train a few steps at each (batch, anchors) and keep the one with the most blocks per second."""
    from hf_dspark.training.trainer import DSparkTrainer

    best = None
    for batch_size, num_anchors in candidates:
        run = scratch / f"profile-{batch_size}x{num_anchors}"
        args = training_args(run, data_dirs, drafter, batch_size, num_anchors, settings["profile_steps"], settings)
        args.eval_data_dirs, args.log_every = None, 1
        try:
            DSparkTrainer(args, target=target, tokenizer=tokenizer).train(progress=False)
        except torch.OutOfMemoryError:
            log(f"profile {batch_size} x {num_anchors}: out of memory")
            torch.cuda.empty_cache()
            break
        per_step, entry = seconds_per_step(run)
        blocks_per_s = entry["blocks_per_s"]
        split = " / ".join(f"{k[5:]} {100 * v:.0f}%" for k, v in entry.items() if k.startswith("time_"))
        log(f"profile {batch_size} seqs x {num_anchors} anchors: {per_step:.3f} s/step, {blocks_per_s:.0f} blocks/s "
            f"({split})")
        if best is None or blocks_per_s > best["blocks_per_s"]:
            best = {"batch_size": batch_size, "num_anchors": num_anchors, "s_per_step": per_step,
                    "blocks_per_s": blocks_per_s, "split": {k[5:]: v for k, v in entry.items() if k.startswith("time_")}}
        shutil.rmtree(run, ignore_errors=True)
    if best is None:
        raise SystemExit("no batch size fitted in memory")
    return best


def train_arm(name, target, tokenizer, data_dirs, drafter: Path, sizes: dict, budget_s: float, settings: dict,
              scratch: Path, result: Path) -> dict:
    from hf_dspark import DSparkDrafter
    from hf_dspark.training.trainer import DSparkTrainer

    run = scratch / f"run-{name}"
    # the budget pays for the steps and two held-out evaluations (about one profile step's worth each, measured)
    steps = max(2, int((budget_s - 2 * settings["eval_s"]) / sizes["s_per_step"]))
    if settings["quick"]:
        steps = 2
    args = training_args(run, data_dirs, drafter, sizes["batch_size"], sizes["num_anchors"], steps, settings)
    started = time.perf_counter()
    trainer = DSparkTrainer(args, target=target, tokenizer=tokenizer)
    summary = trainer.train(progress=False)
    elapsed = time.perf_counter() - started
    evals = [json.loads(line) for line in open(run / "eval_log.jsonl")]
    _, last = seconds_per_step(run)
    out = result / name
    trained = DSparkDrafter.from_pretrained(run / "drafter", dtype=torch.bfloat16)
    trained.save_pretrained(out)
    for file in ("train_log.jsonl", "eval_log.jsonl"):
        shutil.copy(run / file, out / file)
    arm = {"from": str(drafter.relative_to(REPO) if drafter.is_relative_to(REPO) else drafter), "steps": steps,
           "lr": args.learning_rate, "warmup_ratio": args.warmup_ratio, "elapsed_s": elapsed,
           "blocks_per_s": last["blocks_per_s"], "split": {k[5:]: v for k, v in last.items() if k.startswith("time_")},
           "eval_before": evals[0]["eval_accepted_length"], "eval_after": evals[-1]["eval_accepted_length"],
           "position_match_after": evals[-1]["eval_position_match"], "final_loss": summary.get("loss")}
    log(f"{name}: {steps} steps in {elapsed:.0f} s, held-out tau {arm['eval_before']:.3f} -> {arm['eval_after']:.3f}")
    shutil.rmtree(run, ignore_errors=True)
    return arm


def run(args) -> int:
    from hf_dspark.target import load_smollm2
    from hf_dspark.training.data import RegenerationSettings, list_shards, regenerate

    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    out_dir = Path(args.output or os.environ.get("OUT") or "runs/device-train-out")
    scratch = Path(tempfile.mkdtemp(prefix="device-train-"))
    result = scratch / "result"
    result.mkdir()
    settings = {"quick": args.quick, "max_length": 256 if args.quick else 512,
                "eval_sequences": 4 if args.quick else 64, "profile_steps": 3 if args.quick else 6}
    log(f"device {torch.cuda.get_device_name(0) if cuda else 'cpu'}, torch {torch.__version__}")

    bundle = Path(args.bundle)
    if not (bundle / "prompts.jsonl.xz").is_file():
        raise SystemExit(f"{bundle} holds no prompts.jsonl.xz: run `python scripts/device_train.py --prepare` here "
                         "and carry the folder")
    data_root = REPO / "data"
    if (bundle / "data.tar.xz").is_file():
        data_root = scratch / "data"
        with tarfile.open(bundle / "data.tar.xz") as tar:
            tar.extractall(data_root, filter="data")
    train_data = [data_root / name for name in TRAIN_NAMES if (data_root / name).is_dir()]
    heldout = data_root / HELDOUT_NAME
    settings["heldout"] = heldout
    drafters = {name: (bundle / "drafters" / name if (bundle / "drafters" / name / "config.json").is_file()
                       else folder) for name, folder in DRAFTERS.items()}
    if args.from_result:
        brought = read_parts(Path(args.from_result), scratch / "brought")
        drafters = {name: brought / name for name in drafters if (brought / name / "config.json").is_file()}
        log(f"continuing from {args.from_result}: {sorted(drafters)}")
    arms = [a for a in args.arms if a in drafters]
    if not arms:
        raise SystemExit(f"no drafter for the arms {args.arms}")

    target, tokenizer = load_smollm2(dtype=torch.bfloat16 if cuda else torch.float32, device=device)

    # 1. a new slice of regenerated data
    slice_dir = scratch / "slice"
    prompts = prompt_slice(bundle / "prompts.jsonl.xz", args.slice, args.slice_size, scratch / "prompts")
    batch = args.regen_batch or (256 if cuda else 4)
    regen = RegenerationSettings(prompt_paths=[str(prompts)], shard_size=batch, batch_size=batch,
                                 max_new_tokens=16 if args.quick else 256, seed=args.slice,
                                 dtype="bfloat16" if cuda else "float32")
    t0 = time.perf_counter()
    regen_summary = regenerate(target, tokenizer, slice_dir, regen, progress=False, time_budget_s=args.regen_s)
    regen_s = time.perf_counter() - t0
    new_shards = sorted(slice_dir.glob("shard-*.jsonl"))
    sequences = sum(1 for shard in new_shards for _ in open(shard))
    log(f"regenerated {sequences} sequences of slice {args.slice} in {regen_s:.0f} s")
    if new_shards:
        with tarfile.open(result / f"data-slice-{args.slice}.tar.xz", "w:xz") as tar:
            tar.add(slice_dir, arcname=f"regen-smollm2-slice-{args.slice}")
    data_dirs = ([slice_dir] if new_shards else []) + ([] if args.quick else train_data)
    if not data_dirs:
        raise SystemExit("no training data: the regeneration finished no shard and no committed data was found")
    list_shards([str(d) for d in data_dirs])

    # 2. sizes from a short profile (on the first arm's drafter), and the cost of one held-out evaluation
    candidates = [(2, 8)] if args.quick else ([(16, 128), (64, 128), (128, 128)] if cuda else [(4, 64)])
    sizes = profile_sizes(target, tokenizer, data_dirs, drafters[arms[0]], candidates, settings, scratch)
    from hf_dspark.training.trainer import DSparkTrainer

    probe = DSparkTrainer(training_args(scratch / "eval-probe", data_dirs, drafters[arms[0]], sizes["batch_size"],
                                        sizes["num_anchors"], 1, settings), target=target, tokenizer=tokenizer)
    t0 = time.perf_counter()
    probe.evaluate()
    settings["eval_s"] = time.perf_counter() - t0
    del probe
    shutil.rmtree(scratch / "eval-probe", ignore_errors=True)

    # 3. each arm its share of what is left of the budget
    remaining = args.budget_s - (time.perf_counter() - started)
    share = max(remaining, 0) / len(arms)
    log(f"sizes {sizes['batch_size']} x {sizes['num_anchors']} ({sizes['blocks_per_s']:.0f} blocks/s); "
        f"{share:.0f} s per arm for {arms}")
    results = {name: train_arm(name, target, tokenizer, data_dirs, drafters[name], sizes, share, settings, scratch,
                               result) for name in arms}

    # 4. bring back
    summary = {"slice": args.slice, "slice_size": args.slice_size, "slice_seed": SLICE_SEED, "regenerated_sequences": sequences, "regen_s": regen_s,
               "regen": regen_summary | {"settings": vars(regen)}, "sizes": sizes, "eval_s": settings["eval_s"],
               "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
               "data_dirs": [d.name if d != slice_dir else f"regen-smollm2-slice-{args.slice}" for d in data_dirs],
               "arms": results, "elapsed_s": time.perf_counter() - started}
    (result / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    parts = write_parts(result, out_dir)
    log(f"wrote {len(parts)} parts ({sum(p.stat().st_size for p in parts) / 2**20:.1f} MiB) to {out_dir}")
    print("arm      steps  blocks/s  held-out tau before -> after")
    for name, arm in results.items():
        print(f"{name:8s} {arm['steps']:5d}  {arm['blocks_per_s']:8.0f}  {arm['eval_before']:.3f} -> "
              f"{arm['eval_after']:.3f}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", action="store_true", help="here: write .device-train/prompts.jsonl.xz")
    parser.add_argument("--unpack", default=None, metavar="DIR", help="here: reassemble result parts of DIR")
    parser.add_argument("--bundle", default=str(REPO / ".device-train"),
                        help="the folder --prepare writes and the run reads (prompts, data, drafters)")
    parser.add_argument("--prompts", nargs="+", default=None,
                        help="with --prepare: the prompt files/folders (default ../shared/data/train)")
    parser.add_argument("--slice", type=int, default=0, help="which slice of the prompts to regenerate")
    parser.add_argument("--slice-size", type=int, default=512)
    parser.add_argument("--regen-s", type=float, default=90.0, help="regeneration budget (seconds)")
    parser.add_argument("--regen-batch", type=int, default=None, help="regeneration batch (256 on cuda, 4 on cpu)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="the whole run's budget (seconds)")
    parser.add_argument("--arms", nargs="+", default=["dspark", "dflash"])
    parser.add_argument("--from-result", default=None, metavar="DIR", help="continue from result parts in DIR")
    parser.add_argument("--output", default=None, help="where the parts go ($OUT when set)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU test)")
    args = parser.parse_args(argv)
    if args.unpack:
        return unpack(args)
    if args.prepare:
        args.prompts = args.prompts or [str(REPO.parent / "shared" / "data" / "train")]
        return prepare(args)
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
