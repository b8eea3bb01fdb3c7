"""The import hook in this process: what it expands, its cache, tracebacks, errors.

Each test gets a fresh folder on sys.path with the hook installed; module names
are unique per test and removed from sys.modules afterwards.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.machinery
import inspect
import io
import marshal
import os
import sys
import textwrap
import traceback
from pathlib import Path

import pytest

import macrogen
from macrogen import cache, hook, linemap
from macrogen.autotune import database
from macrogen.commands.expand import expand_files
from macrogen.expand import expand_source

FUSED = """\
import torch
import torch.distributed as dist
import macrogen as mg

N = mg.define(4)


def sync(a, b):
    x = 1
    with mg.fused_allreduce():
        dist.all_reduce(a)
        dist.all_reduce(b)
    return x


def later():
    y = [1, 2][N]  # IndexError, line 17
    return y
"""

# generated functions and a Triton kernel whose source comes from the cache entry
TILE = """\
import torch
import macrogen as mg


@mg.tile(i=16)
def double(out, x):
    (N,) = x.shape
    for i in range(N):
        out[i] = 2.0 * x[i]
"""

CONSTANTS = """\
import macrogen as mg

A = mg.define(6)
SCALE = mg.tunable(2, choices=[1, 2, 3])


def product():
    return A * SCALE
"""


class Folder:
    def __init__(self, path: Path):
        self.path = path

    def write(self, name: str, source: str) -> Path:
        file = self.path / f"{name}.py"
        file.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        return file

    def load(self, name: str):
        """Import ``name`` afresh; returns the module and the hook's record of it (or None)."""
        sys.modules.pop(name, None)
        before = len(hook.records())
        module = importlib.import_module(name)
        new = hook.records()[before:]
        return module, (new[-1] if new else None)

    def cache_files(self) -> list[str]:
        folder = self.path / "__pycache__"
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


