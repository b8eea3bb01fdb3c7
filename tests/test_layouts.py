"""Layouts, their feasibility, and the memory and cost models (pure: no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from macrogen.autotune import cost, database, layouts, memory
from macrogen.autotune.layouts import Layout, ModelShape

SHAPE = ModelShape(blocks=8, divisible={"layers.0.attn.n_head": 6, "layers.0.fc out features": 64})


def test_a_layout_round_trips_through_its_name():
    layout = Layout(tp=2, pp=4, dp="fsdp", microbatches=8)
    assert layout.name() == "tp2 pp4 fsdp mb8"
    assert layouts.parse(layout.name()) == layout
    assert Layout(tp=2, dp="zero1").describe(8) == "tp2 x dp4 (zero1)"
    with pytest.raises(ValueError, match="not a layout"):
        layouts.parse("tp2 pp1 ddp mb1")


@pytest.mark.parametrize(
    "layout, reason",
    [
        (Layout(tp=3), "tp x pp = 3 does not divide the world size 4"),
        (Layout(tp=2, pp=4, microbatches=8), "tp x pp = 8 does not divide the world size 4"),
        (Layout(tp=4), "layers.0.attn.n_head = 6 is not divisible by tp=4"),
        (Layout(tp=4, dp="fsdp"), "one data-parallel rank: fsdp is the same layout as replicate"),
        (Layout(microbatches=4), "micro-batches without a pipeline (pp=1)"),
    ],
)
def test_infeasible_layouts_carry_their_reason(layout, reason):
    assert reason in (layouts.infeasible(layout, 4, SHAPE) or "")


def test_a_batch_every_data_rank_and_micro_batch_cannot_share_equally_is_infeasible():
    shape = ModelShape(blocks=8, rows=16)
    assert layouts.infeasible(Layout(), 32, shape) == (
        "a batch of 16 rows does not split into 32 data ranks (equal shares)"
    )
    assert layouts.infeasible(Layout(pp=2, microbatches=8), 8, shape) == (
        "a batch of 16 rows does not split into 4 data ranks x 8 micro-batches (equal shares)"
    )
    assert layouts.infeasible(Layout(pp=2, microbatches=4), 8, shape) is None
    assert layouts.infeasible(Layout(), 32, ModelShape(blocks=8)) is None  # rows not known


def test_fewer_blocks_than_stages_is_infeasible():
    shape = ModelShape(blocks=2)
    assert layouts.infeasible(Layout(pp=4, microbatches=8), 4, shape) == (
        "2 blocks cannot fill 4 pipeline stages"
    )
    assert layouts.infeasible(Layout(pp=2, microbatches=4), 4, shape) is None


def test_the_feasible_layouts_of_four_ranks():
    feasible = [
        x.name() for x in layouts.enumerate_layouts(4) if layouts.infeasible(x, 4, SHAPE) is None
    ]
    assert "tp1 pp1 replicate mb1" in feasible and "tp2 pp1 fsdp mb1" in feasible
    assert "tp2 pp2 replicate mb4" in feasible  # dp 1: replicate only
    assert not any(name.startswith("tp4") for name in feasible)  # 6 heads
    assert layouts.unsupported(Layout(pp=2, microbatches=4)) is None  # a run-time cut
    assert layouts.unsupported(Layout(tp=2, pp=2, microbatches=4)) is None  # stages sharded
    assert layouts.unsupported(Layout(tp=2, pp=2, dp="fsdp", microbatches=4)) is None
    assert layouts.unsupported(Layout(tp=2, dp="zero1")) is None  # ZeRO-1 over DTensor shards
    assert layouts.unsupported(Layout(tp=2, dp="fsdp")) is None


@pytest.mark.timeout(10)  # scanning 1..N (as before) takes hours at these sizes
def test_world_sizes_up_to_2_to_the_40_enumerate_from_their_prime_factors():
    assert layouts.prime_factors(360) == {2: 3, 3: 2, 5: 1}
    assert layouts.divisors(360) == [d for d in range(1, 361) if 360 % d == 0]
    assert layouts.divisors(2**40 - 87) == [1, 2**40 - 87]  # a prime: 2^20 trial divisions
    assert len(layouts.divisors(2**40)) == 41
    assert len(layouts.divisors(963_761_198_400)) == 6720  # the most divisors below 2^40
    for world in (2**40, 2**40 - 87, 963_761_198_400, 10**9):
        found = list(layouts.enumerate_layouts(world, max_pp=128))
        assert found and all(world % (x.tp * x.pp) == 0 and x.pp <= 128 for x in found)
    # the planner over them (the model's rules prune; nothing is scanned per rank)
    from macrogen.autotune import planner

    machine = cost.Machine(8, cost.Link("nvlink", 900e9), cost.Link("ib", 50e9))
    rows = planner.rank(PROFILE, ModelShape(blocks=8, rows=4 * 10**9), 10**9, machine)
    assert any(r.step is not None for r in rows)


def test_micro_batches_are_any_split_of_a_data_ranks_rows():
    assert layouts.microbatch_splits(16, 16) == (16,)  # Llama 3 405B: pp 16, 16 rows per rank
    assert layouts.microbatch_splits(4, 24) == (4, 6, 8, 12, 24)
    assert layouts.microbatch_splits(1, 24) == (1,)
    found = {x.microbatches for x in layouts.enumerate_layouts(16384, rows=2048) if x.pp == 16}
    assert 16 in found  # tp 8 x pp 16 x dp 128: 2048 rows, 16 per data rank, one a micro-batch


def test_auto_choices_are_layout_names_the_default_first():
    choices = layouts.auto_choices()
    assert choices[0] == "tp1 pp1 replicate mb1"
    assert len(set(choices)) == len(choices)
    assert all(layouts.parse(c).name() == c for c in choices)


def test_a_candidates_arguments_give_its_layout():
    assert layouts.from_arguments({"tp": 2, "dp": "fsdp"}) == Layout(tp=2, dp="fsdp")
    assert layouts.from_arguments({"layout": "tp2 pp1 zero1 mb1"}) == Layout(2, 1, "zero1", 1)
    assert layouts.from_arguments({"dp": "none"}) is None


PROFILE = memory.Profile(
    param_bytes=100,
    sharded_bytes=80,
    block_bytes=80,
    blocks=8,
    state_bytes=200,
    transient_bytes=500,  # 100 of gradients, 400 of activations (above the kept gradients)
    step_s=1.0,
    block_s=0.8,
    message_bytes=1000,
)


def test_memory_per_data_parallel_mode():
    serial = memory.predict(PROFILE, Layout(), 1)
    # the activations peak at the forward's end, before backward makes the gradients that
    # zero_grad freed: the step's peak is the parameters, the state and the activations
    assert (serial.params, serial.state, serial.grads, serial.activations) == (100, 200, 100, 300)
    assert serial.total == 100 + 200 + 400
    kept = dataclasses.replace(PROFILE, grads_kept=True)  # zero_grad(set_to_none=False)
    assert memory.predict(kept, Layout(), 1).activations == 400
    replicate = memory.predict(PROFILE, Layout(), 4)
    assert (replicate.params, replicate.state, replicate.grads) == (100, 200, 100)
    # 400 over 4 data ranks, beside the gradients the buckets hold between steps; the buckets
    # take each gradient as autograd makes it: no copy
    assert replicate.activations == 100
    # a replicated stage's micro-batches accumulate into autograd's own gradients, which the
    # buckets take after the last: the stage's gradients (60) twice
    staged = memory.predict(PROFILE, Layout(pp=2, microbatches=4), 4)
    assert staged.activations == pytest.approx(400 / 2 / 2 * 2 / 4 + 60)
    assert memory.predict(PROFILE, Layout(pp=2, microbatches=4), 2).activations == (
        pytest.approx(400 / 2 * 2 / 4)  # one data rank: nothing reduced, nothing copied
    )
    # ep flattens its experts' gradients for their replicas' all-reduce (counted whole)
    assert memory.predict(PROFILE, Layout(ep=2), 4).activations == 100 + 100
    zero1 = memory.predict(PROFILE, Layout(dp="zero1"), 4)
    assert zero1.state == 50 and zero1.params == 100
    assert zero1.activations == 100 + 100  # the local gradients beside the shards
    fsdp = memory.predict(PROFILE, Layout(dp="fsdp"), 4)
    assert fsdp.params == pytest.approx(25 + 2 * 10)  # a quarter, plus two blocks' buffers
    assert fsdp.state == 50 and fsdp.grads == pytest.approx(25 + 2 * 10)
    # no buckets: the gradient shards (25) are freed at the step's start, made in backward
    assert fsdp.activations == pytest.approx(100 - 25)
    # a pipeline stage under FSDP stays gathered through its backward, its gradients whole
    # until the last micro-batch, reduce-scattered one unit (a block: 10) at a time
    staged = memory.predict(PROFILE, Layout(pp=2, dp="fsdp", microbatches=4), 4)
    assert staged.params == pytest.approx(60 + 30) and staged.grads == pytest.approx(60 + 30 + 10)


def test_memory_under_tensor_and_pipeline_parallelism():
    tp2 = memory.predict(PROFILE, Layout(tp=2), 2)
    assert tp2.params == pytest.approx(60)  # 80 / 2 + 20
    # the parameters' share stands in; the gradients (60) are made after the forward's peak
    assert tp2.activations == pytest.approx(400 * 0.6 - 60)
    # recomputed, the peak moves into backward, where most gradients are made
    kept = dataclasses.replace(PROFILE, grads_kept=True)
    recomputed = memory.predict(PROFILE, Layout(tp=2, recompute=1), 2)
    assert recomputed.activations == memory.predict(kept, Layout(tp=2, recompute=1), 2).activations
    pp2 = memory.predict(PROFILE, Layout(pp=2, microbatches=4), 2)
    assert pp2.params == pytest.approx(60)  # half the blocks, all the rest
    # 1F1B: the first stage holds 2 of 4 micro-batches of half the blocks
    assert pp2.activations == pytest.approx(400 / 2 * 2 / 4)


def test_activations_shard_by_what_autograd_saves_and_the_optimizer_step_can_peak():
    # half the saved bytes are on the MLP's hidden side: tp=2 keeps 3/4 of them (less the
    # gradients, 60, made after the forward's peak)
    measured = dataclasses.replace(PROFILE, activation_sharded=0.5)
    assert memory.predict(measured, Layout(tp=2), 2).activations == pytest.approx(300 - 60)
    # an optimizer step whose temporaries outgrow the activations sets the peak
    heavy = dataclasses.replace(PROFILE, optimizer_bytes=1000)
    step = memory.predict(heavy, Layout(), 1)
    assert step.activations == 1000 and step.total == 100 + 200 + 100 + 1000
    # zero1 shards them with the state
    assert memory.predict(heavy, Layout(dp="zero1"), 4).activations == pytest.approx(250)


def test_sizes_parse_with_units_bytes_and_bits_as_for_links():
    from macrogen.autotune import units

    assert units.size("--m", "80GB") == 80e9
    assert units.size("--m", "512MiB") == 512 * 2**20
    assert units.size("--m", "1e9B") == 1e9
    assert units.size("--m", "80Gb") == 10e9  # bits, as --link reads them
    for bad in ("lots", "nan", "inf", "-80GB", "0GB", "80 GB/s", "٨٠GB"):
        with pytest.raises(units.UsageError, match="--m"):
            units.size("--m", bad)
    assert units.count("--n", "1e9") == 10**9
    for bad in ("-3", "0", "1.5", "²", "abc", ""):
        with pytest.raises(units.UsageError, match="--n"):
            units.count("--n", bad)
    assert units.number("--x", "0", inclusive=True) == 0.0
    with pytest.raises(units.UsageError, match="--x must be above 0"):
        units.number("--x", "0")


MACHINE = cost.Machine(
    per_node=8, intra=cost.Link("nvlink", 900e9, 0.0), inter=cost.Link("ib", 50e9, 0.0)
)


def test_links_parse():
    intra, inter = cost.parse_links("nvlink:900GB/s,ib:400Gb/s")
    assert (intra.name, intra.bandwidth) == ("nvlink", 900e9)
    assert inter.bandwidth == 50e9
    with pytest.raises(ValueError, match="NAME:BANDWIDTH"):
        cost.parse_links("nvlink=fast")
    with pytest.raises(ValueError, match="--link 'nvlink:.GB/s'"):  # named, not float()'s words
        cost.parse_links("nvlink:.GB/s")


def test_collective_bytes_follow_the_plan():
    link = cost.Link("x", 1.0, 0.0)  # 1 byte/s: times are bytes
    assert cost.all_reduce_s(100, 4, link) == pytest.approx(2 * 3 / 4 * 100)  # ~2x the bytes
    assert cost.all_gather_s(100, 4, link) == pytest.approx(75)
    machine = cost.Machine(8, link, link)
    replicate = cost.predict(PROFILE, Layout(), 4, machine)
    assert replicate.data == pytest.approx(cost.all_reduce_s(100, 4, link))
    fsdp = cost.predict(PROFILE, Layout(dp="fsdp"), 4, machine)
    assert fsdp.data == pytest.approx(3 * cost.all_gather_s(100, 4, link))
    tp = cost.predict(PROFILE, Layout(tp=2), 4, machine)
    # 4 all-reduces per block, 8 blocks, of the block output for this rank's half of the batch
    assert tp.tensor == pytest.approx(4 * 8 * cost.all_reduce_s(500, 2, link))
    pp = cost.predict(PROFILE, Layout(pp=2, microbatches=4), 4, machine)
    assert pp.pipeline == pytest.approx(2 * 4 * 1000 / 2 / 4)
    assert pp.compute == pytest.approx(1.0 / 2 * (0.8 / 2 + 0.2) * (5 / 4))


def test_slow_links_across_nodes_change_the_ranking():
    big = memory.Profile(10**10, 9 * 10**9, 9 * 10**9, 32, 2 * 10**10, 10**10, 1.0, 0.9, 10**8)
    fsdp = cost.predict(big, Layout(dp="fsdp"), 64, MACHINE)
    tp8 = cost.predict(big, Layout(tp=8, dp="fsdp"), 64, MACHINE)
    assert tp8.data < fsdp.data  # the gradient traffic across nodes shrinks by tp's share


def test_the_fit_scales_compute_and_communication():
    steps = [cost.Step(1.0, 0.0, 1.0, 0.0), cost.Step(2.0, 0.0, 0.5, 0.0), cost.Step(1, 0, 3, 0)]
    measured = [3 * s.compute + 0.5 * s.communication for s in steps]
    f = cost.fit(list(zip(steps, measured)))
    assert f.compute == pytest.approx(3) and f.communication == pytest.approx(0.5)
    one = cost.fit([(steps[0], 4.0)])
    assert one(steps[0]) == pytest.approx(4.0)


def test_the_fit_finds_the_fixed_costs_of_fsdp_units_and_calls():
    steps = [
        cost.Step(1.0, 0.0, 1.0, 0.0, calls=0, units=0),
        cost.Step(2.0, 0.0, 0.5, 0.0, calls=30, units=0),
        cost.Step(1.0, 0.5, 0.0, 0.0, calls=10, units=9),
        cost.Step(0.5, 0.0, 3.0, 0.0, calls=2, units=0),
        cost.Step(0.7, 0.1, 0.2, 0.0, calls=0, units=27),
        cost.Step(0.3, 0.0, 0.1, 0.0, calls=1, units=3),
    ]
    measured = [
        2 * s.compute + 0.5 * s.communication + 0.004 * s.units + 0.01 * s.calls for s in steps
    ]
    f = cost.fit(list(zip(steps, measured)))
    assert (f.compute, f.communication, f.per_unit, f.per_call) == pytest.approx(
        (2, 0.5, 0.004, 0.01)
    )
    # units from four points, calls from six, two of them paying it
    four = cost.fit(list(zip(steps[1:5], measured[1:5])))
    assert four.per_call is None and four.per_unit is not None
    assert cost.fit(list(zip(steps[:4], measured[:4]))).per_unit is None  # one FSDP layout
    # before a fixed cost is fitted, the link's prior stands for it, in the fit and the prediction
    primed = [dataclasses.replace(s, call_s=0.01, unit_s=0.004) for s in steps[:3]]
    three = cost.fit(list(zip(primed, measured[:3])))
    assert (three.compute, three.communication) == pytest.approx((2, 0.5))
    assert three(primed[2]) == pytest.approx(measured[2])
    # a negative term would explain noise: it is held at zero and the rest refitted
    assert cost.nonnegative_least_squares([[1, 1], [1, 2], [1, 3]], [3, 2, 1]) == pytest.approx(
        [2, 0]
    )


def test_collective_calls_are_counted_per_layout():
    four = cost.Machine(4, cost.GLOO_LOCAL, cost.GLOO_LOCAL)
    assert cost.predict(PROFILE, Layout(), 1, four).calls == 0
    assert cost.predict(PROFILE, Layout(), 4, four).calls == 1  # one all-reduce (buckets)
    fsdp = cost.predict(PROFILE, Layout(dp="fsdp"), 4, four)
    assert (fsdp.units, fsdp.calls) == (9 * 4, 0)  # 8 blocks + the root, each 1 + 3 ring steps
    # over DTensor parameters (tp), tp - 1 more: 1 + 1 ring step + 1
    assert cost.predict(PROFILE, Layout(tp=2, dp="fsdp"), 4, four).units == 9 * 3
    assert cost.predict(PROFILE, Layout(tp=2), 2, four).calls == 4 * 8
    assert cost.predict(PROFILE, Layout(pp=2, microbatches=4), 2, four).calls == 2 * 4


# -- mg.parallelize's degrees as tunables, and layout="auto" ------------------------------

AUTO = """
import macrogen as mg

