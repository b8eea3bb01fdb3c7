"""When and where a tensor-parallel plan is applied (one process: the degree is 1, so the
layers stay whole, but the plan is resolved and checked at the same moment it would cut)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from macrogen.runtime import class_plans
from macrogen.runtime.class_plans import tensor_parallel_class
from macrogen.runtime.mesh import SERIAL
from macrogen.runtime.parallelize import PlanError, apply_tensor_parallel, matches


def cut(module: nn.Module) -> bool:
    return "tp_size" in module.__dict__  # set on the instance when its plan is applied


@tensor_parallel_class("Child", None, {"fc": "colwise"})
class Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.ratio = 0.5

    def forward(self, x):
        return self.fc(x)


@tensor_parallel_class("Parent", None, {"head": "replicate"})
class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Child() for _ in range(2)])
        self.head = nn.Linear(8, 2)
        # still being built: a re-initialization here must see the full layers
        self.waiting = not any(cut(b) for b in self.blocks) and sys.getprofile() is None
        self.apply(lambda m: None)


def test_a_child_waits_for_the_outermost_decorated_module_without_a_profiler():
    parent = Parent()
    assert parent.waiting
    assert all(cut(b) for b in parent.blocks) and cut(parent)  # applied once built
    assert class_plans._building.get() is None and sys.getprofile() is None


def test_the_class_keeps_its_name_identity_and_signature():
    import inspect

    assert Child.__name__ == "Child" and type(Child()) is Child
    assert str(inspect.signature(Child)) == "()"
    found = class_plans.class_plan(Child)
    assert found is not None and found.name == "Child" and list(found.plan) == ["fc"]


def test_a_module_built_alone_is_its_own_root():
    child = Child()
    assert child.__dict__["tp_size"] == 1 and class_plans._building.get() is None


def test_an_undecorated_parent_gets_its_children_cut_as_each_is_built():
    """The rule: shards are cut where the outermost *decorated* construction ends."""

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Child()
            self.seen = cut(self.child)

    assert Plain().seen


def test_an_error_in_the_plan_comes_out_of_the_outermost_constructor():
    @tensor_parallel_class("Bad", None, {"ratio": "divide"})
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.ratio = 0.5

    @tensor_parallel_class("Outer", None, {"bad": "replicate"})
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.bad = Bad()

    with pytest.raises(PlanError, match=r"bad.ratio: divide needs an int attribute, not float"):
        Outer()
    assert class_plans._building.get() is None


def test_a_decorated_module_the_outermost_one_does_not_hold_is_an_error_at_its_forward():
    """A factory building a planned module the plan never reaches: never a silent serial model."""
    made = []

    @tensor_parallel_class("Outer", None, {"fc": "replicate"})
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            made.append(Child())  # built here, kept outside the module tree

    outer = Outer()
    assert not cut(made[0])
    with pytest.raises(RuntimeError, match=r"this Child was built while Outer was being built"):
        made[0](torch.zeros(1, 4))
    assert outer.fc(torch.zeros(1, 4)).shape == (1, 4)


def test_a_plan_on_a_class_derived_from_another_planned_class_is_refused():
    with pytest.raises(TypeError, match=r"Twice is a tensor_parallel class derived from another"):

        @tensor_parallel_class("Twice", None, {"fc": "colwise"})
        class Twice(Child):
            pass


def test_paths_go_through_containers_and_stars():
    model = nn.Module()
    model.h = nn.ModuleList([nn.Sequential(nn.Linear(2, 2)) for _ in range(2)])
    model.d = nn.ModuleDict({"a": nn.Linear(2, 2)})
    names = [name for name, _, _ in matches(model, "h.*.0")]
    assert names == ["h.0.0", "h.1.0"]
    assert [name for name, _, _ in matches(model, "d.a")] == ["d.a"]
    with pytest.raises(PlanError, match=r"d.b.weight: matches nothing in Module"):
        apply_tensor_parallel(model, SERIAL, {"d.b.weight": "colwise"}, where="test")


def test_subclasses_of_the_layers_are_planned():
    class Linear(nn.Linear):  # torchtitan's own Linear
        pass

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = Linear(4, 8)
            self.proj = Linear(8, 4)

    apply_tensor_parallel(Model(), SERIAL, {"fc": "colwise", "proj": "rowwise"}, where="test")


def test_every_problem_of_a_plan_is_reported_at_once():
    @tensor_parallel_class("Model", None, {"conv": "colwise", "emb": "vocab", "x": "colwise"})
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 2, 1)
            self.emb = nn.Linear(2, 2)

    with pytest.raises(PlanError) as e:
        Model()
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("conv: colwise needs an nn.Linear (or a subclass)"), lines
    assert lines[1].startswith("emb: vocab needs an nn.Embedding (or a subclass), not Linear")
    assert lines[2].startswith("x: matches nothing in Model")
