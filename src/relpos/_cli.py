"""What every ``relpos`` command line shares: the help layout and the subcommands' error reports."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from typing import Sequence

__all__ = ["CommandParser", "HelpFormatter"]

_STATED = re.compile(r"\(default\b|default:", re.IGNORECASE)


def _states_default(text: str) -> bool:
    """Whether a help string already says what its option defaults to ("(default ..." or "default: ...")."""
    return bool(_STATED.search(text))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, "(default: ...)", unless the help states it already
    (options whose default is ``None`` say in words what leaving them out does), the option is a flag
    (``store_true``: off unless given), required, or a positional; lines never break at a hyphen
    (``--train-len``, ``relpos-extrapolate`` stay whole)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or action.required or default is None or default is False
                or default is argparse.SUPPRESS or "%(default)" in text or _states_default(text)):
            return text
        return f"{text} (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:  # never break an option name at its hyphen
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False)


class CommandParser(argparse.ArgumentParser):
    """A parser of subcommands: an option a subcommand does not know is reported with that subcommand's
    usage (``usage: relpos bench ...``) and exits with status 2, not with the top-level usage."""

    def add_subparsers(self, **kwargs):
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        args = sys.argv[1:] if args is None else list(args)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._owner(parsed, args, extras).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _owner(self, parsed: argparse.Namespace, args: list[str], extras: list[str]) -> argparse.ArgumentParser:
        """The parser an unknown option belongs to: the subcommand's, unless it came before the subcommand's name
        (``relpos --misspelled buckets``: the top-level usage)."""
        command = self._command(parsed)
        name = command.prog.rsplit(" ", 1)[-1]
        if command is not self and name in args and args.index(extras[0]) < args.index(name):
            return self
        return command

    def _command(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the subcommand ``parsed`` names (this parser when there is none)."""
        commands = getattr(self, "_commands", None)
        if commands is None:
            return self
        return commands.choices.get(getattr(parsed, commands.dest, None), self)
