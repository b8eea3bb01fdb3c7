"""Which classes of the file build a ``@tensor_parallel`` class and then re-initialize it.

nanoGPT annotated the natural way puts ``@tensor_parallel`` on ``CausalSelfAttention`` and
``MLP`` only; ``GPT.__init__`` builds the ``Block``s that build them, then re-draws every
weight (``self.apply(self._init_weights)``, the scaled ``c_proj`` loop)::

    class GPT(nn.Module):                           # macrogen: GPT builds CausalSelfAttention ...
        def __init__(self, config):          ->     @tensor_parallel_class('GPT', None, {})
            ...Block(config)...                     class GPT(nn.Module):
            self.apply(self._init_weights)              ...

A plan applied where the decorated class's own construction ends would cut shards that
``GPT.__init__`` then re-initializes, drawing other numbers than the serial model. So the
expansion finds such builders and puts the plan-less class decorator on them: the plans of
the decorated classes they build apply where *their* construction ends, after the
re-initialization, as for a decorated parent.

A builder is a top-level class of the file whose ``__init__`` constructs the decorated class
(directly or through other classes of the file it constructs) and re-initializes: calls
``self.apply(...)``, ``self.post_init()`` / ``self.init_weights()``, an ``nn.init`` function,
or an in-place initializer (``.normal_(...)``, ``.uniform_(...)``, ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import libcst as cst

from macrogen.macro import dotted, find

# what re-initializes parameters in a constructor
_SELF_CALLS = ("apply", "post_init", "init_weights", "_init_weights", "reset_parameters")
_IN_PLACE = ("normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "copy_",
             "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
             "kaiming_normal_", "orthogonal_")  # fmt: skip
# the class macros whose construction is a construction record's root already
_ROOTS = ("tensor_parallel", "data_parallel", "pipeline")


def builders(decorated: str, classes: Mapping[str, cst.ClassDef]) -> list[str]:
    """The top-level classes that build ``decorated`` and re-initialize it, in file order."""
    found = []
    roots = {name for name, cls in classes.items() if _is_root(cls)}
    for name, cls in classes.items():
        # (a class derived from a decorated one is a root already: its __init__ is wrapped)
        bases = {(dotted(b.value) or "").rsplit(".", 1)[-1] for b in cls.bases}
        if name == decorated or name in roots or bases & roots:
            continue
        init = _init(cls)
        if init is None or not _reinitializes(init):
            continue
        if decorated in _built(name, classes, set()):
            found.append(name)
    return found


def _is_root(cls: cst.ClassDef) -> bool:
    """Decorated by a class macro already (its construction is a root of its own)."""
    for decorator in cls.decorators:
        call = decorator.decorator
        name = dotted(call.func if isinstance(call, cst.Call) else call) or ""
        if name.rsplit(".", 1)[-1] in _ROOTS:
            return True
    return False


def _init(cls: cst.ClassDef) -> cst.FunctionDef | None:
    for statement in cls.body.body:
        if isinstance(statement, cst.FunctionDef) and statement.name.value == "__init__":
            return statement
    return None


def _calls(node: cst.CSTNode) -> Iterator[cst.Call]:
    yield from find(node, cst.Call)


def _built(name: str, classes: Mapping[str, cst.ClassDef], seen: set[str]) -> set[str]:
    """The classes of the file ``name.__init__`` constructs, directly or through others."""
    if name in seen:
        return set()
    seen.add(name)
    init = _init(classes[name])
    if init is None:
        return set()
    direct = {
        call.func.value
        for call in _calls(init)
        if isinstance(call.func, cst.Name) and call.func.value in classes
    }
    out = set(direct)
    for other in direct:
        out |= _built(other, classes, seen)
    return out


def _reinitializes(init: cst.FunctionDef) -> bool:
    for call in _calls(init):
        callee = dotted(call.func) or ""
        parts = callee.split(".")
        if len(parts) == 2 and parts[0] == "self" and parts[1] in _SELF_CALLS:
            return True
        if "init" in parts[:-1] and parts[-1].endswith("_"):  # nn.init.normal_, torch.nn.init...
            return True
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in _IN_PLACE:
            return True
    return False