def build(model):
    return mg.parallelize(model, layout="auto", tp_plan={"layers.*.fc": "colwise"})
"""

DEGREES = """
import macrogen as mg

def build(model):
    return mg.parallelize(model, tp=mg.tunable(1, choices=[1, 2, 4]), pp=mg.tunable(1, choices=[1, 2]),
                          dp=mg.tunable("replicate", choices=["replicate", "zero1", "fsdp"]),
                          microbatches=mg.tunable(4, choices=[2, 4, 8]), tp_plan={"layers.*.fc": "colwise"})
"""


def _space(source, world):
    from macrogen.autotune import space
    from macrogen.expand import expand_source

    params = space.parameters(expand_source(source, path="m.py"))
    return params, space.build(params, space.TuningEnv("cpu", world, "cpu"))


def test_layout_auto_is_one_tunable_over_layout_names():
    from macrogen.expand import expand_source

    (param,), built = _space(AUTO, 4)
    assert param.key == "build.parallelize.layout" and param.macro == "parallelize"
    names = [c[param.key] for c in built.candidates]
    plain = [
        "tp1 pp1 replicate mb1",
        "tp1 pp1 fsdp mb1",
        "tp1 pp2 replicate mb4",
        "tp1 pp2 replicate mb8",
        "tp1 pp2 fsdp mb4",
        "tp1 pp2 fsdp mb8",
        "tp1 pp4 replicate mb8",
        "tp1 pp4 replicate mb16",
        "tp2 pp1 replicate mb1",
        "tp2 pp1 fsdp mb1",
        "tp2 pp2 replicate mb4",  # tensor parallel inside pipeline stages
        "tp2 pp2 replicate mb8",
        "tp4 pp1 replicate mb1",
    ]
    # expert parallelism where mg.parallelize runs it (the probe prunes it for a model without
    # experts): ep dividing the data ranks, dp replicate or fsdp (tp=1), replicate (tp > 1)
    experts = ["tp1 pp1 replicate mb1 ep2", "tp1 pp1 fsdp mb1 ep2", "tp2 pp1 replicate mb1 ep2"]
    experts += ["tp1 pp1 replicate mb1 ep4", "tp1 pp1 fsdp mb1 ep4"]
    every = [f"{n} recompute" for n in plain] + [f"{n} recompute/2" for n in plain]
    # and with the blocks recomputed (their routing runs again in backward)
    experts += [n.replace(" ep", f" {r} ep") for r in ("recompute", "recompute/2") for n in experts]
    assert names == plain + every + experts
    why = {c[param.key]: reason for c, reason in built.excluded}
    assert why["tp2 pp1 replicate mb1 ep4"].endswith("ep=4 does not divide the 2 data ranks")
    assert "does not divide the world size 4" in why["tp8 pp1 replicate mb1"]
    assert "one data-parallel rank" in why["tp2 pp2 fsdp mb4"]
    assert "zero1" in why["tp2 pp1 zero1 mb1"]
    assert "mg.shard_optimizer" in why["tp1 pp1 zero1 mb1"]
    code = expand_source(AUTO, path="m.py", tuning={param.key: "tp2 pp1 fsdp mb1"}).code
    assert "device_mesh(tp=2," in code and "apply_fully_sharded(model" in code


def test_degrees_as_tunables_are_pruned_with_reasons():
    params, built = _space(DEGREES, 4)
    assert sorted(p.key for p in params) == [
        "build.parallelize.dp",
        "build.parallelize.microbatches",
        "build.parallelize.pp",
        "build.parallelize.tp",
    ]
    piped = {
        (c["build.parallelize.tp"], c["build.parallelize.dp"])
        for c in built.candidates
        if c["build.parallelize.pp"] > 1
    }
    assert piped == {(1, "replicate"), (1, "zero1"), (1, "fsdp"), (2, "replicate")}
    reasons = " | ".join(r for _, r in built.excluded)
    assert "pp > 1 with tp > 1" not in reasons  # tensor parallel inside pipeline stages


def test_layout_auto_errors():
    from tests.helpers import expansion_errors

    (error,) = expansion_errors(
        "import macrogen as mg\nm = mg.parallelize(m, layout='auto', tp=2, tp_plan='hf')\n"
    )
    assert 'layout="auto" chooses tp, pp, dp, microbatches, recompute and ep; leave out tp' in error
    (error,) = expansion_errors("import macrogen as mg\nm = mg.parallelize(m, layout='best')\n")
    assert 'layout must be "auto"' in error
    (error,) = expansion_errors("import macrogen as mg\nm = mg.parallelize(m, microbatches=0)\n")
    assert "microbatches must be an int >= 1" in error


def test_the_search_stops_when_nothing_left_is_predicted_faster():
    from macrogen.autotune import database
    from macrogen.autotune.layout_search import LayoutSearch, Prediction

    order = [{"k": name} for name in ("a", "b", "c", "d")]
    raw = {"a": 1.0, "b": 1.2, "c": 2.0, "d": 2.5}  # all communication-free: one scale fits
    predictions = {
        database.canonical(c): Prediction(
            Layout(), cost.Step(raw[c["k"]], 0, 0, 0), memory.Breakdown(0, 0, 0, 0)
        )
        for c in order
    }
    search = LayoutSearch(order, predictions, noise=0.05)
    search.observe(0.1)
    assert not search.done  # one point: no fit to trust yet
    search.observe(0.13)
    # fitted: c would take ~0.2, d ~0.25; nothing beats 0.1 by 5%
    assert search.done and search.stop_reason == "early stop"
    exhaustive = LayoutSearch(order, predictions, noise=float("-inf"))
    for t in (0.1, 0.13, 0.2):
        exhaustive.observe(t)
        assert not exhaustive.done
    exhaustive.observe(0.3)
    assert exhaustive.done and exhaustive.stop_reason == "complete"


def test_the_search_measures_a_layout_with_stages_and_one_without():
    """The loaded run: the probe's fixed cost per block call came out 0, so pipelines looked
    free of their micro-batches' calls and came first; a fit to them alone then ruled out
    replicate's layout (the fastest) unmeasured. The fitted best of the kind not measured yet
    is measured next, and the search does not stop before it is."""
    from macrogen.autotune import database
    from macrogen.autotune.layout_search import LayoutSearch, Prediction

    names = {"p1": Layout(pp=2, microbatches=4), "p2": Layout(pp=4, microbatches=8)}
    names |= {"d1": Layout(), "d2": Layout(recompute=1)}
    order = [{"k": name} for name in ("p1", "p2", "d2", "d1")]
    raw = {"p1": 1.0, "p2": 1.05, "d1": 2.0, "d2": 1.9}
    predictions = {
        database.canonical(c): Prediction(
            names[c["k"]], cost.Step(raw[c["k"]], 0, 0, 0), memory.Breakdown(0, 0, 0, 0)
        )
        for c in order
    }
    search = LayoutSearch(order, predictions, noise=0.05)
    search.observe(0.1)
    search.observe(0.105)
    assert not search.done and search.order[2] == {"k": "d2"}  # the raw best without stages
    assert search.favourite() == {"k": "p1"}  # of the measured, the model's fastest
    search.observe(0.09)  # faster than the model said
    assert search.done and search.stop_reason == "early stop"


def test_the_winners_measured_spread_widens_the_search():
    """The finals found the winner's runs 15% apart: a layout predicted 10% slower than it
    can't be ruled out by the model, so it is measured before the search stops."""
    from macrogen.autotune import database
    from macrogen.autotune.layout_search import MAX_REACH, LayoutSearch, Prediction

    order = [{"k": name} for name in ("a", "b", "c")]
    raw = {"a": 1.0, "b": 1.0, "c": 1.1}
    predictions = {
        database.canonical(c): Prediction(
            Layout(), cost.Step(raw[c["k"]], 0, 0, 0), memory.Breakdown(0, 0, 0, 0)
        )
        for c in order
    }
    search = LayoutSearch(order, predictions, noise=0.05)
    search.observe(0.1)
    search.observe(0.1)
    assert search.done  # c is predicted 10% slower: nothing left beats the best
    search.settle(0.1, 0.15)
    assert not search.done  # within the winner's spread: measure it
    search.settle(0.1, 5.0)
    assert search.reach == MAX_REACH  # a spike is no reason to measure everything


