"""``ep=`` at expansion and before any group: the generated step, and what is refused and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from macrogen.runtime.expert_modules import list_problem
from macrogen.runtime.expert_parallel import (
    apply_expert_parallel,
    experts_modules,
    weighted_output_problem,
)
from macrogen.runtime.mesh import SERIAL
from tests.expert_models import Expert, ListBlock, ListMoE, PlainMoE, StackedExperts
from tests.helpers import expand, expansion_errors


def test_the_expansion_deals_experts_before_data_parallel():
    code = expand("import macrogen as mg\nmodel = mg.parallelize(model, ep=2)\n")
    ep = code.index("apply_expert_parallel(model, mesh, ep=2, where='test.py:2')")
    assert ep < code.index("apply_data_parallel(model")
    assert "apply_expert_parallel" not in expand("import macrogen as mg\nm = mg.parallelize(m)\n")


def test_ep_with_tp_deals_the_experts_after_tensor_parallel_cut_them():
    code = expand("import macrogen as mg\nm = mg.parallelize(m, tp=2, ep=2, tp_plan='hf')\n")
    tp = code.index("apply_tensor_parallel(model, mesh, hf_plan(model)")
    ep = code.index("apply_expert_parallel(model, mesh, ep=2, where='test.py:2')")
    assert tp < ep < code.index("apply_data_parallel(model, mesh, 'replicate'")


def test_ep_with_recompute_deals_the_experts_before_the_blocks_are_checkpointed():
    # the recomputed forward is the routed one: its all-to-alls run again in backward
    code = expand("import macrogen as mg\nm = mg.parallelize(m, ep=2, recompute='blocks')\n")
    ep = code.index("apply_expert_parallel(model, mesh, ep=2, where='test.py:2')")
    recompute = code.index("apply_recompute(model, 'blocks', where='test.py:2')")
    assert ep < recompute < code.index("apply_data_parallel(model, mesh, 'replicate'")


def test_ep_with_zero1_deals_the_experts_before_data_parallel_takes_the_rest():
    code = expand("import macrogen as mg\nm = mg.parallelize(m, ep=2, dp='zero1')\n")
    ep = code.index("apply_expert_parallel(model, mesh, ep=2, where='test.py:2')")
    assert ep < code.index("apply_data_parallel(model, mesh, 'zero1'")


def test_layout_auto_builds_an_ep_winner_with_its_degrees():
    source = "import macrogen as mg\nm = mg.parallelize(m, layout='auto')\n"
    code = expand(source, tuning={"parallelize.layout": "tp1 pp1 fsdp mb1 ep2"})
    assert "apply_expert_parallel(model, mesh, ep=2, where='test.py:2', dp=\"fsdp\")" in code
    (error,) = expansion_errors(
        "import macrogen as mg\nm = mg.parallelize(m, layout='auto', ep=2)\n"
    )
    assert "chooses tp, pp, dp, microbatches, recompute and ep; leave out ep" in error, error


@pytest.mark.parametrize(
    "arguments, named",
    [
        ("tp=2, tp_plan='hf', dp='fsdp'", "dp"),
        ("tp=2, tp_plan='hf', dp='zero1'", "dp"),
        ("pp=2, microbatches=2", "pp"),
        ("dp='fsdp', dp_replicate=2", "dp_replicate"),
    ],
)
def test_what_ep_does_not_compose_with_yet_is_an_expansion_error(arguments, named):
    (error,) = expansion_errors(
        f"import macrogen as mg\nm = mg.parallelize(m, ep=2, {arguments})\n"
    )
    assert f"ep=2 with {named}=" in error and "not supported yet" in error, error


def test_ep_with_tp_on_a_meta_model_is_an_expansion_error():
    (error,) = expansion_errors(
        "import macrogen as mg\nm = mg.parallelize(m, tp=2, ep=2, tp_plan='hf', init='model')\n"
    )
    assert "not yet with ep= and tp > 1: build the model with its values" in error, error


def test_what_ep_with_tp_does_not_run_yet_is_refused_naming_it():
    from macrogen.runtime.expert_modules import expert_lists
    from macrogen.runtime.expert_tensor import tensor_problem

    plain = experts_modules(PlainMoE())
    assert tensor_problem(plain, [], "replicate") is None
    assert "dp='fsdp' is not supported yet" in (tensor_problem(plain, [], "fsdp") or "")
    listed = tensor_problem([], expert_lists(ListMoE()), "replicate") or ""
    assert listed.startswith("blocks.0: ep over an nn.ModuleList of experts runs with tp=1"), listed
    with torch.device("meta"):
        meta = experts_modules(PlainMoE())
    problem = tensor_problem(meta, [], "replicate") or ""
    assert problem.startswith("blocks.0.experts.w_in: a model built on the meta device"), problem


def test_a_bad_degree_is_an_expansion_error():
    (error,) = expansion_errors("import macrogen as mg\nm = mg.parallelize(m, ep=0)\n")
    assert "ep" in error and "an int >= 1" in error


def test_experts_are_found_by_their_stacked_parameters_and_routed_call():
    model = PlainMoE()
    assert [n for n, _ in experts_modules(model)] == ["blocks.0.experts", "blocks.1.experts"]
    assert apply_expert_parallel(model, SERIAL, ep=2, where="t.py:1") is model  # serial: as is


def test_an_uneven_split_or_no_experts_are_refused():
    with pytest.raises(ValueError, match=r"t.py:1: ep=2: blocks.0: ep=2 does not divide its 3"):
        apply_expert_parallel(ListMoE(experts=3), SERIAL, ep=2, where="t.py:1")
    with pytest.raises(ValueError, match="ep=3 does not divide the 4 experts of blocks.0.experts"):
        apply_expert_parallel(PlainMoE(), SERIAL, ep=3, where="t.py:1")
    with pytest.raises(ValueError, match="the model has no experts module"):
        apply_expert_parallel(nn.Linear(2, 2), SERIAL, ep=2, where="t.py:1")


class WeightsInside(StackedExperts):
    """Llama 4's way: the router's weights scale the expert's input, not its output."""

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            x = hidden[token] * top_k_weights[token, slot, None]
            out.index_add_(0, token, torch.nn.functional.linear(torch.tanh(
                torch.nn.functional.linear(x, self.w_in[e])), self.w_out[e]))  # fmt: skip
        return out


