"""When and where a tensor-parallel plan is applied (one process: the degree is 1, so the
layers stay whole, but the plan is resolved and checked at the same moment it would cut)."""

from __future__ import annotations

import sys

import pytest
import torch.nn as nn

from macrogen.runtime import tensor_parallel_plan as plan
from macrogen.runtime.tensor_parallel_plan import Colwise, Divide, parallelize, pending, resolve


class Child(nn.Module):
    def __init__(self, style=None):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.ratio = 0.5
        parallelize(self, "Child", None, {"fc": style or Colwise()})


class Parent(nn.Module):
    def __init__(self, style=None):
        super().__init__()
        self.blocks = nn.ModuleList([Child(style) for _ in range(2)])
        # still being built: a re-initialization here must see the full layers
        self.waiting = pending() and all("tp_size" not in b.__dict__ for b in self.blocks)
        self.apply(lambda m: None)


def test_a_child_waits_for_the_outermost_module_then_the_profiler_is_gone():
    assert sys.getprofile() is None
    parent = Parent()
    assert parent.waiting
    assert not pending() and sys.getprofile() is None
    assert all(b.__dict__["tp_size"] == 1 for b in parent.blocks)  # applied once built


def test_a_module_built_alone_is_its_own_root():
    child = Child()
    assert child.__dict__["tp_size"] == 1 and not pending()


def test_an_error_in_the_plan_comes_out_of_the_outermost_constructor():
    with pytest.raises(TypeError, match=r"divide needs an int attribute, but Child.ratio is float"):

        class Bad(Child):
            def __init__(self):
                nn.Module.__init__(self)
                self.fc = nn.Linear(2, 2)
                self.ratio = 0.5
                parallelize(self, "Child", None, {"ratio": Divide()})

        class Outer(nn.Module):
            def __init__(self):
                super().__init__()
                self.bad = Bad()

        Outer()
    assert not pending() and sys.getprofile() is None


def test_another_profiler_is_a_loud_error_not_a_silent_difference():
    sys.setprofile(lambda *a: None)
    try:
        with pytest.raises(RuntimeError, match="another profiler is active"):
            Parent()
    finally:
        sys.setprofile(None)
        plan._roots.clear()


def test_a_plan_on_a_class_derived_from_another_planned_class_is_refused():
    class Twice(Child):
        def __init__(self):
            super().__init__()
            parallelize(self, "Twice", None, {"fc": Colwise()})

    with pytest.raises(TypeError, match=r"Twice is a tensor_parallel class derived from another"):
        Twice()


def test_paths_go_through_containers_and_stars():
    model = nn.Module()
    model.h = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(2)])
    model.d = nn.ModuleDict({"a": nn.Linear(2, 2)})
    names = [name for _, _, name in resolve(model, "h.*.0", "M")]
    assert names == ["M.h.0.0", "M.h.1.0"]
    assert [name for _, _, name in resolve(model, "d.a", "M")] == ["M.d.a"]
    with pytest.raises(
        AttributeError, match=r"M.d.b: ModuleDict has no submodule 'b' \(children: a\)"
    ):
        list(resolve(model, "d.b.weight", "M"))


def test_subclasses_of_the_layers_are_planned():
    class Linear(nn.Linear):  # torchtitan's own Linear
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = Linear(4, 8)
            self.proj = Linear(8, 4)
            parallelize(self, "Model", None, {"fc": Colwise(), "proj": plan.Rowwise()})

    Model()


def test_every_problem_of_a_plan_is_reported_at_once():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 2, 1)
            self.emb = nn.Linear(2, 2)
            parallelize(
                self, "Model", None, {"conv": Colwise(), "emb": plan.Vocab(), "x": Colwise()}
            )

    with pytest.raises(TypeError) as e:
        Model()
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("Model.conv: colwise needs an nn.Linear (or a subclass), not Conv1d")
    assert lines[1].startswith("Model.emb: vocab needs an nn.Embedding (or a subclass), not Linear")
    assert lines[2].startswith("Model.x: Model has no attribute 'x'")
