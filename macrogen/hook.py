"""The import hook: modules that import macrogen are expanded as they are imported.

    import macrogen.hook
    macrogen.hook.install()        # before importing the modules that use macros
    import model                   # expanded (from the cache when warm)

or ``python -m macrogen run train.py [args]`` (also ``torchrun -m macrogen run
train.py``), which expands the script itself as well.

*What is expanded.* A module found as a ``.py`` file whose source imports
macrogen (``import macrogen``, ``from macrogen import ...``), decided by a regular
expression on its bytes before anything is parsed. Every other module gets
exactly the spec it would get without the hook: its own loader, its own ``.pyc``.

*Cache.* See ``macrogen.cache``: keyed by content, not mtime; atomic writes;
corrupt entries are rebuilt, never run.

*Tracebacks.* Expanded code is compiled twice and spliced function by function.
What the user wrote keeps the user's file name and line numbers; a line that a
macro site became reports the site's line (the ``with``, decorator or ``if``
line). What macrogen generated (helpers, kernels) keeps the expanded file's name
and lines, so its frames show the generated code and ``inspect.getsource`` (which
Triton's ``jit`` needs) reads it back correctly; except a generated function made
of the user's own lines (``@pipeline``'s statements of ``forward``), which shows them.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import linecache
import os
import re
import stat
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from macrogen import cache
from macrogen.autotune.rank_tuning import RankTuning
from macrogen.runtime import environment

__all__ = [
    "MacroExpansionError",
    "MacroFinder",
    "MacroLoader",
    "Options",
    "Record",
    "imports_macrogen",
    "install",
    "records",
    "run_script",
    "uninstall",
]

DISABLE_ENV = "MACROGEN_DISABLE"  # "1": install() does nothing, `macrogen run` runs plain Python
CACHE_DIR_ENV = "MACROGEN_CACHE_DIR"
TUNING_ENV = "MACROGEN_TUNING"
SHOW_ENV = "MACROGEN_SHOW_EXPANDED"
# the device kind whose tuning winners every rank takes where the kinds disagree on a value
# ranks must share (autotune/rank_tuning.py); unset: the newest record's
TUNING_DEVICE_ENV = "MACROGEN_TUNING_DEVICE"
# autotune.database.DEFAULT_NAME, written out: importing the database imports libcst,
# which a warm import must not pay for when no database exists.
TUNING_FILE = "macrogen_tuning.json"

# The import forms the expander resolves macros through (see expand/sites.py).
_IMPORTS_MACROGEN = re.compile(
    rb"(?:^|;)[ \t]*(?:from[ \t]+macrogen(?:\.markers)?[ \t]+import\b"
    rb"|import[ \t]+(?:[\w.]+(?:[ \t]+as[ \t]+\w+)?[ \t]*,[ \t]*)*macrogen\b)",
    re.MULTILINE,
)
_STDLIB = os.path.dirname(os.__file__) + os.sep
# macrogen and the packages it is built on never import macrogen's markers: their
# modules (~800 files for `import torch`) are not even read.
_NEVER_MACROS = frozenset({"macrogen", "torch", "triton", "libcst", "jinja2", "numpy"})
_PathFinder = importlib.machinery.PathFinder


def imports_macrogen(source: bytes) -> bool:
    """The cheap pre-check: does this source import macrogen? Nothing is parsed."""
    return b"macrogen" in source and _IMPORTS_MACROGEN.search(source) is not None


class MacroExpansionError(ImportError):
    """A module's macros could not be expanded. ``str()`` is the report ``macrogen expand`` prints."""

    def __init__(self, report: str, *, name: str | None = None, path: str | None = None):
        super().__init__(report, name=name, path=path)
        self.report = report


class Options(NamedTuple):
    target: str | None = None  # "cpu" / "cuda" fixes target() branches; None: run-time check
    tuning: Path | None = None  # None: macrogen_tuning.json beside each source, if it exists
    cache_dir: Path | None = None  # None: __pycache__ beside each source
    show: bool = False  # print each module macrogen loads, warm or cold, on stderr
    device: str | None = None  # $MACROGEN_TUNING_DEVICE: the job's device name for tuning


