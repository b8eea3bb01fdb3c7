"""The CLI's subcommands, one module each (found by ``macrogen.cli``)."""

from __future__ import annotations

import argparse


def describe(doc: str | None) -> str:
    """A module docstring as --help shows it: reStructuredText's double backticks dropped."""
    return (doc or "").replace("``", "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; an option with a default value shows it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" not in text
            and action.default not in (None, False, argparse.SUPPRESS)
            and action.option_strings
        ):
            text += " (default: %(default)s)"
        return text