def test_the_search_ranks_what_is_left_by_the_fit():
    from macrogen.autotune import database
    from macrogen.autotune.layout_search import LayoutSearch, Prediction

    order = [{"k": name} for name in ("a", "b", "c", "d")]
    # (compute, communication): raw a 1.0, b 1.05, c 1.2, d 1.3
    raw = {"a": (1.0, 0.0), "b": (0.55, 0.5), "c": (0.6, 0.6), "d": (1.3, 0.0)}
    predictions = {
        database.canonical(c): Prediction(
            Layout(), cost.Step(*raw[c["k"]], 0, 0), memory.Breakdown(0, 0, 0, 0)
        )
        for c in order
    }
    search = LayoutSearch(order, predictions, noise=float("-inf"))
    search.observe(1.0)
    assert [c["k"] for c in search.order] == ["a", "b", "c", "d"]  # one point: the raw order
    search.observe(3.0)  # communication is 4.9x what the raw model says: c ~3.5, d 1.3
    assert search.fitted.communication == pytest.approx(4.9)
    assert [c["k"] for c in search.order] == ["a", "b", "d", "c"]
    assert [c["k"] for c in search.rank([{"k": "c"}, {"k": "d"}])] == ["d", "c"]


def test_a_pipeline_stage_holds_every_micro_batch_s_receive_buffer():
    profile = memory.Profile(100, 0, 80, 8, 200, 500, message_bytes=64)
    assert memory.predict(profile, Layout(), 4).buffers == 0
    for mb in (4, 8):  # m buffers of a micro-batch each: the rank's share of the batch
        staged = memory.predict(profile, Layout(pp=2, microbatches=mb), 4)
        assert staged.buffers == 64 / 2 and staged.step == pytest.approx(
            staged.params + staged.state + staged.grads + staged.activations + 32
        )