class Record(NamedTuple):
    """One module the hook loaded: what ``--show-expanded`` prints."""

    name: str
    path: str
    expanded: str | None  # the expanded code's file; None: the module has no macro sites
    sites: tuple[tuple[str, int], ...]
    cache: str  # "hit", or why it was expanded: "missing", "stale", "corrupt", "untrusted"


_records: list[Record] = []


def records() -> list[Record]:
    """The modules expanded through the hook in this process, in load order."""
    return list(_records)


# -- installing -------------------------------------------------------------------------
def install(
    *,
    target: str | None = None,
    tuning: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    show: bool | None = None,
) -> MacroFinder | None:
    """Expand modules that import macrogen from now on; None when ``MACROGEN_DISABLE=1``.

    ``tuning`` defaults to ``$MACROGEN_TUNING``, ``cache_dir`` to ``$MACROGEN_CACHE_DIR``,
    ``show`` to ``$MACROGEN_SHOW_EXPANDED``. Modules imported before ``install()`` stay
    as they are. A second ``install()`` with options replaces the first; without any,
    it keeps it (a script that installs the hook itself, run by ``macrogen run
    --target cuda``, keeps the target).
    """
    if disabled():
        uninstall()
        return None
    installed = [f for f in sys.meta_path if isinstance(f, MacroFinder)]
    if installed and (target, tuning, cache_dir, show) == (None, None, None, None):
        return installed[0]
    uninstall()
    finder = MacroFinder(options(target=target, tuning=tuning, cache_dir=cache_dir, show=show))
    # Right before PathFinder: finders that go first (editable installs, setuptools'
    # distutils shim, pytest's assertion rewriting) keep going first.
    at = next(
        (i for i, f in enumerate(sys.meta_path) if f is _PathFinder),
        len(sys.meta_path),
    )
    sys.meta_path.insert(at, finder)
    return finder


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, MacroFinder)]


def disabled() -> bool:
    return environment.flag(DISABLE_ENV)


def options(
    *,
    target: str | None = None,
    tuning: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    show: bool | None = None,
) -> Options:
    """Options from arguments, else the environment; paths made absolute now."""
    if target not in (None, "cpu", "cuda"):
        raise ValueError(f"target must be 'cpu', 'cuda' or None, not {target!r}")
    tuning = tuning or environment.text(TUNING_ENV)
    cache_dir = cache_dir or environment.text(CACHE_DIR_ENV)
    if show is None:
        show = environment.flag(SHOW_ENV)
    return Options(
        target,
        Path(os.path.abspath(tuning)) if tuning else None,
        Path(os.path.abspath(cache_dir)) if cache_dir else None,
        bool(show),
        environment.text(TUNING_DEVICE_ENV),
    )


class MacroFinder:
    """A meta-path finder that hands macro modules to ``MacroLoader`` and nothing else."""

    def __init__(self, options: Options):
        self.options = options

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        spec = _PathFinder.find_spec(fullname, path, target)
        if spec is None:
            return None
        if (
            type(spec.loader) is not importlib.machinery.SourceFileLoader
            or spec.origin is None  # (a SourceFileLoader's spec has one)
            or fullname.partition(".")[0] in _NEVER_MACROS
            or _in_stdlib(spec.origin)
            or not _imports_macrogen_file(spec.origin)
        ):
            # The usual spec: PathFinder's own answer when it is next in line (no second
            # search), else None so that the finders in between get their turn.
            return spec if self._path_finder_is_next() else None
        spec.loader = MacroLoader(fullname, spec.origin, self.options)
        return spec

    def _path_finder_is_next(self) -> bool:
        meta_path = sys.meta_path
        for i, finder in enumerate(meta_path):
            if finder is self:
                return i + 1 < len(meta_path) and meta_path[i + 1] is _PathFinder
        return False

    def invalidate_caches(self) -> None:
        pass  # nothing cached in memory; PathFinder invalidates its own


