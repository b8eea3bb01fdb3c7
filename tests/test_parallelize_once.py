"""``mg.parallelize`` takes a model once (issue 43, item 2), and ``dp="none"`` on several data
ranks warns that the replicas diverge (item 5).

Run serially (no ranks: each generated function builds the serial mesh), since the check is
the generated function's first step, before the mesh: a second application is an error naming
the first one's line, whatever its data-parallel mode, pipeline or servers.
"""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch.nn as nn

import macrogen as mg
from macrogen.runtime import mesh as meshes
from macrogen.runtime.parallelize import no_data_parallel, parallelize_once
from tests.helpers import expand, load_module

CALLS = {
    "replicate": 'dp="replicate"',
    "zero1": 'dp="zero1"',
    "fsdp": 'dp="fsdp"',
    "none": 'dp="none"',
    "tp": 'tp=2, tp_plan={"blocks.0": "colwise", "blocks.1": "rowwise"}',
    "pp": "pp=2, microbatches=2",
    "servers": 'servers=1, tp_plan={"emb": "server"}',
}


@pytest.mark.parametrize("mode", list(CALLS))
def test_a_second_parallelize_is_an_error_naming_the_first(tmp_path, mode):
    source = textwrap.dedent(
        f"""
        import torch.nn as nn
        import macrogen as mg


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(8, 4)
                self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

            def forward(self, x):
                x = self.emb(x)
                for block in self.blocks:
                    x = block(x)
                return x


        def first(model):
            return mg.parallelize(model, {CALLS[mode]})


        def second(model):
            return mg.parallelize(model, {CALLS[mode]})
        """
    )
    module = load_module(expand(source), f"once_{mode}", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = module.first(module.Net())
    assert mg.mesh(model) is meshes.SERIAL  # every step hands the model its mesh (no ranks here)
    with pytest.raises(RuntimeError, match=r"test.py:24: this model was parallelized already, at"
                       r" test.py:20: apply mg.parallelize once"):  # fmt: skip
        module.second(model)


def test_a_module_of_the_model_parallelized_before_is_named():
    inner = nn.Linear(2, 2)
    parallelize_once(inner, where="t.py:1")
    outer = nn.Sequential(nn.ReLU(), inner)
    with pytest.raises(RuntimeError, match=r"t.py:2: 1, a module of this model, was parallelized"
                       r" already, at t.py:1"):  # fmt: skip
        parallelize_once(outer, where="t.py:2")


def test_no_data_parallel_on_several_data_ranks_warns_that_replicas_diverge():
    several = meshes.Mesh(data_size=2, tensor_size=1, tensor_group=None, data_group=None)
    model = nn.Linear(1, 1)
    with pytest.warns(UserWarning, match=r"t.py:3: dp='none' on 2 data ranks: .* diverge"):
        no_data_parallel(model, several, where="t.py:3")
    assert mg.mesh(model) is several  # the model carries its mesh all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        no_data_parallel(
            nn.Linear(1, 1), meshes.SERIAL, where="t.py:4"
        )  # one replica: nothing to say


def test_mg_mesh_of_a_model_is_the_mesh_it_was_parallelized_on():
    """``mg.mesh(model)`` reads the mesh the model carries (every mode above checks that its
    model carries one); on ranks, a model no plan was applied to carries none: an error saying
    so, never the program's mesh in its place. Serially (the unexpanded program) it is the
    serial mesh."""
    assert mg.mesh(nn.Linear(1, 1)) is meshes.SERIAL
    several = meshes.Mesh(data_size=2, tensor_size=1, tensor_group=None, data_group=None)
    model = nn.Linear(1, 1)
    meshes.carry(model, several)
    assert mg.mesh(model) is several
