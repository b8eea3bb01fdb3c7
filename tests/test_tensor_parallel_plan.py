"""When and where a tensor-parallel plan is applied (one process: the degree is 1, so the
layers stay whole, but the plan is resolved and checked at the same moment it would cut)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from macrogen.runtime import class_plans as apply_step
from macrogen.runtime import tensor_parallel_plan as plan
from macrogen.runtime.class_plans import tensor_parallel_class
from macrogen.runtime.tensor_parallel_plan import Colwise, Divide, Replicate, parallelize, resolve


def cut(module: nn.Module) -> bool:
    return "tp_size" in module.__dict__  # set on the instance when its plan is applied


@tensor_parallel_class("Child", None, {"fc": Colwise()})
class Child(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.ratio = 0.5

    def forward(self, x):
        return self.fc(x)


@tensor_parallel_class("Parent", None, {"head": Replicate()})
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
    assert apply_step._building.get() is None and sys.getprofile() is None


def test_the_class_keeps_its_name_identity_and_signature():
    import inspect

    assert Child.__name__ == "Child" and type(Child()) is Child
    assert str(inspect.signature(Child)) == "()"
    found = apply_step.class_plan(Child)
    assert found is not None and found.name == "Child" and list(found.plan) == ["fc"]


def test_a_module_built_alone_is_its_own_root():
    child = Child()
    assert child.__dict__["tp_size"] == 1 and apply_step._building.get() is None


def test_an_undecorated_parent_gets_its_children_cut_as_each_is_built():
    """The rule: shards are cut where the outermost *decorated* construction ends."""

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.child = Child()
            self.seen = cut(self.child)

    assert Plain().seen


def test_an_error_in_the_plan_comes_out_of_the_outermost_constructor():
    @tensor_parallel_class("Bad", None, {"ratio": Divide()})
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.ratio = 0.5

    @tensor_parallel_class("Outer", None, {"bad": Replicate()})
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.bad = Bad()

    with pytest.raises(TypeError, match=r"divide needs an int attribute, but Bad.ratio is float"):
        Outer()
    assert apply_step._building.get() is None


def test_a_decorated_module_the_outermost_one_does_not_hold_is_an_error_at_its_forward():
    """A factory building a planned module the plan never reaches: never a silent serial model."""
    made = []

    @tensor_parallel_class("Outer", None, {"fc": Replicate()})
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

        @tensor_parallel_class("Twice", None, {"fc": Colwise()})
        class Twice(Child):
            pass


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

    parallelize(Model(), "Model", None, {"fc": Colwise(), "proj": plan.Rowwise()})


def test_every_problem_of_a_plan_is_reported_at_once():
    @tensor_parallel_class("Model", None, {"conv": Colwise(), "emb": plan.Vocab(), "x": Colwise()})
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 2, 1)
            self.emb = nn.Linear(2, 2)

    with pytest.raises(TypeError) as e:
        Model()
    lines = str(e.value).splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("Model.conv: colwise needs an nn.Linear (or a subclass), not Conv1d")
    assert lines[1].startswith("Model.emb: vocab needs an nn.Embedding (or a subclass), not Linear")
    assert lines[2].startswith("Model.x: Model has no attribute 'x'")