def _imports_macrogen_file(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return imports_macrogen(os.read(fd, os.fstat(fd).st_size + 1))
    except OSError:
        return False
    finally:
        os.close(fd)


def _in_stdlib(origin: str) -> bool:
    # The standard library never imports macrogen: skip reading it. site-packages
    # can live under the same prefix (no venv), so it is read.
    return (
        origin.startswith(_STDLIB)
        and "site-packages" not in origin
        and "dist-packages" not in origin
    )


class MacroLoader(importlib.machinery.SourceFileLoader):
    """A SourceFileLoader whose code comes from the expanded source, through the cache."""

    def __init__(self, fullname: str, path: str, options: Options):
        super().__init__(fullname, path)
        self.options = options

    def get_code(self, fullname: str) -> types.CodeType:
        try:
            return load(Path(os.path.abspath(self.path)), fullname, self.options)
        except MacroExpansionError as e:
            raise e.with_traceback(None) from None  # the report says it all; our frames don't


# -- loading ------------------------------------------------------------------------------
def load(path: Path, name: str, options: Options) -> types.CodeType:
    """The code of the module at ``path`` (absolute): from the cache, else expanded and cached."""
    source = path.read_bytes()
    tuning, db = _tuning(path, source, options)
    entry_key = cache.key(source, path=path, target=options.target, tuning=tuning.key())
    where = cache.locate(
        path, target=options.target, cache_dir=options.cache_dir, device=tuning.tag()
    )
    distrust = cache.trust(where, options.cache_dir)
    if distrust is None:
        entry, status = cache.read(where.entry, entry_key)
    else:
        entry, status = None, "untrusted"
    if status == "untrusted":
        _warn_once(
            f"macrogen: warning: not using the import cache in {where.entry.parent}:"
            f" {distrust or 'an entry there belongs to another user or is writable by others'};"
            " expanding afresh (see docs/hook.md)"
        )
    if entry is None:
        for key in tuning.stale:
            print(
                f"{path}: warning: tuning entry {key!r} is stale (the source changed); using its default",
                file=sys.stderr,
            )
        entry = _expand(path, name, source, options, tuning, where, db)
        try:  # (PYTHONDONTWRITEBYTECODE does not apply: this caches expansions)
            if distrust is None:  # never write into a folder that is not ours alone
                cache.write(where, entry_key, entry, cache_dir=options.cache_dir)
        except OSError:
            pass  # a read-only tree runs uncached, as Python does without its .pyc
    for warning in entry.warnings:  # a bad winner: said on warm imports too
        _warn_once(warning)
    if entry.expanded is not None:
        # Generated frames name this file; serve it from memory even if it is deleted.
        linecache.cache[str(where.expanded)] = (
            len(entry.expanded),
            None,
            entry.expanded.splitlines(keepends=True),
            str(where.expanded),
        )
    record = Record(
        name,
        str(path),
        None if entry.expanded is None else str(where.expanded),
        entry.sites,
        status,
    )
    _records.append(record)
    if options.show:
        print(_describe(record), file=sys.stderr, flush=True)
    return entry.code


def _describe(record: Record) -> str:
    how = "cached" if record.cache == "hit" else f"expanded now: cache {record.cache}"
    if record.expanded is None:
        return f"macrogen: {record.name} ({record.path}): no macro sites [{how}]"
    sites = ", ".join(f"{macro}:{line}" for macro, line in record.sites)
    return f"macrogen: {record.name} ({record.path}): {sites} -> {record.expanded} [{how}]"


def _tuning(path: Path, source: bytes, options: Options) -> tuple[RankTuning, Path | None]:
    """The tuning database's values for this file on this rank, and the database's path.

    Nothing without a database. A bad database must not break every import beside it: the
    defaults run (what `macrogen expand` reports as an error, the hook warns about once).
    The values are this rank's (``rank_tuning``): where the recorded device kinds
    disagree, this rank's kind is looked up.
    """
    db = options.tuning or path.parent / TUNING_FILE
    try:
        mode = os.stat(db).st_mode
    except FileNotFoundError:
        return _NO_TUNING, None
    except OSError as e:
        _warn_once(f"macrogen: warning: can't use the tuning database {db}, using defaults: {e}")
        return _NO_TUNING, None
    if not stat.S_ISREG(mode):  # a FIFO would hang the import; say what it is instead
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        _warn_once(
            f"macrogen: warning: can't use the tuning database {db} ({what}), using defaults"
        )
        return _NO_TUNING, None
    from macrogen.autotune import rank_tuning
    from macrogen.files import read_source

    try:
        text = read_source(source)[0]
        tuning = rank_tuning.lookup(
            db, text, file=path.name, target=options.target, job_device=options.device
        )
    except (OSError, ValueError, SyntaxError) as e:
        _warn_once(f"macrogen: warning: can't use the tuning database, using defaults: {e}")
        return _NO_TUNING, None
    for note in tuning.notes:
        _warn_once(note)
    return tuning, db


_NO_TUNING = RankTuning({}, [])  # no database: every tunable at its default
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr, flush=True)


