"""List (info) or remove (clear) the import hook's cached expansions.

In each PATH (default: the current directory) macrogen's files in ``__pycache__``
folders are affected, never the interpreter's ``.pyc`` files; ``--cache-dir``
(default: ``$MACROGEN_CACHE_DIR``) is a cache directory, searched whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from macrogen import cache, hook
from macrogen.commands import HelpFormatter, describe
from macrogen.runtime import environment


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cache",
        help="clear or list the import hook's cache",
        description=describe(__doc__),
        formatter_class=HelpFormatter,
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (
        ("clear", "remove the cached expansions"),
        ("info", "list the cached expansions"),
    ):
        a = actions.add_parser(name, help=help_text, description=help_text)
        a.add_argument("paths", nargs="*", metavar="PATH", help="source trees (default: .)")
        a.add_argument(
            "--cache-dir", metavar="DIR", help=f"cache directory (default: ${hook.CACHE_DIR_ENV})"
        )
    return p


def run(args: argparse.Namespace) -> int:
    trees = [Path(p) for p in args.paths or ["."]]
    missing = [str(t) for t in trees if not t.is_dir()]
    if missing:
        print(f"macrogen cache: error: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    cache_dir = args.cache_dir or environment.text(hook.CACHE_DIR_ENV)
    cache_dirs = [Path(cache_dir)] if cache_dir else []
    if args.action == "clear":
        count, size = cache.clear(trees, cache_dirs)
        print(f"removed {count} file{'s' * (count != 1)} ({_size(size)})")
        return 0
    files = sorted(cache.cache_files(trees, cache_dirs))
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        print(f"{_size(size):>10}  {path}")
    print(f"{len(files)} file{'s' * (len(files) != 1)}, {_size(total)}")
    return 0


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"
