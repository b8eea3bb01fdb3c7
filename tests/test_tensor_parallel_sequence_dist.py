"""Sequence parallelism (Megatron-SP) on a nanoGPT-shaped block, on 2 gloo ranks.

Between the tensor-parallel halves of a block (the layer norms, dropout and
residual adds) each rank holds its slice of the sequence, ``(B, T / 2, C)``:
the block's input arrives sliced, ``"from sequence"`` gathers the attention's
input on entry (its ``forward`` reads ``B, T, C = x.size()`` unedited),
``"colwise from sequence"`` gathers inside the MLP's first layer, and
``"rowwise to sequence"`` reduce-scatters both output projections.

Checked: forward, input gradient and parameters after 3 AdamW steps equal the
serial (unexpanded) block (1e-3) and torch's ``SequenceParallel`` +
``ColwiseParallel``/``RowwiseParallel`` on the same weights (tightly); the
activations the layer norms save (their input, the residual stream, and its
statistics) are 1 / 2 of serial per rank; a sequence length the size doesn't
divide is a clear error. One spawn per world size (2, and 4 for DP x TP): the ranks
return each check's figures (worst errors as multiples of the tolerance, counts, shapes),
and a test per figure asserts them.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

from tests.dist_checks import assert_within, dict_closeness, each_rank, run_check, tensor_closeness
from tests.distributed import run_ranks
from tests.helpers import expand, load_module

# A nanoGPT-shaped block (nanoGPT's own LayerNorm, the unedited attention forward): the
# golden file's input, so the pinned expansion is the one whose numbers are checked here.
SOURCE = (Path(__file__).parent / "golden" / "tensor_parallel_sequence" / "input.py").read_text()

SHAPE = (2, 16, 32)  # batch, sequence, width
STEPS, LR = 3, 1e-3
SERIAL_TOL = dict(rtol=1e-3, atol=1e-5)
TIGHT = dict(rtol=1e-5, atol=1e-6)
# after Adam: an element whose gradient is rounding-level moves by up to lr a step either way
AFTER_ADAM = dict(rtol=1e-5, atol=1e-2 * LR)


# DP x TP: the same block, data-parallel over the tensor groups (its gradient hooks,
# summing over the tensor group, run before data parallelism's average)
DATA_PARALLEL = """

@mg.data_parallel()
class DataParallelBlock(Block):
    pass
"""


def _load(tmp: Path, rank: int, source: str = SOURCE):
    tmp = tmp / f"rank{rank}"
    tmp.mkdir(exist_ok=True)
    serial = load_module(source, f"sp_serial_{rank}", tmp)
    parallel = load_module(expand(source), f"sp_parallel_{rank}", tmp)
    return serial, parallel


def layer_norm_saved_bytes(out: torch.Tensor) -> int:
    """Bytes autograd keeps for the layer norms' backward (their input, the residual stream,
    and its mean and rstd), found by walking the graph from ``out``."""
    total, seen, todo = 0, set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "NativeLayerNormBackward0":
            for name in ("_saved_input", "_saved_result1", "_saved_result2"):
                t = getattr(node, name)
                total += t.numel() * t.element_size()
        todo.extend(n for n, _ in node.next_functions)
    return total


def _train(model, x, w):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    for _ in range(STEPS):
        optimizer.zero_grad()
        (model(x) * w).sum().backward()
        optimizer.step()


def _sequence_parity(rank, world, tmp):
    """Every check's figures (or its error), by name: one spawn for them all."""
    from macrogen.runtime.tensor_parallel import full_gradients, full_state_dict

    os.environ["MACROGEN_TP_SIZE"] = str(world)
    report: dict = {}
    S, P = _load(Path(tmp), rank)
    torch.manual_seed(0)
    serial = S.Block(S.Config())
    initial = copy.deepcopy(serial)
    torch.manual_seed(0)
    ours = P.Block(P.Config())
    ours = copy.deepcopy(ours)  # a copy sums its replicated gradients too (the hooks are kept)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    mine = slice(rank * SHAPE[1] // world, (rank + 1) * SHAPE[1] // world)  # my tokens

    x_s, x_p, x_t = (
        x.clone().requires_grad_(),
        x[:, mine].clone().requires_grad_(),
        x[:, mine].clone().requires_grad_(),
    )
    out_s = serial(x_s)
    (out_s * w).sum().backward()
    out_p = ours(x_p)
    report["output shape"] = tuple(out_p.shape)
    (out_p * w[:, mine]).sum().backward()  # the ranks' losses add up to the serial one
    report["forward vs serial"] = tensor_closeness(out_p, out_s[:, mine], **TIGHT)
    report["input gradient vs serial"] = tensor_closeness(x_p.grad, x_s.grad[:, mine], **TIGHT)

    # activation memory of the sequence-parallel regions: 1 / tp of serial on each rank
    report["memory"] = (
        layer_norm_saved_bytes(initial(x)),
        layer_norm_saved_bytes(ours(x[:, mine])),
    )

    theirs = _torch_sequence_parallel(P, initial, world)
    out_t = theirs(x_t)
    (out_t * w[:, mine]).sum().backward()
    report["forward vs torch"] = tensor_closeness(out_p, out_t, **TIGHT)
    report["input gradient vs torch"] = tensor_closeness(x_p.grad, x_t.grad, **TIGHT)
    # parameter gradients (the layer norms' summed over the ranks' tokens)
    grads = full_gradients(ours)
    serial_grads = {k: p.grad for k, p in serial.named_parameters()}
    torch_grads = _full(theirs, world, grad=True)
    report["gradients vs serial"] = dict_closeness(grads, serial_grads, **TIGHT)
    report["gradients vs torch"] = dict_closeness(
        grads, {k: torch_grads[k] for k in serial_grads}, **TIGHT
    )

    run_check(
        report, "collectives", lambda: _collectives_of_a_pass(ours, x[:, mine], w[:, mine], grads)
    )
    run_check(report, "nested", lambda: _nested_sequence_modules(x, w, mine))

    # 3 AdamW steps from the same weights
    reference = copy.deepcopy(initial)
    _train(reference, x, w)
    ours.zero_grad()
    theirs.zero_grad()
    _train(ours, x[:, mine], w[:, mine])
    _train(theirs, x[:, mine], w[:, mine])
    got, want, torch_state = full_state_dict(ours), reference.state_dict(), _full(theirs, world)
    report["after AdamW vs serial"] = dict_closeness(got, want, **SERIAL_TOL)
    report["after AdamW vs torch"] = dict_closeness(
        got, {k: torch_state[k] for k in want}, **AFTER_ADAM
    )
    run_check(report, "indivisible", lambda: _indivisible(world))
    return report


