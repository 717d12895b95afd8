"""How `--help` shows an option, for the trainer and every tool: its help text, then its default, once.

argparse's ArgumentDefaultsHelpFormatter appends "(default: %(default)s)" to every help text, even one that
already says what the default is ("keep the first q levels (default: all) (default: None)"). FlagHelpFormatter
appends the default only where the help text does not state one ("default:" in it), writes it as it would be
typed (none, false, 64,128,256), and marks a required option "(required)" instead. An option with no help text
shows none: every option needs one (tests/test_help.py).
"""
from __future__ import annotations

import argparse
import re

STATES_DEFAULT = re.compile(r"\bdefault:", re.IGNORECASE)


def shown_default(value) -> str:
    """A default as a user would type it: none, true/false, a list comma-separated."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(map(shown_default, value))
    return str(value)


def help_with_default(help_text: str | None, default, *, required: bool = False) -> str:
    """The help text as --help shows it (before argparse's %-expansion, so a % in the default is doubled)."""
    help_text = help_text or ""
    if STATES_DEFAULT.search(help_text):
        return help_text
    if required:
        return f"{help_text} (required)".lstrip()
    return f"{help_text} (default: {shown_default(default).replace('%', '%%')})".lstrip()


class FlagHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Options with their default (or "(required)"); the description and epilog as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if not action.option_strings or action.default is argparse.SUPPRESS or "%(default)" in (action.help or ""):
            return action.help
        return help_with_default(action.help, action.default, required=action.required)
