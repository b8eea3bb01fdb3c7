"""@pipeline cuts forward at expansion: the runtime reads no source, and a frame in a
generated stage function shows the user's file and line."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import traceback
import types
from pathlib import Path

import pytest
import torch

import macrogen as mg
from macrogen import linemap
from macrogen.runtime import pipeline as rp

SOURCE = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import macrogen as mg


    @mg.pipeline(stages=2, microbatches=2, split=["blocks.1"])
    class Net(nn.Module):
        def __init__(self, d=4):
            super().__init__()
            self.inp = nn.Linear(d, d)
            self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
            self.head = nn.Linear(d, 2)

        def forward(self, x):
            h = self.inp(x)

            for block in self.blocks:
                h = block(h)
                assert h.abs().max() < 1e6, (
                    "the activations blew up"
                )
            return self.head(h)
    """
).lstrip()
RUNTIME = Path(rp.__file__).parent


def _load(name: str) -> types.ModuleType:
    expanded = mg.expand_source(SOURCE, path="user.py").code
    code = linemap.compile_expanded(SOURCE, expanded, "user.py", "expanded.py")
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(code, module.__dict__)
    return module


def _stages(model):
    pipe = rp.pipeline_of(model)
    return [pipe.cut.code(model, s) for s in range(2)]


def test_the_runtime_reads_no_source(monkeypatch):
    module = _load("cut_no_source")

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline runtime read source")

    for name in ("getsource", "getsourcelines", "getsourcefile", "getfile"):
        monkeypatch.setattr(inspect, name, refuse)
    monkeypatch.setattr(ast, "parse", refuse)
    torch.manual_seed(0)
    model = module.Net()
    first, last = _stages(model)
    x = torch.randn(3, 4)
    assert torch.equal(last(model, first(model, x)), model(x))  # the stages are forward


def test_no_source_parsing_in_the_runtime_and_no_runtime_in_the_macro():
    for path in RUNTIME.glob("pipeline*.py"):
        text = path.read_text()
        assert "import ast" not in text and "getsource" not in text, path
    macro = Path(rp.__file__).parents[1] / "macros" / "pipeline"
    for path in macro.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            assert not any(n.startswith("macrogen.runtime") for n in names), (path, names)
    assert not (RUNTIME / "pipeline_forward.py").exists()


def test_an_error_in_a_stage_shows_the_users_line():
    module = _load("cut_traceback")
    torch.manual_seed(0)
    model = module.Net()
    first, last = _stages(model)
    with torch.no_grad():
        model.blocks[1].weight.fill_(1e7)  # stage 1's first block blows up
    h = first(model, torch.ones(1, 4))
    with pytest.raises(AssertionError, match="blew up") as e:
        last(model, h)
    frame = traceback.extract_tb(e.tb)[-1]
    want = SOURCE.splitlines().index("            assert h.abs().max() < 1e6, (") + 1
    assert (frame.filename, frame.lineno) == ("user.py", want)


def test_the_expanded_file_reads_like_forward():
    expanded = mg.expand_source(SOURCE, path="user.py").code
    assert (
        "# macrogen: Net.forward from user.py:18\n"
        "def _Net_forward_1(self, block, h):\n"
        "    h = block(h)\n"
        "    assert h.abs().max() < 1e6, (\n"
        '        "the activations blew up"\n'
        "    )\n"
        "    return h\n"
    ) in expanded
    assert "forward_of" not in Path(rp.__file__).read_text()


def test_a_class_defined_in_a_function_keeps_its_free_names():
    source = textwrap.dedent(
        """
        import torch.nn as nn
        import macrogen as mg


        def build(scale):
            @mg.pipeline(stages=2, microbatches=2, split=["head"])
            class Net(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.inp = nn.Linear(4, 4)
                    self.head = nn.Linear(4, 2)

                def forward(self, x):
                    h = self.inp(x) * scale
                    return self.head(h)

            return Net()
        """
    )
    module = types.ModuleType("cut_closure")
    exec(mg.expand_source(source, path="closure.py").code, module.__dict__)
    torch.manual_seed(0)
    model = module.build(3.0)
    first, last = _stages(model)
    x = torch.randn(2, 4)
    assert torch.equal(last(model, first(model, x)), model(x))
