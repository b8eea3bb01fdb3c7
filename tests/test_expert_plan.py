"""``macrogen plan`` and the layouts know ``ep``: a layout dim for mixtures of experts, the
experts' memory divided by ep, the routing all-to-alls in the step time."""

from __future__ import annotations

import dataclasses

import pytest

from macrogen.autotune import cost, devices, layouts, memory, planner, probe_experts, scale
from macrogen.autotune.layouts import Layout, ModelShape
from macrogen.autotune.model_spec import ModelSpec

# Qwen1.5-MoE-A2.7B's shapes, as meta_model measures them (24 blocks of 60 experts, top-4)
MOE = ModelSpec(
    name="qwen2_moe", layers=24, hidden=2048, seq=4096, params=14_315_784_192,
    block_params=565_854_208, block_sharded_params=29_360_128, embed_params=303_038_464,
    head_params=303_038_464, block_forward_flops=1.1e9, rest_forward_flops=1.3e9,
    block_backward_flops=2.2e9, rest_backward_flops=2.6e9, block_attention_flops=1e8,
    block_activation_bytes=120_000, rest_activation_bytes=600_000, block_input_bytes=4096,
    experts=60, block_expert_params=553_648_128, top_k=4,
)  # fmt: skip
DENSE = dataclasses.replace(MOE, experts=0, block_expert_params=0, top_k=0)


def test_a_layout_names_its_ep_and_parses_back():
    layout = Layout(ep=4, recompute=1)
    assert layout.name() == "tp1 pp1 replicate mb1 recompute ep4"
    assert layouts.parse(layout.name()) == layout
    assert layouts.parse("tp2 pp1 fsdp mb1") == Layout(tp=2, dp="fsdp")  # names without ep
    assert layout.describe(8) == "dp8 (replicate, experts over ep4) + recompute"
    assert layouts.from_arguments({"ep": 2}) == Layout(ep=2)


def test_ep_is_enumerated_for_mixtures_of_experts_only():
    dense = set(layouts.enumerate_layouts(8))
    assert all(layout.ep == 1 for layout in dense)
    moe = set(layouts.enumerate_layouts(8, experts=60))
    assert dense < moe
    # ep divides the data ranks and the 60 experts: 2 and 4 of 8 (not 8)
    assert {layout.ep for layout in moe if layout.tp == 1 and layout.pp == 1} == {1, 2, 4}


def test_ep_that_cannot_run_is_infeasible_with_its_reason():
    moe = ModelShape(experts=6)
    assert layouts.infeasible(Layout(ep=4), 8, moe) == "ep=4 does not divide the 6 experts"
    assert layouts.infeasible(Layout(ep=2), 2, ModelShape()) == (
        "ep=2 needs experts: the model is no mixture of experts"
    )
    assert layouts.infeasible(Layout(tp=2, ep=2), 6, moe) == "ep=2 does not divide the 3 data ranks"
    assert layouts.infeasible(Layout(tp=2, ep=3), 6, moe) is None
    assert layouts.unsupported(Layout(tp=2, ep=2)) is None  # (the experts cut inside by tp)
    assert "fsdp is not supported" in (layouts.unsupported(Layout(tp=2, ep=2, dp="fsdp")) or "")
    assert "not supported" in (layouts.unsupported(Layout(pp=2, ep=2, microbatches=4)) or "")
    assert layouts.unsupported(Layout(ep=2)) is None
    assert layouts.unsupported(Layout(ep=2, dp="fsdp")) is None  # (mg.parallelize runs it)
    assert layouts.unsupported(Layout(ep=2, dp="zero1")) is None  # (the experts' over replicas)
    assert "zero1 is not supported" in (layouts.unsupported(Layout(tp=2, ep=2, dp="zero1")) or "")


