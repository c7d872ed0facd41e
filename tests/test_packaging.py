"""The wheel stands alone: built from the sources without build warnings and installed outside the repository, it
carries the model card template and the embedded drafters (weights, configs and cards, no copies of the package's
modules), and its command line starts.

The wheel is installed with ``--no-deps --target`` and run with that folder on ``PYTHONPATH`` from a directory outside
the checkout, so it reuses this environment's torch / transformers while every ``hf_dspark`` import comes from the
wheel (asserted: the editable install of the checkout must not shadow it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

DRAFTERS = ("smollm2-135m-instruct-dspark", "smollm2-135m-instruct-dflash")
pytestmark = pytest.mark.slow  # builds and installs a ~40 MB wheel


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    return {**env, "HF_HUB_OFFLINE": "1", **extra}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (the checkout gets no build/ folder) and installed into a folder."""
    source = tmp_path_factory.mktemp("source")
    shutil.copytree(REPO / "hf_dspark", source / "hf_dspark", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "hf_dspark_entry.py"):
        shutil.copy(REPO / name, source / name)
    wheels = tmp_path_factory.mktemp("wheels")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--check-build-dependencies",
         "-w", str(wheels), str(source)],
        capture_output=True, text=True, env=_env(), timeout=600)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    warnings = [line for line in log.splitlines() if "warning" in line.lower() or "deprecat" in line.lower()]
    assert not warnings, "\n".join(warnings)
    (wheel,) = wheels.glob("hf_dspark-*.whl")
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, env=_env(), timeout=600)
    return site


def _run(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, cwd=cwd, env=_env(PYTHONPATH=str(site)),
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_wheel_carries_the_card_template_and_the_drafters(installed, tmp_path):
    code = f"""
import json
from pathlib import Path
import hf_dspark
from hf_dspark import DSparkDrafter
from hf_dspark.defaults import DRAFTERS_DIR
from hf_dspark.hub import MODEL_CARD_TEMPLATE, render_model_card

drafter = DSparkDrafter.from_pretrained(DRAFTERS_DIR / {DRAFTERS[0]!r})
card = render_model_card(drafter, name="n", repo_id="org/n", target_name="t", training_text="", evaluation_text="")
print(json.dumps({{
    "package": hf_dspark.__file__,
    "template": str(MODEL_CARD_TEMPLATE),
    "template_exists": MODEL_CARD_TEMPLATE.is_file(),
    "drafters": sorted(p.name for p in DRAFTERS_DIR.iterdir() if (p / "model.safetensors").is_file()),
    "drafter_code": sorted(p.relative_to(DRAFTERS_DIR).as_posix() for p in DRAFTERS_DIR.rglob("*.py")),
    "card_head": card.splitlines()[0],
}}))
"""
    report = json.loads(_run(installed, tmp_path, sys.executable, "-c", code).stdout.strip().splitlines()[-1])
    assert Path(report["package"]).is_relative_to(installed), report["package"]
    assert Path(report["template"]).is_relative_to(installed) and report["template_exists"]
    assert report["drafters"] == sorted(DRAFTERS)
    assert report["drafter_code"] == []  # the package's modules ship once; a folder gets them when it is written
    assert report["card_head"] == "---"


def test_installed_command_line_starts(installed, tmp_path):
    out = _run(installed, tmp_path, str(installed / "bin" / "hf-dspark"), "push", "--help").stdout
    assert "--repo-id" in out and "--drafter" in out