def _collectives_of_a_pass(ours, x, w, grads):
    """On gloo a reduce-scatter along T runs as an all-reduce keeping this rank's slice (gloo's
    own costs more): counted here, and equal, bit for bit, to the reduce-scatter path (other
    backends'). Each layer norm's weight and bias gradients are summed in one all-reduce."""
    import torch.distributed as dist

    from macrogen.runtime import collectives_sequence
    from macrogen.runtime.tensor_parallel import full_gradients

    calls = {"all_reduce": 0, "reduce_scatter_single": 0}
    originals = {name: getattr(dist, name) for name in calls}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    results = {}
    try:
        for backends in ({"gloo"}, set()):
            collectives_sequence.REDUCE_SCATTER_BY_ALL_REDUCE = backends
            for name in calls:
                calls[name] = 0
                setattr(dist, name, counting(name))
            ours.zero_grad()
            leaf = x.clone().requires_grad_()
            out = ours(leaf)
            (out * w).sum().backward()
            results[bool(backends)] = (out, leaf.grad, full_gradients(ours), dict(calls))
    finally:
        collectives_sequence.REDUCE_SCATTER_BY_ALL_REDUCE = {"gloo"}
        for name, call in originals.items():
            setattr(dist, name, call)
    (out, grad_x, grads_ar, by_ar), (out_rs, grad_x_rs, grads_rs, by_rs) = (
        results[True],
        results[False],
    )
    exact = dict(rtol=0, atol=0)
    return {
        "by all-reduce": by_ar,
        "by reduce-scatter": by_rs,
        "output": tensor_closeness(out_rs, out, **exact),
        "input gradient": tensor_closeness(grad_x_rs, grad_x, **exact),
        # and the same gradients as the first pass
        "gradients by all-reduce": dict_closeness(grads_ar, grads, **exact),
        "gradients by reduce-scatter": dict_closeness(grads_rs, grads, **exact),
    }


def _nested_sequence_modules(x, w, mine):
    """A "sequence" module inside another: its parameters' gradients are summed once."""
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.mesh import mesh
    from macrogen.runtime.parallelize import apply_tensor_parallel
    from macrogen.runtime.tensor_parallel import full_gradients

    torch.manual_seed(0)
    serial = torch.nn.Sequential(torch.nn.LayerNorm(SHAPE[2]), torch.nn.LayerNorm(SHAPE[2]))
    holder = torch.nn.Sequential(copy.deepcopy(serial))
    plan = {"0": "sequence_slice", "0.1": "sequence_slice"}
    apply_tensor_parallel(holder, mesh(None), plan, where="test")
    (serial(x) * w).sum().backward()
    (holder(x[:, mine]) * w[:, mine]).sum().backward()
    return {
        # put back after the forward
        "DTensor parameters": all(isinstance(q, DTensor) for q in holder.parameters()),
        "gradients": dict_closeness(
            {k.removeprefix("0."): g for k, g in full_gradients(holder).items()},
            {k: p.grad for k, p in serial.named_parameters()},
            **TIGHT,
        ),
    }


