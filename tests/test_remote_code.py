"""The trust_remote_code route: a saved drafter folder works with plain transformers, hf_dspark NOT importable."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from tests.helpers import random_prompts

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
    print(json.dumps({"plain": plain[0].tolist(), "assisted": assisted[0].tolist(), "stops": stops,
                      "sampled_len": sampled.shape[1], "tau": greedy_tau,
                      "hf_dspark_loaded": [m for m in sys.modules if m.startswith("hf_dspark") and sys.modules[m]]}))
    """
)


def test_trust_remote_code_without_package(tiny_targets, trained_drafters, tmp_path):
    target, drafter = tiny_targets["llama"], trained_drafters["llama"]
    target.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    prompt = random_prompts(48, 8, target.config.vocab_size, seed=1)[0][0].tolist()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), PYTHONPATH="")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "target"), str(tmp_path / "drafter"), json.dumps(prompt)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["plain"] == report["assisted"]
    assert report["stops"]["plain"] == report["stops"]["assisted"] and len(report["stops"]["plain"]) == len(prompt) + 11
    assert report["hf_dspark_loaded"] == []
    assert report["sampled_len"] == len(prompt) + 12
    local = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert local[0].tolist() == report["assisted"]
    # greedy rounds are deterministic: the remote-code drafter is accepted exactly as the local one
    assert report["tau"] == drafter.last_stats.accepted_length > 1.5
