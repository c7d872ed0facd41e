"""Flags generated from settings dataclasses: ``transformers.HfArgumentParser`` plus a few metadata keys.

A field is declared once, in its dataclass, with its help text in ``metadata["help"]``. Besides what
HfArgumentParser reads (``help``, ``aliases``, argparse keywords such as ``choices`` or ``metavar``), a field's
metadata may say:

- ``flag``: the spelling shown first and used in messages, where it is not the field's name (``--output`` for
  ``output_dir``; ``--output-dir`` still parses);
- ``deprecated``: old spellings still accepted; using one prints a note naming the current flag;
- ``negative``: extra spellings that set a ``True``-by-default flag to ``False`` (``--no-confidence-head``);
- ``nargs``: how many values, where the field's type alone says otherwise (``*``: the flag alone gives an empty list);
- ``comma``: ``True`` for a list given as one comma-separated token (``--target-layer-ids 28,29``);
- ``bounds``: ``(low, high)``, inclusive, ``None`` for no bound, checked before anything loads;
- ``cli``: ``False`` for a field the command line does not set (it keeps its dataclass default).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from types import MappingProxyType

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

# read here, not by argparse ("nargs" goes to argparse too, and is set again where HfArgumentParser replaces it)
CLI_KEYS = ("flag", "deprecated", "negative", "comma", "bounds", "cli")


class UsageError(Exception):
    """Bad command-line input, found before any model loads: exit status 2, like argparse's own errors."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every optional flag's default in ``--help``, except where its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.nargs == 0:
            return text
        if isinstance(action.default, list):  # as it is typed: --policies plain fixed
            return f"{text} (default: {' '.join(map(str, action.default)) or 'none'})"
        return super()._get_help_string(action)


class SettingsParser(HfArgumentParser):
    """An HfArgumentParser that reads the metadata keys above, shows defaults in ``--help`` and lists each flag
    once (the hyphenated spelling; HfArgumentParser's ``--snake_case`` twin still parses but is not shown)."""

    def __init__(self, *args, **kwargs):
        self.deprecated: dict[str, str] = {}
        super().__init__(*args, formatter_class=DefaultsHelpFormatter, **kwargs)

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        if field.metadata.get("cli", True) is False:
            return
        action = _add_argument(parser, field)
        _adjust(action, field.metadata)
        _spellings(parser, action, field.metadata)
        _name_value(action)


def _add_argument(parser, field: dataclasses.Field) -> argparse.Action:
    """HfArgumentParser's argument for ``field``, given every spelling; its main action (not a ``--no-`` one)."""
    metadata = {key: value for key, value in field.metadata.items() if key not in CLI_KEYS}
    metadata["aliases"] = [*_as_list(field.metadata.get("flag")), *_as_list(metadata.get("aliases")),
                           *_as_list(field.metadata.get("deprecated"))]
    generated = dataclasses.field(metadata=MappingProxyType(metadata), default=field.default,
                                  default_factory=field.default_factory)
    generated.name, generated.type = field.name, field.type
    HfArgumentParser._parse_dataclass_field(parser, generated)
    return next(a for a in parser._actions if a.dest == field.name and a.const is not False)