def _torch_sequence_parallel(P, serial, world):
    """torch's SequenceParallel + Colwise/Rowwise on the same weights, running the same
    (width-rewritten) forward; the qkv rows permuted so that a contiguous ColwiseParallel
    shard is our [q_r | k_r | v_r]; head counts set by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    block = copy.deepcopy(serial)
    attn = block.attn
    attn.__class__ = P.CausalSelfAttention  # the expansion's forward: widths rewritten
    with torch.no_grad():  # rows [q0 q1 k0 k1 v0 v1] -> [q0 k0 v0 q1 k1 v1]
        t = attn.c_attn.weight
        t.copy_(_to_torch_rows(t, world))
    plan = {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attn.c_attn": ColwiseParallel(),
        "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp.c_fc": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.dropout": SequenceParallel(use_local_output=True),
    }
    block = parallelize_module(block, init_device_mesh("cpu", (world,)), plan)
    attn.n_head //= world  # torch leaves head counts and widths to the user
    attn.n_embd //= world
    attn.tp_size = world
    return block


def _to_torch_rows(t, world):
    blocks = [b.chunk(world) for b in t.chunk(3)]
    return torch.cat([blocks[b][r] for r in range(world) for b in range(3)])


def _full(block, world, grad=False):
    """torch's state dict (or gradients) gathered, c_attn rows back in the serial order."""
    from torch.distributed.tensor import DTensor

    state = {}
    items = (
        ((k, p.grad) for k, p in block.named_parameters()) if grad else block.state_dict().items()
    )
    for key, value in items:
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if "c_attn" in key:  # [q0 k0 v0 q1 k1 v1] -> [q0 q1 k0 k1 v0 v1]
            parts = [p.chunk(3) for p in value.chunk(world)]
            value = torch.cat([parts[r][b] for b in range(3) for r in range(world)])
        state[key] = value
    return state


def _indivisible(world):
    """A whole sequence of 7 tokens reaching a 'rowwise to sequence' layer can't be split in 2."""
    from macrogen.runtime.mesh import mesh
    from macrogen.runtime.parallelize import apply_tensor_parallel

    mlp = torch.nn.Sequential()
    mlp.add_module("c_proj", torch.nn.Linear(8, 4))
    apply_tensor_parallel(mlp, mesh(None), {"c_proj": "rowwise_to_sequence"}, where="test")
    try:
        mlp(torch.randn(2, 7, 8))
    except Exception as e:  # (the first forward's guard names the layer: a PlanError)
        return str(e)
    return "no error"


