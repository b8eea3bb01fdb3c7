"""The house rules of the package, checked over its files (issue 29).

- a macro imports from the pass only through the SDK, ``macrogen.macro``;
- no import circle in ``macrogen/`` (an import under ``if TYPE_CHECKING:`` is not one);
- no module of the package imported under another name;
- one registry of macros (``macrogen.macros.MODULES``), read by the markers and the pass;
- every optional member of a macro is declared, typed and defaulted, in ``Hooks``, and
  documented in docs/macros.md;
- a macro's imports come from one place: what it asked the context for;
- a macro written from docs/macros.md alone expands.
- no module of ``macrogen/`` over 600 lines (issue 40): split by concern past that.
- the program's mesh is made by the apply steps and handed on: no runtime object looks it up.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest

import macrogen
from macrogen import macro, macros, markers
from macrogen.expand import expand_source, protocol
from tests.helpers import load_module, strip_header

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "macrogen"
SDK = "macrogen.macro"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(name: str) -> set[str]:
    """The modules of macrogen/ that module ``name`` imports, anywhere in it (in a function
    too: that import runs when it is called), except under ``if TYPE_CHECKING:``. A parent
    package counts where a name defined in it is imported (``from macrogen.expand import
    Expansion`` in ``macrogen.expand.expansion``), not where only its submodules are (Python
    imports a module's parents before the module itself: no edge of its own)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    named: set[str] = set()  # modules a name defined in them is imported from
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [
                f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES
            ]
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(module)
                named.add(module)
    return {
        m
        for m in found
        if m in MODULES and m != name and (m in named or not name.startswith(m + "."))
    }


GRAPH = {name: imports_of(name) for name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_macros_import_the_pass_only_through_the_sdk():
    leaks = sorted(
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name == "macrogen.macros" or name.startswith("macrogen.macros.")
        for target in targets
        if target.startswith("macrogen.expand")
    )
    assert leaks == []
    # (the walk sees them: the SDK itself imports the pass's modules)
    assert {t for t in GRAPH[SDK] if t.startswith("macrogen.expand.")} >= {
        "macrogen.expand.protocol",
        "macrogen.expand.context",
    }


def test_no_import_circles_in_the_package():
    assert circles(GRAPH) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_name_from_the_parent_package_imported_back_is_a_circle(tmp_path, monkeypatch):
    """The circle macrogen.expand had: its __init__ imports the pass (in a function, when a
    file needs it), and the pass imported the result type from the __init__."""
    (tmp_path / "pkg").mkdir()
    parent, child = tmp_path / "pkg" / "__init__.py", tmp_path / "pkg" / "child.py"
    parent.write_text("class Result: ...\n\ndef run():\n    from pkg.child import go\n")
    child.write_text("from pkg import Result\n\ndef go(): ...\n")
    monkeypatch.setitem(MODULES, "pkg", parent)
    monkeypatch.setitem(MODULES, "pkg.child", child)
    assert circles({"pkg": imports_of("pkg"), "pkg.child": imports_of("pkg.child")}) == [
        ["pkg", "pkg.child"]
    ]
    child.write_text("from pkg import other\n")  # a submodule: no edge to the parent
    monkeypatch.setitem(MODULES, "pkg.other", child)
    assert imports_of("pkg.child") == {"pkg.other"}


def renamed_modules(name: str) -> list[str]:
    """Modules of macrogen/ that module ``name`` imports under another name (``import
    macrogen.x.y as z``, ``from macrogen.x import y as z``); ``y as y`` re-exports a name."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname not in (None, a.name.rpartition(".")[2]):
                    found.append(f"{name}:{node.lineno}: import {a.name} as {a.asname}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("macrogen"):
            for a in node.names:
                if f"{node.module}.{a.name}" in MODULES and a.asname not in (None, a.name):
                    found.append(
                        f"{name}:{node.lineno}: from {node.module} import {a.name} as {a.asname}"
                    )
    return found


def test_no_module_is_imported_under_another_name():
    """A module reads as its own name wherever it is used (not ``class_plans as apply_step``)."""
    assert [line for name in sorted(MODULES) for line in renamed_modules(name)] == []


def test_the_renaming_finder_finds_one(tmp_path, monkeypatch):
    planted = tmp_path / "planted.py"
    planted.write_text("from macrogen.runtime import mesh as meshes\nimport macrogen.hook as h\n")
    monkeypatch.setitem(MODULES, "planted", planted)
    assert renamed_modules("planted") == [
        "planted:1: from macrogen.runtime import mesh as meshes",
        "planted:2: import macrogen.hook as h",
    ]


# -- module size --------------------------------------------------------------------------
LONGEST = 600  # lines: past that a module mixes concerns; split it by concern


def long_modules(limit: int = LONGEST) -> list[str]:
    """The modules of macrogen/ longer than ``limit`` lines, with their length."""
    found = []
    for name, path in sorted(MODULES.items()):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{name}: {lines} lines")
    return found


def test_no_module_is_over_600_lines():
    assert long_modules() == []


def test_the_length_finder_finds_one(tmp_path, monkeypatch):
    planted = tmp_path / "planted.py"
    planted.write_text("x = 1\n" * (LONGEST + 1))
    monkeypatch.setitem(MODULES, "planted", planted)
    assert long_modules() == [f"planted: {LONGEST + 1} lines"]


# -- the mesh: made by the apply steps, handed on (issue 40) -------------------------------
# The modules that may call the program's mesh registry (macrogen.runtime.mesh's ``mesh``), and
# why; every other object that needs a mesh receives it (from its apply step, the model it
# holds or its caller), never finds another's through the registry.
MESH_MAKERS = {
    "macrogen.runtime.parallelize.steps": "mg.parallelize's mesh step, device_mesh",
    "macrogen.runtime.class_plans": "the class decorators' mesh, where construction ends",
    "macrogen.runtime.param_server": "made while the server ranks are still there",
    "macrogen": "the user's mg.mesh()",
    "macrogen.autotune.worker": "forgotten between layout candidates (each a program)",
}


def mesh_registry_users() -> set[str]:
    """Modules of macrogen/ that import the registry: ``mesh`` or ``mesh_of`` from
    ``macrogen.runtime.mesh``, or the module ``macrogen.runtime.mesh`` itself."""
    found = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            names = {a.name for a in node.names}
            if (node.module == "macrogen.runtime.mesh" and names & {"mesh", "mesh_of"}) or (
                node.module == "macrogen.runtime" and "mesh" in names
            ):
                found.add(name)
    return found


def test_only_the_apply_steps_use_the_mesh_registry():
    assert mesh_registry_users() == set(MESH_MAKERS)


def test_the_sdk_exports_what_it_names():
    assert sorted(macro.__all__) == sorted(n for n in vars(macro) if not n.startswith("_"))
    for name in macro.__all__:
        assert getattr(macro, name) is not None


# -- the registry -------------------------------------------------------------------------
def _assigns(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Name) and t.id == name for t in targets
        ):
            return True
    return False


def test_one_registry_for_the_markers_and_the_pass():
    assert markers.MACRO_NAMES == tuple(macros.MODULES)
    assert set(macros.MODULES) <= set(macros.names())
    for name, module in macros.MODULES.items():
        found = macros.get(name)
        assert found.__name__ == module and found.NAME == name  # type: ignore[attr-defined]
        assert callable(getattr(macrogen, name)), f"macrogen.{name}: no marker"


def test_every_macro_module_is_registered():
    """A module of macrogen/macros/ that assigns FORMS is in the registry (none is found by
    scanning: a macro that is not listed is not a macro)."""
    folder = PACKAGE / "macros"
    assigning = {
        _module_name(p)
        for p in [*folder.glob("*.py"), *folder.glob("*/__init__.py")]
        if _assigns(p, "FORMS")
    }
    assert assigning == set(macros.MODULES.values())


# -- the optional members -----------------------------------------------------------------
HOOKS = (
    "CODE_ARGUMENTS",
    "BUILT",
    "constant",
    "argument",
    "tuning_constraint",
    "tuning_no_effect",
    "tuning_per_device",
)


def test_every_optional_member_is_declared_with_a_default_and_documented():
    assert tuple(protocol.Hooks.__annotations__) == HOOKS
    docs = (ROOT / "docs" / "macros.md").read_text(encoding="utf-8")
    for name in HOOKS:
        assert hasattr(protocol.Hooks, name), f"{name} has no default"
        assert name in docs, f"docs/macros.md does not describe {name}"

    class Bare:  # a macro with none of them gets the defaults
        NAME, FORMS, USAGE = "bare", frozenset({"call"}), "bare()"

    assert protocol.code_arguments(Bare) == frozenset()
    assert protocol.built(Bare) is None
    for read in (
        protocol.constant_hook,
        protocol.argument_hook,
        protocol.tuning_constraint,
        protocol.tuning_no_effect,
        protocol.tuning_per_device,
    ):
        assert read(Bare) is None
    assert protocol.tuning_no_effect(macros.get("fused_allreduce")) is not None
    assert protocol.tuning_per_device(macros.get("tile")) is not None


def test_no_optional_member_is_read_by_name_outside_the_protocol():
    """``getattr(macro, "CODE_ARGUMENTS")`` elsewhere would be a hook the protocol does not
    declare: every read goes through ``protocol``'s functions."""
    readers = []
    for name, path in MODULES.items():
        if name == "macrogen.expand.protocol":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in HOOKS
            ):
                readers.append(f"{name}:{node.lineno}")
    assert readers == []


# -- imports from one place ---------------------------------------------------------------
def test_the_imports_a_macro_asked_for_are_written():
    class AsksForSep:
        NAME = "toy_sep"
        FORMS = frozenset({"call"})
        USAGE = "toy_sep()"

        @staticmethod
        def expand(site: macro.Site, ctx: macro.Context) -> macro.Expanded:
            import libcst as cst

            return macro.Expanded(cst.Name(ctx.import_from("os", "sep")))  # no imports=

    macros.register(AsksForSep)
    try:
        code = strip_header(expand_source("import macrogen as mg\nx = mg.toy_sep()\n").code)
    finally:
        macros.unregister(AsksForSep.NAME)
    assert "from os import sep\n" in code and "x = sep\n" in code


def test_each_site_gets_its_own_view_of_the_context():
    """The file's state is shared (fresh names, imports, tunables); what the pass told the
    site (its shadowed names) and what it asked for (its imports) are its own."""
    seen: list[macro.Context] = []

    class Records:
        NAME = "toy_records"
        FORMS = frozenset({"call"})
        USAGE = "toy_records()"

        @staticmethod
        def expand(site: macro.Site, ctx: macro.Context) -> macro.Expanded:
            import libcst as cst

            seen.append(ctx)
            return macro.Expanded(cst.Name(ctx.import_module("os")))

    source = (
        "import macrogen as mg\n\ndef f(os):\n    return mg.toy_records()\n\nx = mg.toy_records()\n"
    )
    macros.register(Records)
    try:
        code = strip_header(expand_source(source).code)
    finally:
        macros.unregister(Records.NAME)
    inner, outer = seen
    assert inner is not outer and inner.names is outer.names and inner.tunables is outer.tunables
    assert inner.shadowed == {"os"} and outer.shadowed == frozenset()
    assert (
        inner.requested is not outer.requested and len(inner.requested) == len(outer.requested) == 1
    )
    assert "return _mg_os\n" in code  # f's parameter named os hides the name os there


# -- a macro from docs/macros.md alone ----------------------------------------------------
TOY = '''\
"""``y = toy_scale(x, by=3)``: ``x`` times ``by``, through a generated helper."""

from __future__ import annotations

import libcst as cst

from macrogen.macro import Context, Expanded, Form, MacroError, Site, render

NAME = "toy_scale"
FORMS: frozenset[Form] = frozenset({"call"})
USAGE = "toy_scale(x, by=3)"
CODE_ARGUMENTS = frozenset({"0"})


def expand(site: Site, ctx: Context) -> Expanded:
    args = site.args.bind({"x": None, "by": 2}, positional=("x",))
    by = args["by"].value if "by" in args else 2
    if not isinstance(by, int) or isinstance(by, bool):
        raise MacroError(f"by must be an int, not {by!r}", args["by"].node)
    call = site.node
    assert isinstance(call, cst.Call)
    fn = ctx.names.fresh(f"_toy_scale_l{site.line}")
    mul = ctx.import_from("operator", "mul")
    helper = render("toy_scale.py.j2", fn=fn, mul=mul, by=by, location=ctx.location(site.line))
    return Expanded(cst.Call(cst.Name(fn), [cst.Arg(call.args[0].value)]), helpers=(helper,))
'''

TOY_TEMPLATE = """\
# macrogen: toy_scale at {{ location }}
def {{ fn | ident }}(x):
    return {{ mul | ident }}(x, {{ by | py }})
"""


def test_a_toy_macro_from_the_docs_alone_expands(tmp_path):
    """A macro module and its template written outside macrogen, using only what
    docs/macros.md shows: the SDK, ``register`` and ``add_templates``."""
    (tmp_path / "toy_scale.py").write_text(TOY)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "toy_scale.py.j2").write_text(TOY_TEMPLATE)
    imported = [
        n.module for n in ast.walk(ast.parse(TOY)) if isinstance(n, ast.ImportFrom) and n.module
    ]
    assert [m for m in imported if m.startswith("macrogen")] == [SDK]
    spec = importlib.util.spec_from_file_location("toy_scale", tmp_path / "toy_scale.py")
    assert spec is not None and spec.loader is not None
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    macro.add_templates(tmp_path / "templates")
    macros.register(toy)
    try:
        source = textwrap.dedent(
            """\
            import macrogen as mg


            def f(a):
                return mg.toy_scale(a + 1, by=3)
            """
        )
        code = expand_source(source, path="t.py").code
        with pytest.raises(Exception, match="by must be an int, not 'x'"):
            expand_source(source.replace("by=3", "by='x'"), path="t.py")
    finally:
        macros.unregister("toy_scale")
    assert "from operator import mul\n" in code
    assert "return _toy_scale_l5(a + 1)\n" in code
    assert load_module(code, "toy_scale_user", tmp_path).f(4) == 15
    sys.modules.pop("toy_scale_user", None)


