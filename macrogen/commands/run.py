"""Run a script with the import hook: macros are expanded as modules are imported.

Runs SCRIPT as ``python SCRIPT ARGS...`` would, with the import hook installed:
the script and every module it imports that uses macrogen are expanded (and
cached) on import. Under torchrun: ``torchrun --nproc-per-node N -m macrogen run SCRIPT``.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

from macrogen import hook
from macrogen.commands import HelpFormatter, describe


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run",
        help="run a script, expanding macros as modules are imported",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--show-expanded",
        action="store_true",
        help="print each module macrogen loads and where its expanded code is (also when cached)",
    )
    p.add_argument(
        "--target", choices=("cpu", "cuda"), help="fix target() branches for this device"
    )
    p.add_argument(
        "--tuning",
        metavar="FILE",
        help="tuning database (default: $MACROGEN_TUNING, else macrogen_tuning.json beside each file)",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="where the cache lives (default: $MACROGEN_CACHE_DIR, else __pycache__ beside each file)",
    )
    p.add_argument("script", metavar="SCRIPT", help="the Python file to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for SCRIPT")
    return p


def run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.script):
        print(f"macrogen run: error: can't open file {args.script!r}", file=sys.stderr)
        return 2
    try:
        hook.run_script(
            args.script,
            args.args,
            target=args.target,
            tuning=args.tuning,
            cache_dir=args.cache_dir,
            show=args.show_expanded or None,
        )
    except hook.MacroExpansionError as e:  # the user's macro errors: the report, no traceback
        print(e.report, file=sys.stderr)
        return 1
    except Exception as e:  # the script's own error: its traceback, without ours on top
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None and _ours(tb.tb_frame):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    return 0


def _ours(frame: types.FrameType) -> bool:
    return frame.f_code.co_filename in (__file__, hook.__file__)