def test_the_experts_memory_is_divided_by_ep_and_their_routing_costs_time():
    h100 = devices.parse_devices("8xH100")
    one = scale.predict(MOE, Layout(), h100, 64)
    four = scale.predict(MOE, Layout(ep=4), h100, 64)
    per_rank = MOE.layers * MOE.block_expert_params * (1 - 1 / 4)
    assert one.memory.weights - four.memory.weights == pytest.approx(2 * per_rank)
    assert one.memory.states - four.memory.states == pytest.approx(16 * per_rank)
    # 4 all-to-alls per MoE block: 8 rows x 4096 tokens x top-4 x 2048 x bf16, 3/4 leaving
    routed = 8 * 4096 * 4 * 2048 * 2 * 3 / 4
    least = MOE.layers * 4 * routed / h100.groups[0][1].intra
    assert four.step.tensor - one.step.tensor == pytest.approx(least, rel=0.05)
    assert scale.predict(DENSE, Layout(), h100, 64).step.tensor == one.step.tensor == 0


def test_plan_ranks_ep_layouts_of_a_mixture_of_experts():
    rows = planner.rank_model(MOE, devices.parse_devices("8xH100:141GB"), 16)
    names = {row.layout.name(): row for row in rows}
    ep4 = names["tp1 pp1 replicate mb1 ep4"]
    assert ep4.prediction is not None and ep4.note is None
    assert names["tp2 pp1 replicate mb1 ep2"].note is None  # tp inside the experts x ep
    assert names["tp2 pp1 fsdp mb1 ep2"].note is not None  # predicted, not runnable yet
    # replicated, every rank holds all 60 experts' AdamW states: over memory; ep=4 fits
    assert names["tp1 pp1 replicate mb1"].prediction is None


def test_under_tp_each_rank_holds_its_cut_of_its_experts():
    h100 = devices.parse_devices("8xH100")
    experts = MOE.layers * MOE.block_expert_params
    ep2 = scale.predict(MOE, Layout(ep=2), h100, 16).memory
    tp2_ep2 = scale.predict(MOE, Layout(tp=2, ep=2), h100, 16).memory
    tp2 = scale.predict(MOE, Layout(tp=2), h100, 16).memory
    # the experts: 1/2 of them per rank under ep=2, 1/4 under tp=2 x ep=2, 1/2 under tp=2
    assert ep2.weights - tp2_ep2.weights > 2 * experts / 4 > 0
    assert tp2.weights - tp2_ep2.weights == pytest.approx(2 * experts / 4)


def test_fsdp_shards_each_expert_over_its_replicas_only():
    h100 = devices.parse_devices("8xH100")
    fsdp = scale.predict(MOE, Layout(dp="fsdp", ep=4), h100, 16).memory
    experts = MOE.layers * MOE.block_expert_params  # each over 8 / 4 = 2 replicas
    rest = MOE.params - experts  # over all 8 data ranks
    assert fsdp.states == pytest.approx(16 * (rest / 8 + experts / 4 / 2))


# -- a program's probe: macrogen plan FILE and layout="auto" ---------------------------------

# a probe of a mixture of experts as probe.py writes it: 2 MoE layers, the experts 80% of the
# parameters, 40% of the step, 10 ms of it a fixed cost per call (4 experts a layer)
PROBED = memory.Profile(
    param_bytes=1_000_000, sharded_bytes=0, block_bytes=900_000, blocks=2, state_bytes=2_000_000,
    transient_bytes=1_500_000, step_s=0.1, block_s=0.08, optimizer_s=0.01, message_bytes=40_000,
    expert_bytes=800_000, expert_layers=2, expert_s=0.04, expert_call_s=0.01,
    routed_bytes=probe_experts.routed_bytes(256 * 2, 64, 4) * 2,  # 256 tokens, top-2, 2 layers
)  # fmt: skip
LINK = cost.Link("test", bandwidth=1e9, latency=1e-4)
MACHINE = cost.Machine(8, LINK, LINK)


