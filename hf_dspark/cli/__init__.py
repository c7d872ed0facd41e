"""``hf-dspark <command>``: one module per command, each declaring its flags as settings dataclasses.

A command module holds ``HELP`` (its line in ``hf-dspark --help``), ``SETTINGS`` (the dataclasses its flags come
from, fields in order), optionally ``DEFAULTS`` (where the command line's default differs from the dataclass's),
optionally ``check(*settings)`` (refuses bad input before anything loads) and ``run(*settings) -> int``.

Errors print as one line (``hf-dspark: error: ...``) unless ``--debug`` is given; the exit status is 2 for bad
input (argparse's errors, and every ``UsageError`` or dataclass check found before a model loads) and 1 for a
failure while running.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from argparse import ArgumentDefaultsHelpFormatter

from .. import _register
from .arguments import SettingsParser, UsageError, build_settings, flag, note_deprecated
from .common import DRAFT_ROUNDS, DRAFT_TREES, Output, check_model_paths

# command -> its module in this package
COMMANDS = {name: importlib.import_module(f".{name.replace('-', '_')}", __name__)
            for name in ("generate", "data", "train", "features", "bench", "calibrate", "eval", "push", "profile",
                         "export", "demo", "bench-serve", "serve")}

__all__ = ["COMMANDS", "DRAFT_ROUNDS", "DRAFT_TREES", "UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """``hf-dspark`` and one subparser per command, its flags generated from the command's settings."""
    parser = argparse.ArgumentParser(prog="hf-dspark", description="DSpark speculative decoding for transformers",
                                     formatter_class=ArgumentDefaultsHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=SettingsParser,
                                     help="the command to run (`hf-dspark COMMAND --help`: its flags)")
    for name, module in COMMANDS.items():
        sub = commands.add_parser(name, help=module.HELP, description=module.HELP,
                                  dataclass_types=[*module.SETTINGS, Output])
        _command_defaults(sub, getattr(module, "DEFAULTS", {}))
    return parser


def _command_defaults(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """The command line's own defaults, where they differ from the dataclass's (a default also makes a flag
    optional)."""
    parser.set_defaults(**defaults)
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False


def subparser(parser: argparse.ArgumentParser, command: str) -> SettingsParser:
    """The parser of one command."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


def main(argv: list[str] | None = None) -> int:
    """Runs ``hf-dspark argv`` (default: the process's arguments) and returns its exit status."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    module, sub = COMMANDS[args.command], subparser(parser, args.command)
    note_deprecated(sub, argv)
    _quiet(verbose=args.verbose, debug=args.debug)
    try:
        settings = build_settings(sub, args, module.SETTINGS)
        for each in settings:
            check_model_paths(each, lambda name: flag(sub, name))
        if hasattr(module, "check"):
            module.check(*settings)
        _register()  # deferred by the console script (hf_dspark_entry) until nothing is left to refuse
        return module.run(*settings)
    except KeyboardInterrupt:
        print("hf-dspark: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one clear line unless --debug
        if args.debug:
            raise
        print(f"hf-dspark: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1


def _quiet(verbose: bool, debug: bool) -> None:
    """Logging at INFO with --debug, else WARNING; the weight-loading progress bars only with --verbose."""
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING, format="%(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not verbose:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        disable_progress_bars()
