"""The trust_remote_code route: a freshly saved drafter folder carries the package's code (every module the model
file and the generation module import, followed through) and works with plain transformers, hf_dspark NOT
importable; saved again there, it writes the same code from the folder it came from."""

import json
import os
import subprocess
import sys
import textwrap

from pathlib import Path

import torch

import hf_dspark
from hf_dspark.drafter_files import module_closure
from tests.helpers import python_files, random_prompts, written_code

SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_dspark"] = None  # any `import hf_dspark` now fails
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    target_dir, drafter_dir, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter = AutoModel.from_pretrained(drafter_dir, trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    ids = torch.tensor([prompt])
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter,
                               custom_generate=drafter_dir, trust_remote_code=True)
    greedy_tau = drafter.last_stats.accepted_length
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAtLength(StoppingCriteria):  # fires on a draft in mid-round as often as not
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= ids.shape[1] + 11, dtype=torch.bool)

    stops = {}
    for name, extra in (("plain", {}), ("assisted", dict(assistant_model=drafter, custom_generate=drafter_dir,
                                                           trust_remote_code=True))):
        stops[name] = target.generate(ids, max_new_tokens=30, do_sample=False,
                                      stopping_criteria=StoppingCriteriaList([StopAtLength()]), **extra)[0].tolist()
    torch.manual_seed(0)
    sampled = target.generate(ids, max_new_tokens=12, do_sample=True, assistant_model=drafter,
                              custom_generate=drafter_dir, trust_remote_code=True)
    from pathlib import Path

    drafter.save_pretrained(sys.argv[4])  # saved again without hf_dspark: the code comes from the loaded folder
    resaved = sorted(p.relative_to(sys.argv[4]).as_posix() for p in Path(sys.argv[4]).rglob("*.py"))
    print(json.dumps({"plain": plain[0].tolist(), "assisted": assisted[0].tolist(), "stops": stops,
                      "sampled_len": sampled.shape[1], "tau": greedy_tau, "resaved": resaved,
                      "hf_dspark_loaded": [m for m in sys.modules if m.startswith("hf_dspark") and sys.modules[m]]}))
    """
)


def test_module_closure_follows_relative_imports_through_every_module(tmp_path):
    """In the package's try/except form, at module level or in a function, directly or through another module;
    absolute imports (the optional ``hf_dspark.profiling``) and subpackages are not the folder's to carry."""
    files = {
        "generation.py": "try:\n    from .sources import Draft\nexcept ImportError:\n    from sources import Draft\n\n"
                         "def profile():\n    from hf_dspark.profiling import load_or_profile\n"
                         "    from .kernels.scheduler import launch\n",
        "sources.py": "import torch\n\nfrom .statistics import Stats\n",
        "statistics.py": "def clock():\n    from . import scheduling\n",
        "scheduling.py": "import math\n",
        "unrelated.py": "from .sources import Draft\n",
        "kernels/scheduler.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert [path.name for path in module_closure(tmp_path / "generation.py")] == [
        "generation.py", "scheduling.py", "sources.py", "statistics.py"]
    assert [path.name for path in module_closure(tmp_path / "scheduling.py")] == ["scheduling.py"]


def test_trust_remote_code_without_package(tiny_targets, trained_drafters, tmp_path):
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    code = written_code(Path(hf_dspark.__file__).parent)
    assert {"configuration_dspark.py", "modeling_dspark.py", "custom_generate/generate.py",
            "custom_generate/scheduling.py"} <= set(code)
    assert python_files(tmp_path / "drafter") == set(code)
    for name, source in code.items():
        assert (tmp_path / "drafter" / name).read_bytes() == source.read_bytes(), name
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[0][0].tolist()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH="")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "target"), str(tmp_path / "drafter"), json.dumps(prompt),
         str(tmp_path / "resaved")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["plain"] == report["assisted"]
    assert report["stops"]["plain"] == report["stops"]["assisted"] and len(report["stops"]["plain"]) == len(prompt) + 11
    assert report["hf_dspark_loaded"] == []
    assert report["resaved"] == sorted(code)
    assert report["sampled_len"] == len(prompt) + 12
    local = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert local[0].tolist() == report["assisted"]
    # greedy rounds are deterministic: the remote-code drafter is accepted exactly as the local one
    assert report["tau"] == drafter.last_stats.accepted_length > 1.5