def test_sharded_layouts_peak_while_the_serial_model_is_cut():
    small = memory.Profile(100, 80, 80, 8, 0, 100)  # no optimizer, no activations
    fsdp = memory.predict(small, Layout(dp="fsdp"), 4)
    assert fsdp.step < fsdp.build == pytest.approx(100 + fsdp.params)
    assert fsdp.total == fsdp.build
    assert memory.predict(small, Layout(), 4).build == 100  # replicate: the model as it is


def test_prepare_dedupes_prunes_by_memory_and_orders_by_prediction():
    from macrogen.autotune import layout_search

    params, built = _space(DEGREES, 4)
    site = layout_search.site_of(params)
    assert site is not None
    machine = cost.Machine(4, cost.Link("x", 1e9, 1e-4), cost.Link("x", 1e9, 1e-4))
    # only fsdp layouts fit, and pipelines whose stages hold half the blocks each
    limit = memory.predict(PROFILE, Layout(dp="fsdp"), 4).total + 1
    kept, predictions = layout_search.prepare(
        built, site, PROFILE, SHAPE, 4, machine, memory_limit=limit
    )
    chosen = [layout_search.layout_of(site, c) for c in kept.candidates]
    assert chosen and all(x.dp == "fsdp" or x.pp == 2 for x in chosen)
    assert Layout(dp="fsdp") in chosen and Layout(dp="replicate") not in chosen
    assert len(set(chosen)) == len(chosen)  # microbatches 2, 4, 8 with pp=1: one layout
    reasons = [why for _, why in kept.excluded]
    assert any(why.startswith("the same layout as") for why in reasons)
    assert any("per rank, over" in why for why in reasons)
    assert any("n_head = 6 is not divisible by tp=4" in why for why in reasons)
    times = [predictions[database.canonical(c)].step.total for c in kept.candidates]
    assert times == sorted(times)


