"""scripts/device_train.py --quick runs end to end on CPU with the real target: a regenerated prompt slice, a size
profile, both arms trained from the shipped drafters with held-out evaluation before and after, the result split
into parts that reassemble into loadable drafters, and a run that continues from those parts."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = pytest.mark.slow
SHARED_TRAIN = REPO.parent / "shared" / "data" / "train"


def run_script(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "scripts/device_train.py", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.skipif(not SHARED_TRAIN.is_dir(), reason="needs ../shared/data/train")
def test_device_train_quick_on_cpu_round_trip(tmp_path):
    from hf_dspark import DSparkDrafter

    bundle = tmp_path / "bundle"
    run_script("--prepare", "--slice-size", "3", "--bundle", str(bundle))
    assert {p.name for p in bundle.iterdir()} == {"prompts.jsonl.xz", "data.tar.xz", "drafters"}
    out = tmp_path / "out"
    stdout = run_script("--quick", "--bundle", str(bundle), "--slice", "2", "--slice-size", "3", "--output", str(out))
    assert "profile 2 seqs x 8 anchors" in stdout and "blocks/s" in stdout
    parts = sorted(out.glob("result.tar.part*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)

    run_script("--unpack", str(out), "--output", str(tmp_path / "unpacked"))
    result = tmp_path / "unpacked" / "result"
    summary = json.loads((result / "summary.json").read_text())
    assert summary["slice"] == 2 and summary["regenerated_sequences"] >= 3
    assert (result / "data-slice-2.tar.xz").is_file()
    for arm in ("dspark", "dflash"):
        numbers = summary["arms"][arm]
        assert numbers["steps"] == 2 and numbers["blocks_per_s"] > 0
        assert 1.0 <= numbers["eval_before"] <= 8.0 and 1.0 <= numbers["eval_after"] <= 8.0
        drafter = DSparkDrafter.from_pretrained(result / arm)
        assert drafter.dtype == torch.bfloat16
        assert len((result / arm / "eval_log.jsonl").read_text().splitlines()) == 2  # before and after
    assert summary["arms"]["dflash"]["from"].endswith("bundle/drafters/dflash")

    # the next run continues from what came back, on another slice
    again = tmp_path / "again"
    run_script("--quick", "--bundle", str(bundle), "--slice", "3", "--slice-size", "3", "--arms", "dspark",
               "--from-result", str(out), "--output", str(again))
    run_script("--unpack", str(again), "--output", str(tmp_path / "unpacked-again"))
    second = json.loads((tmp_path / "unpacked-again" / "result" / "summary.json").read_text())
    assert list(second["arms"]) == ["dspark"] and "brought" in second["arms"]["dspark"]["from"]
