"""scripts/acceptance_caps.py: the summary of teacher-forced block records, on hand-made records."""

import types

import pytest
import torch

from tests.helpers import load_script


@pytest.fixture(scope="module")
def caps():
    return load_script("acceptance_caps")


def test_summary_of_hand_made_blocks(caps):
    # vocabulary of 10 target tokens, the draft vocabulary holds 0..7; blocks of 3 positions
    drafter = types.SimpleNamespace(draft_vocab=torch.arange(8), config=types.SimpleNamespace(vocab_size=10))
    top1 = torch.tensor([[1, 2, 3], [1, 9, 3], [4, 5, 6], [7, 8, 1]])
    second = torch.tensor([[5, 5, 5], [5, 5, 5], [2, 5, 5], [5, 5, 5]])
    greedy = torch.tensor([[1, 2, 0], [1, 0, 3], [2, 5, 6], [0, 8, 1]])
    records = {"greedy": greedy, "top2": torch.stack([top1, second], dim=-1),
               "offsets": torch.tensor([0, 20, 70, 200]), "domain": ["code", "code", "math", "chat"]}
    result = caps.summarise(drafter, records)
    # leading matches: 2, 1, 0, 0 -> tau = 1 + 3/4
    assert result["tau"] == pytest.approx(1.75)
    assert result["match_per_position"] == pytest.approx([0.5, 0.75, 0.75])
    assert result["conditional_acceptance"][:2] == pytest.approx([0.5, 0.5])  # 1 of the 2 that reached position 2
    assert result["outside_vocab_share"] == pytest.approx(2 / 12)  # 9 and 8 lie outside 0..7
    assert result["vocab_ceiling_per_position"] == pytest.approx([1.0, 0.5, 0.5])
    assert result["vocab_ceiling_tau"] == pytest.approx(1 + (3 + 1 + 3 + 1) / 4)
    # position-1 misses: blocks 3 and 4; block 3 drafted the target's second token
    assert result["position1_miss_share"] == pytest.approx(0.5)
    assert result["position1_miss_is_target_second"] == pytest.approx(0.5)
    assert result["position1_miss_outside_vocab"] == pytest.approx(0.0)
    assert result["tau_by_domain"]["code"] == {"blocks": 2, "tau": pytest.approx(2.5)}
    assert result["tau_by_response_offset"]["0-16"] == {"blocks": 1, "tau": pytest.approx(3.0)}
    assert "| tau (whole-block greedy, teacher-forced) | 1.750 |" in caps.render({"held-out": result})