def test_experts_that_apply_the_weights_inside_are_refused():
    torch.manual_seed(0)
    assert weighted_output_problem(StackedExperts(4, 8, 16)) is None
    problem = weighted_output_problem(WeightsInside(4, 8, 16))
    assert problem is not None and "weights are applied inside the experts" in problem


def test_a_bfloat16_model_is_probed_in_float64():
    torch.manual_seed(0)
    assert weighted_output_problem(StackedExperts(4, 8, 16).to(torch.bfloat16)) is None
    assert weighted_output_problem(WeightsInside(4, 8, 16).to(torch.bfloat16)) is not None


class BatchDependent(StackedExperts):
    """Experts whose output depends on the call's other tokens (a batch mean)."""

    def forward(self, hidden, top_k_index, top_k_weights):
        return super().forward(hidden - hidden.mean(dim=0), top_k_index, top_k_weights)


def test_experts_whose_tokens_depend_on_each_other_are_refused():
    torch.manual_seed(0)
    problem = weighted_output_problem(BatchDependent(4, 8, 16))
    assert problem is not None and "depends on the other tokens" in problem


def test_experts_built_on_meta_are_probed_with_random_experts_of_their_shapes():
    with torch.device("meta"):
        plain, inside = StackedExperts(4, 8, 16), WeightsInside(4, 8, 16)
    assert weighted_output_problem(plain) is None
    problem = weighted_output_problem(inside)
    assert problem is not None and "weights are applied inside the experts" in problem


def test_ep_with_init_materializes_after_the_experts_are_dealt():
    code = expand(
        "import macrogen as mg\nmodel = mg.parallelize(model, ep=2, init=mg.load('folder'))\n"
    )
    ep = code.index("apply_expert_parallel(model, mesh, ep=2")
    assert ep < code.index("apply_init(model, init") < code.index("apply_data_parallel(model")


def test_ep_with_fsdp_deals_the_experts_then_shards_over_the_data_ranks():
    code = expand("import macrogen as mg\nmodel = mg.parallelize(model, ep=2, dp='fsdp')\n")
    call = "\n    apply_expert_parallel(model, mesh, ep=2, where='test.py:2', dp=\"fsdp\")\n"
    assert call in code  # a statement of its own, not inside the comment above it
    assert code.index(call) < code.index("apply_fully_sharded(model")


@pytest.mark.parametrize("hit", [False, True])
def test_a_module_list_of_experts_looped_over_in_the_block_is_taken(hit):
    torch.manual_seed(0)
    model = ListMoE(hit=hit, starved=3)
    assert list_problem(model.blocks[0]) is None
    assert apply_expert_parallel(model, SERIAL, ep=2, where="t.py:1") is model  # serial: as is


class NoRouter(ListBlock):
    """Experts in a ModuleList, every token to every expert, no gate."""

    def __init__(self):
        super().__init__(8, 4, 2, hit=False, starved=None)
        del self.gate

    def forward(self, x):
        return sum(expert(x) for expert in self.experts)


class Mixing(Expert):
    """An expert whose output for a token depends on the call's other tokens."""

    def forward(self, x):
        return super().forward(x - x.mean(dim=0))


class Reaching(ListBlock):
    """A forward that reaches into its experts' layers instead of calling them."""

    def forward(self, x):
        return x + sum(expert.fc2(expert.fc1(x)) for expert in self.experts)


def _list_refusal(block):
    model = nn.Sequential(block)
    with pytest.raises(ValueError) as caught:
        apply_expert_parallel(model, SERIAL, ep=2, where="t.py:1")
    message = str(caught.value)
    assert message.startswith("mg.parallelize at t.py:1: ep=2: 0: ") and "\n" not in message
    return message


def test_a_module_list_the_engine_cannot_serve_is_refused_naming_the_block():
    torch.manual_seed(0)
    assert "no router" in _list_refusal(NoRouter())
    mixing = ListBlock(8, 4, 2, hit=False, starved=None)
    mixing.experts = nn.ModuleList([Mixing(8, 16) for _ in range(4)])
    assert "depends on the call's other tokens" in _list_refusal(mixing)
    reaching = _list_refusal(Reaching(8, 4, 2, hit=False, starved=None))
    assert "other than by calling each on its tokens" in reaching
    with torch.device("meta"):
        meta = ListBlock(8, 4, 2, hit=False, starved=None)
    assert "not on the meta device" in _list_refusal(meta)
