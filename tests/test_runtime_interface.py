"""``macrogen.runtime`` is the generated code's interface: expanded files import from it alone.

Every golden input and every example is expanded; each import the expansion added (any
import statement of the expanded file that the input did not have) must come from
``macrogen.runtime`` (a name its ``EXPORTS`` lists), or from torch, triton or
``macrogen.kernels``. Each exported name resolves to what its module defines, and the pass
refuses a macro that names a runtime module directly or a name the interface lacks.
"""

from __future__ import annotations

import ast
import collections
import importlib
from pathlib import Path

import pytest

import macrogen.runtime
from macrogen.expand import InternalError, expand_source
from macrogen.files import read_source
from tests.test_golden import GOLDEN

ROOT = Path(__file__).resolve().parent.parent
OTHERS = ("torch", "triton", "macrogen.kernels")  # what generated code may import besides


def _imports(code: str) -> collections.Counter[str]:
    """Every import statement of ``code``, as one line each (``from m import a as b``)."""
    found: collections.Counter[str] = collections.Counter()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                found[f"from {node.module} import {a.name}"] += 1
        elif isinstance(node, ast.Import):
            for a in node.names:
                found[f"import {a.name}"] += 1
    return found


def _expansions() -> list[tuple[str, str, str]]:
    """(name, input, expanded) of every golden case that expands (test_golden checks that its
    expected.py is the expansion) and of every example."""
    found = [
        (f"golden/{p.name}", _read(p / "input.py"), _read(p / "expected.py"))
        for p in sorted(GOLDEN.iterdir())
        if (p / "expected.py").is_file()
    ]
    for path in sorted(ROOT.glob("examples/*.py")):
        source = path.read_text()
        found.append((f"examples/{path.name}", source, expand_source(source, path=path.name).code))
    return found


def _read(path: Path) -> str:
    return read_source(path.read_bytes())[0]


def _outside(line: str) -> bool:
    """An import the interface does not allow."""
    module = line.split()[1]
    if module == "macrogen.runtime":
        return line.split()[3] not in macrogen.runtime.EXPORTS
    return not any(module == m or module.startswith(m + ".") for m in OTHERS)


def test_expanded_files_import_only_from_the_runtimes_interface():
    outside, added_somewhere = [], set()
    for name, source, code in _expansions():
        added = _imports(code) - _imports(source)
        added_somewhere |= set(added)
        outside += [f"{name}: {line}" for line in sorted(added) if _outside(line)]
    assert outside == []
    assert any(line.startswith("from macrogen.runtime import") for line in added_somewhere)


def test_every_export_is_what_its_module_defines():
    for name, module in macrogen.runtime.EXPORTS.items():
        defined = getattr(importlib.import_module(f"macrogen.runtime.{module}"), name)
        assert getattr(macrogen.runtime, name) is defined, name
    assert sorted(macrogen.runtime.__all__) == sorted(macrogen.runtime.EXPORTS)
    assert not set(macrogen.runtime.EXPORTS) & {p.stem for p in Path(macrogen.runtime.__file__).parent.glob("*.py")}  # fmt: skip


def test_a_runtime_module_named_directly_or_a_name_not_exported_is_refused():
    from macrogen.expand.context import Context, Options

    ctx = Context("", Options(path="t.py"), {})
    with pytest.raises(InternalError, match="imports from macrogen.runtime .its interface"):
        ctx.import_from("macrogen.runtime.pipeline", "PipelineConfig")
    with pytest.raises(InternalError, match="exports no 'Pipeline': add it to EXPORTS"):
        ctx.import_from("macrogen.runtime", "Pipeline")
    assert ctx.import_from("macrogen.runtime", "PipelineConfig").statement == (
        "from macrogen.runtime import PipelineConfig"
    )