@pytest.fixture
def folder(tmp_path, monkeypatch):
    for var in (hook.DISABLE_ENV, hook.CACHE_DIR_ENV, hook.TUNING_ENV, hook.SHOW_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = set(sys.modules)
    hook.install()
    yield Folder(tmp_path)
    hook.uninstall()
    for name in set(sys.modules) - modules:
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.mark.parametrize(
    "source",
    [
        "import macrogen\n",
        "import macrogen as mg\n",
        "import torch, macrogen as mg\n",
        "import macrogen.hook; macrogen.hook.install()\n",
        "from macrogen import define\n",
        "from macrogen import (\n    define,\n)\n",
        "from macrogen.markers import tile as t\n",
        "def f():\n    import macrogen as mg\n",
        "import os; import macrogen\n",
    ],
)
def test_pre_check_sees_every_import_of_macrogen(source):
    assert hook.imports_macrogen(source.encode())


@pytest.mark.parametrize(
    "source",
    [
        "import torch\n",
        "# import macrogen\n",
        "x = 'macrogen'\n",
        "import macrogen_tools\n",
        "from macrogen.runtime.fused import all_reduce_fused\n",
    ],
)
def test_pre_check_passes_over_other_modules(source):
    assert not hook.imports_macrogen(source.encode())


def test_finder_sits_before_path_finder_and_passes_other_modules_through(folder):
    at = [type(f) for f in sys.meta_path].index(hook.MacroFinder)
    assert sys.meta_path[at + 1] is importlib.machinery.PathFinder
    folder.write("mg_plain", "import math\nVALUE = math.pi\n")
    module, record = folder.load("mg_plain")
    assert record is None
    assert type(module.__spec__.loader) is importlib.machinery.SourceFileLoader
    assert folder.cache_files() in ([], [f"mg_plain.{sys.implementation.cache_tag}.pyc"])


def test_macro_module_is_expanded_and_cached(folder):
    src = folder.write("mg_fused", FUSED)
    module, record = folder.load("mg_fused")
    assert isinstance(module.__spec__.loader, hook.MacroLoader)
    assert record.cache == "missing"
    assert record.sites == (("define", 5), ("fused_allreduce", 10))
    assert hasattr(module, "_fused_allreduce_l10")  # the generated helper is there
    tag = sys.implementation.cache_tag
    assert folder.cache_files() == [
        f"mg_fused.macrogen-any.{tag}.mgc",
        "mg_fused.macrogen-any.py",
    ]
    expanded = Path(record.expanded).read_text()
    assert expanded == expand_source(FUSED, path=str(src)).code
    module, record = folder.load("mg_fused")
    assert record.cache == "hit"
    assert module.N == 4


def test_touching_keeps_the_entry_and_editing_reexpands(folder):
    src = folder.write("mg_edit", CONSTANTS)
    module, record = folder.load("mg_edit")
    assert (record.cache, module.product()) == ("missing", 12)
    future = src.stat().st_mtime + 3600
    os.utime(src, (future, future))
    module, record = folder.load("mg_edit")
    assert (record.cache, module.product()) == ("hit", 12)
    folder.write("mg_edit", CONSTANTS.replace("define(6)", "define(7)"))
    module, record = folder.load("mg_edit")
    assert (record.cache, module.product()) == ("stale", 14)
    assert len([n for n in folder.cache_files() if n.endswith(".mgc")]) == 1


def test_upgrading_macrogen_reexpands(folder, monkeypatch):
    folder.write("mg_version", CONSTANTS)
    assert folder.load("mg_version")[1].cache == "missing"
    monkeypatch.setattr(cache, "__version__", macrogen.__version__ + ".post1")
    assert folder.load("mg_version")[1].cache == "stale"
    assert folder.load("mg_version")[1].cache == "hit"


def _tune(db: Path, source: str, file: str, winner: dict) -> None:
    tuning = database.Database(db)
    record = tuning.new_record({"file": file, "target": None, "params": sorted(winner)}, {})
    record["source_hash"] = database.source_hash(source)
    record["winner"] = winner
    tuning.save()


def test_retuning_reexpands_with_the_winner(folder, tmp_path, monkeypatch):
    assert database.default_path(tmp_path / "x.py") == tmp_path / hook.TUNING_FILE
    folder.write("mg_tuned", CONSTANTS)
    module, record = folder.load("mg_tuned")
    assert (record.cache, module.SCALE) == ("missing", 2)
    _tune(tmp_path / hook.TUNING_FILE, CONSTANTS, "mg_tuned.py", {"SCALE": 3})
    module, record = folder.load("mg_tuned")
    assert (record.cache, module.SCALE) == ("stale", 3)
    assert "# tunable SCALE = 3 (tuned" in Path(record.expanded).read_text()
    assert folder.load("mg_tuned")[1].cache == "hit"
    # an explicit database wins over the default one
    other = tmp_path / "other" / "tuning.json"
    other.parent.mkdir()
    _tune(other, CONSTANTS, "mg_tuned.py", {"SCALE": 1})
    hook.install(tuning=other)
    module, record = folder.load("mg_tuned")
    assert (record.cache, module.SCALE) == ("stale", 1)


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _swap_payload(data: bytes) -> bytes:
    """Whole, well-formed marshal data that would set a flag if it ran."""
    evil = compile("import builtins\nbuiltins._macrogen_ran_corrupt_entry = True\n", "x", "exec")
    payload = marshal.dumps((evil, None, ()))
    magic, key, _, digest = cache.HEADER.unpack_from(data)
    return cache.HEADER.pack(magic, key, len(payload), digest) + payload


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: b"",
        lambda data: os.urandom(len(data)),  # garbage
        lambda data: data[: cache.HEADER.size] + os.urandom(len(data) - cache.HEADER.size),
        _flip_last_byte,
        _swap_payload,
    ],
    ids=["truncated", "empty", "garbage", "garbage-payload", "flipped-byte", "swapped-payload"],
)
def test_a_corrupt_entry_is_rebuilt_never_run(folder, corrupt):
    folder.write("mg_corrupt", CONSTANTS)
    folder.load("mg_corrupt")
    entry = next((folder.path / "__pycache__").glob("*.mgc"))
    good = entry.read_bytes()
    entry.write_bytes(corrupt(good))
    module, record = folder.load("mg_corrupt")
    assert record.cache == "corrupt"
    assert module.product() == 12
    assert not hasattr(builtins, "_macrogen_ran_corrupt_entry")
    key = cache.HEADER.unpack_from(good)[1]
    assert cache.read(entry, key)[1] == "hit"  # rebuilt whole
    assert folder.load("mg_corrupt")[1].cache == "hit"


def test_traceback_names_the_users_line_and_the_generated_code(folder, monkeypatch):
    from macrogen.runtime import fused

    src = folder.write("mg_trace", FUSED)
    module, record = folder.load("mg_trace")

    def failing_collective(*args, **kwargs):
        raise RuntimeError("collective failed")

    monkeypatch.setattr(fused.FusedAllReduce, "__call__", failing_collective)
    with pytest.raises(RuntimeError) as info:
        module.sync(None, None)
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{src}", line 10, in sync\n    with mg.fused_allreduce():\n' in text
    # user code below the generated helpers keeps its own line numbers and text
    with pytest.raises(IndexError) as info:
        module.later()
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{src}", line 17, in later\n    y = [1, 2][N]  # IndexError, line 17\n' in text
    # a failure inside generated code names the expanded file
    folder.write("mg_trace_tile", TILE)
    module, record = folder.load("mg_trace_tile")
    with pytest.raises(AttributeError) as info:
        module.double(None, None)
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{record.expanded}", line ' in text


