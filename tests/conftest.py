import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import make_target, train_drafter_on_target  # noqa: E402


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def family(request):
    return request.param


@pytest.fixture(scope="session")
def tiny_targets():
    return {name: make_target(name) for name in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def trained_drafters(tiny_targets):
    """A drafter per target family trained a few hundred steps on the target's own greedy outputs."""
    return {name: train_drafter_on_target(target) for name, target in tiny_targets.items()}


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """Deselect the opt-in ``vllm`` tests (they need the separate vLLM venv) unless ``-m`` names the marker."""
    if "vllm" in (config.getoption("markexpr") or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("vllm")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("vllm")]