def _data_x_sequence_parity(rank, world, tmp):
    """DP=2 x TP=2: each data rank trains on its share of the batch, each tensor rank on its
    slice of that share's sequence; forward, input gradient and parameters after 3 AdamW
    steps equal serial, and all four ranks hold the same model."""
    from macrogen.runtime.mesh import mesh
    from macrogen.runtime.tensor_parallel import full_state_dict

    tensor = 2
    os.environ["MACROGEN_TP_SIZE"] = str(tensor)
    S, P = _load(Path(tmp), rank, SOURCE + DATA_PARALLEL)
    torch.manual_seed(0)
    serial = S.Block(S.Config())
    torch.manual_seed(0)
    ours = P.DataParallelBlock(P.Config())
    m = mesh()
    report: dict = {"mesh": (m.data_size, m.tensor_size)}
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    w = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    share = SHAPE[0] // m.data_size
    rows = slice(m.data_rank * share, (m.data_rank + 1) * share)  # my data rank's batch
    t = torch.distributed.get_rank(m.tensor_group)
    mine = slice(t * SHAPE[1] // tensor, (t + 1) * SHAPE[1] // tensor)  # my tokens of it

    # data parallelism averages the data ranks' gradients: serial's loss is their mean
    def serial_loss(model, x):
        return (model(x) * w).sum() / m.data_size

    def our_loss(model, x):
        return (model(x) * w[rows, mine]).sum()

    x_s, x_p = x.clone().requires_grad_(), x[rows, mine].clone().requires_grad_()
    serial_loss(copy.deepcopy(serial), x_s).backward()
    out_p = ours(x_p)
    (out_p * w[rows, mine]).sum().backward()
    report["forward"] = tensor_closeness(out_p, serial(x)[rows, mine], **TIGHT)
    report["input gradient"] = tensor_closeness(
        x_p.grad, m.data_size * x_s.grad[rows, mine], **TIGHT
    )

    for model, loss, data in ((serial, serial_loss, x), (ours, our_loss, x[rows, mine])):
        model.zero_grad()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        for _ in range(STEPS):
            optimizer.zero_grad()
            loss(model, data).backward()
            optimizer.step()
    got = full_state_dict(ours)
    report["after AdamW"] = dict_closeness(got, serial.state_dict(), **SERIAL_TOL)
    report["final"] = got
    return report


def _report(rank, world, check, tmp):
    report: dict = {}
    run_check(report, "parity", lambda: check(rank, world, tmp))
    return report


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence")
    results = run_ranks(_report, 2, args=(_sequence_parity, str(out)), timeout=240)
    return each_rank(results, "parity")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sequence_dp")
    results = run_ranks(_report, 4, args=(_data_x_sequence_parity, str(out)), timeout=240)
    return each_rank(results, "parity")


# (figure, what it compares); one test each
CLOSENESS = {
    "forward vs serial": "the block's output slice against serial's",
    "input gradient vs serial": "the input gradient slice against serial's",
    "forward vs torch": "the output against torch's SequenceParallel",
    "input gradient vs torch": "the input gradient against torch's",
    "gradients vs serial": "gathered parameter gradients against serial's",
    "gradients vs torch": "gathered parameter gradients against torch's",
    "after AdamW vs serial": f"parameters after {STEPS} AdamW steps against serial's",
    "after AdamW vs torch": f"parameters after {STEPS} AdamW steps against torch's",
}


def test_sequence_parallel_output_is_this_ranks_slice(two_ranks):
    world = len(two_ranks)
    for rank, r in enumerate(two_ranks):
        assert r["output shape"] == (SHAPE[0], SHAPE[1] // world, SHAPE[2]), rank


@pytest.mark.parametrize("figure", CLOSENESS)
def test_sequence_parallel_block_matches(two_ranks, figure):
    for rank, r in enumerate(two_ranks):
        assert_within(r[figure], f"rank {rank}: {CLOSENESS[figure]}")


def test_sequence_parallel_layer_norm_activations_halved(two_ranks):
    world = len(two_ranks)
    for rank, r in enumerate(two_ranks):
        serial, mine = r["memory"]
        assert serial == world * mine, (rank, r["memory"])  # the layer norms' saved activations


def test_sequence_parallel_collectives_per_pass(two_ranks):
    for rank, r in enumerate(each_rank(two_ranks, "collectives")):
        # all-reduces: 2 rowwise-to-sequence outputs and 1 colwise-from-sequence input gradient
        # (as reduce-scatters, or not), the attention's colwise input gradient, and 1 for the
        # layer norms' weights and biases together
        assert r["by all-reduce"] == {"all_reduce": 3 + 1 + 1, "reduce_scatter_single": 0}, rank
        assert r["by reduce-scatter"] == {"all_reduce": 1 + 1, "reduce_scatter_single": 3}, rank


def test_reduce_scatter_by_all_reduce_is_bit_identical(two_ranks):
    for rank, r in enumerate(each_rank(two_ranks, "collectives")):
        for figure in ("output", "input gradient"):
            assert_within(r[figure], f"rank {rank}: {figure}, exactly")
        for figure in ("gradients by all-reduce", "gradients by reduce-scatter"):
            assert_within(r[figure], f"rank {rank}: {figure} against the first pass, exactly")


def test_nested_sequence_modules_sum_gradients_once(two_ranks):
    for rank, r in enumerate(each_rank(two_ranks, "nested")):
        assert r["DTensor parameters"], rank
        assert_within(r["gradients"], f"rank {rank}: nested gradients")


def test_indivisible_sequence_is_a_clear_error(two_ranks):
    assert (
        "c_proj: the sequence length (dim 1) 7 is not divisible by the tensor-parallel size 2;"
        " pad the sequence or choose a size that divides it"
    ) in each_rank(two_ranks, "indivisible")[0]


def test_sequence_parallel_under_data_x_tensor_mesh(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert r["mesh"] == (2, 2), (rank, r["mesh"])


@pytest.mark.parametrize("figure", ["forward", "input gradient", "after AdamW"])
def test_sequence_parallel_under_data_x_tensor_matches_serial(four_ranks, figure):
    for rank, r in enumerate(four_ranks):
        assert_within(r[figure], f"rank {rank}: {figure}")


def test_sequence_parallel_under_data_x_tensor_ranks_hold_one_model(four_ranks):
    finals = [r["final"] for r in four_ranks]
    for final in finals[1:]:  # every rank holds the same model
        for key, value in finals[0].items():
            torch.testing.assert_close(final[key], value, rtol=0, atol=0, msg=key)