def test_autotune_rejects_a_bad_memory_limit(capsys):
    from macrogen.cli import main

    assert main(["autotune", "x.py", "--entry", ":b", "--memory-per-rank", "lots"]) == 2
    assert "--memory-per-rank 'lots': expected a size" in capsys.readouterr().err


def test_recompute_is_part_of_a_layout_and_trades_memory_for_a_forward():
    rc = Layout(tp=2, dp="fsdp", recompute=1)
    assert rc.name() == "tp2 pp1 fsdp mb1 recompute" and layouts.parse(rc.name()) == rc
    assert rc.describe(4) == "tp2 x dp2 (fsdp) + recompute"
    assert layouts.from_arguments({"recompute": "blocks"}) == Layout(recompute=1)
    assert layouts.from_arguments({"recompute": "some"}) is None
    assert layouts.infeasible(Layout(recompute=1), 1, ModelShape(blocks=0)) == (
        "no repeated blocks to recompute"
    )
    # all 400 activation bytes are the 8 blocks': one block's (50) stays, plus 8 inputs of 10
    measured = dataclasses.replace(PROFILE, block_activations=1.0, message_bytes=10)
    kept = memory.predict(measured, Layout(recompute=1), 1)
    assert kept.activations == pytest.approx(400 / 8 + 8 * 10)
    machine = cost.Machine(1, cost.GLOO_LOCAL, cost.GLOO_LOCAL)
    plain = cost.predict(PROFILE, Layout(), 1, machine).compute
    # the blocks' 0.8 s of forward and backward gain one forward (a third)
    assert cost.predict(PROFILE, Layout(recompute=1), 1, machine).compute == pytest.approx(
        plain + 0.8 / 3
    )


def test_cpu_ranks_compute_at_one_thread_and_share_the_cores(monkeypatch):
    from macrogen.autotune import layout_search

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(layout_search.os, "cpu_count", lambda: 2)
    one, four = layout_search.machine_for("cpu", 1), layout_search.machine_for("cpu", 4)
    assert (one.one_thread, one.slowdown) == (False, 1.0)
    assert (four.one_thread, four.slowdown) == (True, 2.0)
    # a rank's share of the batch is scaled from the serial step at one thread
    timed = dataclasses.replace(PROFILE, step_one_thread_s=1.5)
    assert cost.predict(timed, Layout(), 4, four).compute == pytest.approx(1.5 / 4 * 2)
    assert cost.predict(timed, Layout(), 1, one).compute == pytest.approx(1.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert layout_search.machine_for("cpu", 4).slowdown == 4.0