# -- dead code ----------------------------------------------------------------------------
def test_no_dead_code():
    """What CI's vulture check says (.ci/run), and that it would find a dead function."""
    vulture = pytest.importorskip("vulture")
    check = vulture.Vulture()
    check.scavenge([str(PACKAGE), str(ROOT / ".ci" / "vulture_whitelist.py")])
    assert [
        f"{item.filename}:{item.first_lineno} {item.name}"
        for item in check.get_unused_code(min_confidence=60)
    ] == []

    planted = vulture.Vulture()
    planted.scan("def used():\n    pass\n\ndef dead():\n    pass\n\nused()\n")
    assert [item.name for item in planted.get_unused_code(min_confidence=60)] == ["dead"]


def test_readme_counts_the_extended_tier():
    """README's test paragraph says how many tests `--extended` adds: tests/conftest.py's
    EXTENDED, each a test id of its file (a renamed test would silently rejoin CI)."""
    from tests.conftest import EXTENDED

    said = re.search(r"adds it \((\d+) slow tests", (ROOT / "README.md").read_text())
    assert said is not None and int(said.group(1)) == len(EXTENDED), said
    for node in EXTENDED:
        path, name = node.split("::")
        test = name.split("[")[0]
        assert f"def {test}(" in (ROOT / path).read_text(), node