def _as_list(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _adjust(action: argparse.Action, metadata) -> None:
    """Apply ``nargs`` / ``comma`` on top of what HfArgumentParser derived from the field's type."""
    if "nargs" in metadata:
        action.nargs = metadata["nargs"]
    if metadata.get("comma"):
        action.type, action.nargs = _comma_separated(action.type), None


def _spellings(parser, action: argparse.Action, metadata) -> None:
    """``flag`` shown first, ``negative`` spellings added, ``--snake_case`` and ``deprecated`` ones hidden (they
    still parse), each ``--no-`` flag described by the flag it turns off."""
    if "flag" in metadata:
        action.option_strings.remove(metadata["flag"])
        action.option_strings.insert(0, metadata["flag"])
    if metadata.get("negative"):
        parser.add_argument(*_as_list(metadata["negative"]), dest=action.dest, action="store_false", help="")
    for each in parser._actions:
        if each.dest == action.dest:
            _hide_snake_case(each)
            if each.const is False:
                each.help = f"the same as {action.option_strings[0]} false"
    for alias in _as_list(metadata.get("deprecated")):
        action.option_strings.remove(alias)
        parser.deprecated[alias] = action.option_strings[0]
        action.help += f" ({alias}: deprecated spelling)"


def _comma_separated(item_type):
    """A reader of ``28,29`` into ``[28, 29]`` (each item read by ``item_type``)."""

    def read(text: str) -> list:
        try:
            return [item_type(item) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}") from None

    read.__name__ = f"comma-separated {item_type.__name__}"
    return read


def _hide_snake_case(action: argparse.Action) -> None:
    """Show ``--max-new-tokens`` rather than also ``--max_new_tokens`` (which still parses)."""
    shown = [s for s in action.option_strings if "_" not in s]
    if shown:
        action.option_strings[:] = shown


def _name_value(action: argparse.Action) -> None:
    """The value's name in ``--help`` after the flag shown (``--output OUTPUT``, ``--verbose [true|false]``)."""
    if action.metavar is not None or action.choices is not None:
        return
    if action.type is string_to_bool:
        action.metavar = "true|false"
    else:
        action.metavar = action.option_strings[0].lstrip("-").replace("-", "_").upper()


def flag(parser: argparse.ArgumentParser, dest: str) -> str:
    """The flag a field is given with on ``parser``'s command line (``output_dir`` -> ``--output``)."""
    for action in parser._actions:
        if action.dest == dest and action.option_strings and action.const is not False:
            return action.option_strings[0]
    return dest


def in_flag_names(message: str, parser: argparse.ArgumentParser, settings) -> str:
    """``message`` with every field name of ``settings`` written as its flag: what a dataclass's own check says
    (``speed_prompts (3) cannot exceed num_prompts (2)``) as the user typed it."""
    names = sorted((f.name for f in dataclasses.fields(settings)), key=len, reverse=True)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, names)) + r")(?![\w-])")
    return pattern.sub(lambda match: flag(parser, match.group(1)), message)


def check_bounds(parser: argparse.ArgumentParser, settings) -> None:
    """Refuse a value outside its field's ``bounds``, naming the flag: ``--threshold must be in [0, 1], got 7``."""
    for field in dataclasses.fields(settings):
        bounds = field.metadata.get("bounds")
        value = getattr(settings, field.name)
        if bounds is None or value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if not _within(item, bounds):
                raise UsageError(f"{flag(parser, field.name)} must be {_describe(bounds)}, got {item}")


def _within(value, bounds) -> bool:
    low, high = bounds
    return (low is None or value >= low) and (high is None or value <= high)


def _describe(bounds) -> str:
    low, high = bounds
    if low is not None and high is not None:
        return f"in [{low:g}, {high:g}]"
    return f">= {low:g}" if low is not None else f"<= {high:g}"


def note_deprecated(parser: SettingsParser, argv: list[str]) -> None:
    """A note on stderr for each old spelling used (it still works)."""
    for token in argv:
        name = token.split("=", 1)[0]
        if name in parser.deprecated:
            print(f"hf-dspark: note: {name} is deprecated; use {parser.deprecated[name]}", file=sys.stderr)


def build_settings(parser: argparse.ArgumentParser, namespace: argparse.Namespace, types: tuple) -> list:
    """One instance per settings dataclass from the parsed flags; a dataclass's own check (``__post_init__``)
    failing is a usage error in flag names."""
    built = []
    for kind in types:
        values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(kind)
                  if f.init and hasattr(namespace, f.name)}
        try:
            built.append(kind(**values))
        except ValueError as err:
            raise UsageError(in_flag_names(str(err), parser, kind)) from None
    for settings in built:
        check_bounds(parser, settings)
    return built
