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

EPILOG = """\
commands:
  macrogen expand train.py -o train_dp.py     write the expanded program
  macrogen run train.py [ARGS...]             run it, expanding on import (also under torchrun)
  macrogen autotune train.py --entry :build   measure tunable(...) choices, record the winners
  macrogen plan train.py --world-size 64      rank mg.parallelize layouts by predicted time, memory
  macrogen verify train.py --entry :build     one parallel step against the serial one, per gradient
  macrogen cache info|clear                   the import hook's cache

exit status:
  0  success
  1  errors in the input (reported as path:line:col: error: ...), an unreadable
     input or unwritable output; for expand --check: an output is stale
  2  usage: bad options or arguments
  3  a macrogen bug (an internal error; please report it)

documentation: README.md and docs/ (expand.md, autotune.md, hook.md,
data_parallel.md, tensor_parallel.md, tile.md) in the macrogen repository.
Each command has its own --help.
"""


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given the arguments, only the command they name is imported.

    (Start-up is part of every ``macrogen expand``: a command module that imports
    something heavy at top level would slow every other command.)"""
    parser = argparse.ArgumentParser(
        prog="macrogen",
        description="Expand macrogen macros in PyTorch training code into parallel code and Triton kernels.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"macrogen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    import macrogen.commands as commands

    names = sorted(info.name for info in pkgutil.iter_modules(commands.__path__))
    if argv and argv[0] in names:
        names = [argv[0]]
    for name in names:
        module = importlib.import_module(f"macrogen.commands.{name}")
        module.add_parser(sub).set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("macrogen: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # whatever a command did not handle is macrogen's bug
        # Exit 3, never Python's 1 (which means "your input"), in one line worth reporting.
        import traceback

        frames = traceback.extract_tb(e.__traceback__)
        where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        print(
            f"macrogen {args.command}: internal error (a macrogen bug, please report it):"
            f" {type(e).__name__}: {e}{where}",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