def test_the_routing_moves_each_ranks_pairs_four_times_per_layer_over_its_expert_group():
    dense, ep2 = (cost.predict(PROBED, Layout(ep=e), 4, MACHINE) for e in (1, 2))
    assert dense.experts == 0
    pairs = 256 * 2 * 64 * 4 / 4  # one layer's routed bytes, one way, this rank's quarter
    assert ep2.experts == pytest.approx(2 * 4 * (LINK.latency + pairs / 2 / LINK.bandwidth))
    assert ep2.calls - dense.calls == 2 * 5 + 2  # per layer: 4 all-to-alls, the counts, the
    # experts' all-reduce over their 2 replicas
    # the experts' fixed cost: 4 experts a layer on every rank, 2 under ep=2
    assert dense.compute - ep2.compute == pytest.approx(0.01 / 2)


def test_a_recomputed_block_routes_its_pairs_again_in_backward():
    ep2 = cost.predict(PROBED, Layout(ep=2), 4, MACHINE)
    every = cost.predict(PROBED, Layout(ep=2, recompute=1), 4, MACHINE)
    half = cost.predict(PROBED, Layout(ep=2, recompute=2), 4, MACHINE)  # the first of 2 blocks
    one = ep2.experts / 2 / 4  # one all-to-all of one layer
    assert every.experts == pytest.approx(ep2.experts + 2 * 2 * one)  # 2 layers, 2 again
    assert half.experts == pytest.approx(ep2.experts + 2 * one)
    assert every.calls - ep2.calls == 2 * 3  # per layer: the counts and 2 all-to-alls again


def test_the_experts_gradients_are_averaged_over_their_replicas_the_rest_over_all():
    ep2 = cost.predict(PROBED, Layout(ep=2), 4, MACHINE)
    rest, experts = 200_000, 800_000 / 2
    want = cost.all_reduce_s(rest, 4, LINK) + cost.all_reduce_s(experts, 2, LINK)
    assert ep2.data == pytest.approx(want)
    ep4 = cost.predict(PROBED, Layout(ep=4), 4, MACHINE)  # one replica: nothing to average
    assert ep4.data == pytest.approx(cost.all_reduce_s(rest, 4, LINK))
    fsdp = cost.predict(PROBED, Layout(dp="fsdp", ep=2), 4, MACHINE)
    gathers = cost.all_gather_s(rest, 4, LINK) + cost.all_gather_s(experts, 2, LINK)
    units = 2 + 1 + 2  # the blocks, the root, each experts module
    assert fsdp.data == pytest.approx(3 * (gathers + (units - 1) * 3 * LINK.latency))


def test_a_rank_holds_its_experts_and_their_state_over_ep():
    one, two = (memory.predict(PROBED, Layout(ep=e), 4) for e in (1, 2))
    assert one.params - two.params == pytest.approx(400_000)  # half of the experts' bytes
    assert one.grads - two.grads == pytest.approx(400_000)
    assert one.state - two.state == pytest.approx(800_000)  # their AdamW state too
    # fsdp: each expert sharded over its 2 replicas, so 1/4 of every parameter per rank, as
    # without ep; a unit gathers half of its experts
    f1, f2 = (memory.predict(PROBED, Layout(dp="fsdp", ep=e), 4) for e in (1, 2))
    assert f1.state == f2.state == pytest.approx(2_000_000 / 4)
    block = 900_000 / 2
    assert f1.params - f2.params == pytest.approx(2 * (block - (900_000 - 400_000) / 2))


