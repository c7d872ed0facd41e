"""Bench methods as policy specs: ``hf-dspark bench-serve --policies`` names each engine it compares as a string
(``plain``, ``fixed=3``, ``hybrid=prefix,ungated,tree=auto``...), turned here into the engine's keyword arguments."""

from __future__ import annotations

import math

from ..engine.admission import PrefillCost
from ..engine.config import PLAIN, scheduled_policy
from ..policy_names import current_policy
from ..scheduling import SCHEDULES, VERIFICATION_POLICIES
from ..token_tree import DRAFT_TREES


def parse_policy(spec: str, default_schedule: str = "padded") -> dict:
    """A bench method's policy spec, ``plain`` | ``fixed`` | ``fixed=N`` | ``scheduler`` | ``scheduler=prefix`` |
    ``scheduler=topk`` | any other registered verification policy (``threshold``) -> engine keyword arguments
    (``hybrid`` takes every option of ``scheduler``; the old name ``scheduled`` goes to the engine as it is, which
    warns); ``scheduler=...,ungated`` (e.g. ``scheduler=ungated``, ``scheduler=prefix,ungated``) turns the engine's
    realized gate off, to measure what it brings, and ``scheduler=...,emitted`` has its realized gate count the
    tokens each step emitted (``gate_tokens="emitted"``) instead of the batch's progress. Any policy takes
    ``,hold=H`` (e.g. ``plain,hold=0``, ``scheduler=prefix,hold=0.25``): the engine's ``admission_hold``, to measure
    what holding admissions brings; and ``,prefill=F`` (e.g. ``plain,prefill=1e9``: every admission in one padded
    forward): a ``PrefillCost`` with ``fixed_tokens=F``, to measure what splitting admissions into prefill forwards
    brings; and ``,tree=T`` (``chain``, ``auto``, ``always``): the engine's ``draft_tree``."""
    head, *options = spec.split(",")
    name, _, value = head.partition("=")
    kwargs: dict = {}
    rest = []
    for option in options:
        key, eq, number = option.partition("=")
        if key == "tree":
            if number not in DRAFT_TREES:
                raise ValueError(f"policy {spec!r}: tree=T needs T in {DRAFT_TREES}")
            kwargs["draft_tree"] = number
            continue
        if key not in ("hold", "prefill"):
            rest.append(option)
            continue
        try:
            number = float(number) if eq else float("nan")
        except ValueError:
            number = float("nan")
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"policy {spec!r}: {key}=N needs a number N >= 0")
        if key == "hold":
            kwargs["admission_hold"] = number
        else:
            kwargs["prefill_cost"] = PrefillCost(fixed_tokens=number)
    if name == PLAIN and not value and not rest:
        return {"policy": PLAIN, **kwargs}
    if name == "fixed" and not rest:
        if value and not value.isdigit():
            raise ValueError(f"policy {spec!r}: fixed=N needs a non-negative integer N")
        return {"policy": "fixed", "num_verify_tokens": int(value) if value else None, **kwargs}
    if scheduled_policy(name):
        options = ([value] if value else []) + rest
        flags = {"ungated": ("realized_gate", False), "emitted": ("gate_tokens", "emitted")}
        schedules = [part for part in options if part not in flags]
        if len(schedules) > 1 or (schedules and schedules[0] not in SCHEDULES):
            form = f"{name}[=SCHEDULE][,ungated][,emitted][,hold=H][,prefill=F]"
            raise ValueError(f"policy {spec!r}: expected {form}, SCHEDULE one of {SCHEDULES}")
        out = {"policy": name, "schedule": schedules[0] if schedules else default_schedule}
        out.update(flags[part] for part in options if part in flags)
        return {**out, **kwargs}
    if current_policy(name) in VERIFICATION_POLICIES and not value and not rest:
        return {"policy": name, **kwargs}
    raise ValueError(f"unknown policy {spec!r}; expected plain, fixed[=N], scheduler[=padded|prefix|topk][,ungated]"
                     f"[,emitted], hybrid with the options of scheduler, or another registered verification policy "
                     f"({', '.join(sorted(VERIFICATION_POLICIES))}), each with optional ,hold=H, ,prefill=F and "
                     f",tree=T")


__all__ = ["parse_policy"]
