"""``macrogen plan`` and the layouts know ``ep``: a layout dim for mixtures of experts, the
experts' memory divided by ep, the routing all-to-alls in the step time."""

from __future__ import annotations

import dataclasses

import pytest

from macrogen.autotune import devices, layouts, planner, scale
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
    assert "not supported" in (layouts.unsupported(Layout(ep=2, dp="zero1")) or "")


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
