"""Reading a drafter's ``generation_config`` setting that takes one of a few named values. No imports: exported
drafter folders carry it beside the modules that read their settings with it."""

from __future__ import annotations


def checked_choice(drafter, name: str, choices: tuple[str, ...], default: str) -> str:
    """``drafter.generation_config.<name>`` (``default`` where unset); an error naming the setting and its choices
    where it is none of ``choices``."""
    value = getattr(drafter.generation_config, name, None) or default
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {list(choices)}")
    return value


__all__ = ["checked_choice"]
