"""``macrogen``: one subcommand per module in ``macrogen.commands``.

Each subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``;
the work itself is a library function that tests call too.
Exit codes: 0 success, 1 errors in the user's input, 2 usage, 3 macrogen's own bug.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from macrogen import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="macrogen",
        description="Expand macrogen macros in PyTorch training code into parallel code and Triton kernels.",
    )
    parser.add_argument("--version", action="version", version=f"macrogen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    import macrogen.commands as commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"macrogen.commands.{info.name}")
        module.add_parser(sub).set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("macrogen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
