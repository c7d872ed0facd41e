"""``hf-dspark eval``'s settings: standard library only, so that the command line builds its flags and refuses bad
ones without loading torch (``report`` re-exports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
PHASES = ("quality", "speed")


@dataclass
class EvalSettings:
    """What an evaluation measures (each field's ``help`` is its ``hf-dspark eval`` flag's text)."""

    data: list[str] = field(metadata={"help": "prompt .jsonl files or folders (JSON Lines, see data/README.md); "
                                              "required unless --render-only"})
    num_prompts: int = field(default=50, metadata={"help": "prompts per set for the acceptance analyses"})
    max_new_tokens: int = field(default=256, metadata={"help": "tokens generated per turn"})
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0],
                                      metadata={"help": "sampling temperatures analysed (0: greedy)"})
    speed_prompts: int = field(default=10, metadata={"help": "prompts per set for the timed comparison"})
    speed_temperatures: list[float] | None = field(default=None, metadata={
        "help": "temperatures for the timed comparison (default: --temperatures)", "nargs": "*"})
    speed_threshold: float = field(default=0.5, metadata={"help": "threshold of the timed threshold policy"})
    thresholds: list[float] = field(default_factory=lambda: list(DEFAULT_THRESHOLDS),
                                    metadata={"help": "static-threshold sweep values"})
    prompt_lookup: int = field(default=7, metadata={"help": "prompt-lookup tokens (0: skip that baseline)"})
    scheduler: bool = field(default=True, metadata={"help": "time the scheduler policy (--no-scheduler: skip it)"})
    multi_turn: bool = field(default=True, metadata={"help": "roll out every turn of multi-turn prompts "
                                                             "(--first-turn-only: the first turn only)",
                                                     "negative": "--first-turn-only"})
    seed: int = field(default=0, metadata={"help": "random seed (prompt sampling, sampled decoding)"})

    def __post_init__(self):
        if self.num_prompts < 1 or self.max_new_tokens < 1 or self.speed_prompts < 0:
            raise ValueError("num_prompts and max_new_tokens must be >= 1, speed_prompts >= 0")
        if self.speed_prompts > self.num_prompts:
            raise ValueError(f"speed_prompts ({self.speed_prompts}) cannot exceed num_prompts ({self.num_prompts})")
        for t in self.temperatures + (self.speed_temperatures or []):
            if t < 0:
                raise ValueError(f"temperatures must be >= 0, got {t}")
        if not 0.0 <= self.speed_threshold <= 1.0 or not all(0.0 <= t <= 1.0 for t in self.thresholds):
            raise ValueError("confidence thresholds must lie in [0, 1]")


__all__ = ["DEFAULT_THRESHOLDS", "PHASES", "EvalSettings"]