def test_a_programs_plan_lists_ep_where_mg_parallelize_runs_it():
    moe = ModelShape(blocks=2, rows=8, experts=4)
    rows = planner.rank(PROBED, moe, 4, MACHINE, arguments={})
    named = {row.layout.name(): row for row in rows}
    for runs in ("tp1 pp1 replicate mb1 ep2", "tp1 pp1 fsdp mb1 ep2", "tp1 pp1 replicate mb1 ep4"):
        assert named[runs].reason is None and named[runs].step is not None, runs
    assert named["tp1 pp1 zero1 mb1 ep2"].reason is None  # (with mg.shard_optimizer)
    recomputed = named["tp1 pp1 replicate mb1 recompute ep2"]  # the routing runs again
    assert recomputed.reason is None and recomputed.step is not None
    assert named["tp2 pp1 replicate mb1 ep2"].reason == "tp=2 needs a tp_plan"
    dense = planner.rank(PROBED, ModelShape(blocks=2, rows=8), 4, MACHINE, arguments={})
    assert all(row.layout.ep == 1 for row in dense)
    # experts in nn.ModuleLists: ep with tp=1 and dp="replicate" only
    listed = dataclasses.replace(moe, experts_listed=True)
    reason = layouts.infeasible(Layout(dp="fsdp", ep=2), 4, listed) or ""
    assert reason.startswith("ep=2 over experts in an nn.ModuleList runs with tp=1"), reason
    assert layouts.infeasible(Layout(ep=2), 4, listed) is None
    assert layouts.infeasible(Layout(ep=2, dp="zero1"), 4, listed) is None


@pytest.mark.parametrize(
    "arguments, named",
    [
        ({"servers": 1}, "servers"),
        ({"verify": True}, "verify"),
        ({"dp_shares": "even"}, "dp_shares"),
    ],
)
def test_a_sites_other_arguments_prune_ep_as_its_expansion_refuses_them(arguments, named):
    reason = layouts.problem(Layout(ep=2), 4, ModelShape(experts=4), arguments) or ""
    assert reason.startswith(f"ep=2 with {named}=") and "not supported yet" in reason, reason


def test_the_probe_finds_the_experts_and_counts_the_routed_bytes_as_the_routing_does(monkeypatch):
    import torch

    from macrogen.autotune.probe import _Clock
    from tests.expert_models import ListMoE, PlainMoE, batches

    monkeypatch.setattr(probe_experts, "ROUNDS", 1)
    for model, listed in ((PlainMoE(), False), (ListMoE(), True)):
        experts = probe_experts.ExpertsProbe(model, _Clock())
        assert (experts.experts, experts.layers, bool(experts.lists)) == (4, 2, listed)
        inside = {id(p) for b in model.blocks for p in b.experts.parameters()}
        stacked = sum(p.numel() * 4 for p in model.parameters() if id(p) in inside)
        assert experts.param_bytes == stacked
        hooks = experts.hooks()
        experts.reset()
        ids = batches(1, 4)[0]
        model(ids, ids).backward()
        # tokens x top_k x hidden x element size per layer: what the dist test checks of Traffic
        assert experts.routed == 2 * probe_experts.routed_bytes(ids.numel() * 2, 16, 4)
        assert experts.clock.seconds() > 0 and len(experts.calls) == (1 if not listed else 4)
        grads = [p.grad.clone() for p in model.parameters()]
        assert experts.call_s(torch, cuda=False) >= 0
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        for h in hooks:
            h.remove()


def test_a_tunable_ep_is_a_layout_the_search_prunes_and_orders():
    from macrogen.autotune import layout_search, space
    from macrogen.expand import expand_source

    source = (
        "import macrogen as mg\n"
        "def build(m):\n"
        "    return mg.parallelize(m, ep=mg.tunable(1, choices=[1, 2, 4]))\n"
    )
    params = space.parameters(expand_source(source, path="m.py"))
    site = layout_search.site_of(params)
    assert site is not None  # ep alone is a layout's degree
    built = space.build(params, space.TuningEnv("cpu", 2, "cpu"))
    moe = ModelShape(blocks=2, rows=8, experts=4)
    ordered, predictions = layout_search.prepare(built, site, PROBED, moe, 2, MACHINE)
    assert sorted(c["build.parallelize.ep"] for c in ordered.candidates) == [1, 2]
    why = {c["build.parallelize.ep"]: reason for c, reason in ordered.excluded}
    assert why[4].endswith("ep=4 does not divide the 2 data ranks"), why
    assert {p.layout.ep for p in predictions.values()} == {1, 2}