def _expand(
    path: Path,
    name: str,
    source: bytes,
    options: Options,
    tuning: RankTuning,
    where: cache.Location,
    db: Path | None,
) -> cache.Entry:
    from macrogen.expand import ExpansionError, expand_source
    from macrogen.files import read_source

    try:
        text, _ = read_source(source)
    except (SyntaxError, UnicodeDecodeError) as e:
        raise MacroExpansionError(
            f"{path}:1:1: error: can't decode the file: {e}", name=name, path=str(path)
        ) from None
    warnings: tuple[str, ...] = ()
    values = tuning.shared
    try:
        result = expand_source(text, path=str(path), target=options.target, tuning=values)
        if tuning.differ:  # which macro each tunable feeds says whose value it takes
            from macrogen.autotune import rank_tuning, space

            values, notes = rank_tuning.choose(tuning, space.parameters(result))
            warnings = tuple(notes)
            if values != tuning.shared:
                result = expand_source(text, path=str(path), target=options.target, tuning=values)
    except ExpansionError as e:
        if not values:
            raise MacroExpansionError(e.report(), name=name, path=str(path)) from None
        # A winner the source no longer accepts (not one of the choices): the database
        # is bad, not the program. Expand with the defaults, as for a malformed file.
        try:
            result = expand_source(text, path=str(path), target=options.target, tuning={})
        except ExpansionError as plain:
            raise MacroExpansionError(plain.report(), name=name, path=str(path)) from None
        warnings = tuple(
            f"macrogen: warning: can't use the tuning database {db} at"
            f" {d.path}:{d.line}:{d.col}: {d.message}; using the defaults for this file"
            for d in e.diagnostics
        )  # load() says them, now and at each warm import
    if not result.changed:
        code = compile(source, str(path), "exec", dont_inherit=True)
        return cache.Entry(code, None, (), warnings)
    from macrogen.linemap import compile_expanded

    code = compile_expanded(text, result.code, str(path), str(where.expanded))
    return cache.Entry(code, result.code, tuple(result.sites), warnings)


# -- running a script -------------------------------------------------------------------------
def run_script(
    script: str,
    argv: list[str],
    *,
    target: str | None = None,
    tuning: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    show: bool | None = None,
) -> None:
    """Run ``script`` as ``__main__`` the way ``python script args...`` would, with the hook.

    The hook is installed (see ``install``) and the script itself is expanded and
    cached like any module; ``sys.argv``, ``sys.path[0]`` and ``sys.modules["__main__"]``
    are set for it and restored afterwards.
    """
    path = Path(os.path.abspath(script))
    finder = install(target=target, tuning=tuning, cache_dir=cache_dir, show=show)
    source = path.read_bytes()
    if finder is not None and imports_macrogen(source):
        code = load(path, "__main__", finder.options)
    else:
        code = compile(source, str(path), "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    module.__cached__ = None  # type: ignore[attr-defined]
    module.__builtins__ = builtins  # type: ignore[attr-defined]
    module.__spec__ = None  # as for `python script.py`
    if finder is not None:
        module.__loader__ = MacroLoader("__main__", str(path), finder.options)
    saved = sys.modules.get("__main__"), sys.argv, sys.path[:1]
    sys.modules["__main__"] = module
    sys.argv = [script, *argv]
    sys.path[:1] = [str(path.parent)]
    try:
        exec(code, module.__dict__)
    finally:
        main, sys.argv, sys.path[:1] = saved
        if main is not None:
            sys.modules["__main__"] = main