def test_generated_kernels_read_their_source_even_without_the_file(folder):
    folder.write("mg_kernel", TILE)
    _, record = folder.load("mg_kernel")
    Path(record.expanded).unlink()  # served from the entry through linecache
    module, record = folder.load("mg_kernel")
    assert record.cache == "hit"
    kernel = getattr(module._double_kernel, "fn", module._double_kernel)
    assert inspect.getsource(kernel).startswith("@triton.jit")
    assert "def _double_kernel(" in inspect.getsource(kernel)
    assert "_double_triton(out, x)" in inspect.getsource(module.double)  # generated, from the entry


def test_macro_errors_raise_one_exception_with_the_cli_report(folder):
    src = folder.write(
        "mg_bad",
        """\
        import macrogen as mg

        A = mg.define(len("x"))
        B = mg.defne(2)
        """,
    )
    with pytest.raises(hook.MacroExpansionError) as info:
        folder.load("mg_bad")
    stderr = io.StringIO()
    assert expand_files([str(src)], stdout=io.BytesIO(), stderr=stderr) == 1
    assert str(info.value) == stderr.getvalue().rstrip("\n")
    assert str(info.value).startswith(f"{src}:3:")
    assert isinstance(info.value, ImportError) and info.value.name == "mg_bad"
    assert folder.cache_files() == []


def test_disabled_hook_installs_nothing(folder, monkeypatch):
    monkeypatch.setenv(hook.DISABLE_ENV, "1")
    assert hook.install() is None
    assert not any(isinstance(f, hook.MacroFinder) for f in sys.meta_path)
    folder.write("mg_off", FUSED)
    module, record = folder.load("mg_off")
    assert record is None and not hasattr(module, "_fused_allreduce_l10")
    assert type(module.__spec__.loader) is importlib.machinery.SourceFileLoader


def test_cache_dir_mirrors_the_source_tree_and_cache_clear_empties_it(
    folder, tmp_path, monkeypatch, capsys
):
    from macrogen.cli import main

    src = folder.write("mg_elsewhere", CONSTANTS)
    folder.load("mg_elsewhere")  # into __pycache__
    pyc = folder.path / "__pycache__" / f"other.{sys.implementation.cache_tag}.pyc"
    pyc.write_bytes(b"not ours")
    store = tmp_path / "store"
    hook.install(cache_dir=store)
    _, record = folder.load("mg_elsewhere")
    mirrored = store / src.parent.relative_to(src.parent.anchor)
    assert Path(record.expanded).parent == mirrored
    assert len(list(mirrored.glob("*.mgc"))) == 1
    assert main(["cache", "info", str(folder.path), "--cache-dir", str(store)]) == 0
    assert "4 files" in capsys.readouterr().out
    assert main(["cache", "clear", str(folder.path)]) == 0
    assert "removed 2 files" in capsys.readouterr().out
    assert folder.cache_files() == [pyc.name]  # the interpreter's files stay
    monkeypatch.setenv(hook.CACHE_DIR_ENV, str(store))
    assert main(["cache", "clear", str(folder.path)]) == 0
    assert "removed 2 files" in capsys.readouterr().out
    assert list(mirrored.iterdir()) == []


def test_line_map_keeps_user_lines_and_sends_generated_ones_to_their_site():
    source = "import macrogen as mg\n\nX = mg.define(1)\ny = X + 1\n"
    expanded = expand_source(source, path="m.py").code
    origin, kept = linemap.source_lines(source, expanded)
    lines = expanded.splitlines()
    assert origin[lines.index("y = X + 1")] == 4 and kept[lines.index("y = X + 1")]
    assert origin[lines.index("X = 1")] == 3 and not kept[lines.index("X = 1")]
    assert origin[0] == 1 and not kept[0]  # the generated header


def test_install_without_options_keeps_the_installed_hook(folder):
    finder = hook.install(target="cpu")
    assert hook.install() is finder  # e.g. a script's own install() under `macrogen run`
    assert hook.install(target="cuda").options.target == "cuda"
    assert sum(isinstance(f, hook.MacroFinder) for f in sys.meta_path) == 1
