"""@tensor_parallel on 2 gloo ranks: the expanded modules compute what the serial ones do.

One spawned run checks every block (spawning costs more than the checks):
forward output, input gradient and gathered parameter gradients against the
unexpanded module (fp32, rtol 1e-5), collectives per pass, checkpoints both
ways, and the outputs of torch's own ``parallelize_module`` on the same weights.
The ranks return each check's figures (worst errors as multiples of the tolerance,
counts, shapes, messages); a test per block and aspect asserts them. One 4-rank
run trains the GPT example data x tensor parallel, with a test per figure.
"""

from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import pytest
import torch

from macrogen.runtime.parallelize.local import LOCAL
from tests.dist_checks import assert_within, dict_closeness, each_rank, run_check, tensor_closeness
from tests.distributed import run_ranks
from tests.helpers import expand, load_module

MODELS = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import macrogen as mg


    @mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"})
    class MLP(nn.Module):
        def __init__(self, d_model):
            super().__init__()
            self.fc = nn.Linear(d_model, 4 * d_model)
            self.proj = nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            return self.proj(F.gelu(self.fc(x)))


    @mg.tensor_parallel(
        plan={"qkv": "colwise", "proj": "rowwise", "n_head": "divide", "ln": "replicate"}
    )
    class Attention(nn.Module):
        def __init__(self, d_model, n_head):
            super().__init__()
            self.n_head = n_head
            self.head_dim = d_model // n_head
            self.ln = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)

        def forward(self, x):
            B, T, _ = x.shape
            # head-major fused qkv: a colwise shard holds whole heads
            qkv = self.qkv(self.ln(x)).view(B, T, self.n_head, 3 * self.head_dim)
            q, k, v = qkv.transpose(1, 2).split(self.head_dim, dim=-1)  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
            return x + self.proj(y)


    @mg.tensor_parallel(plan={"qkv": ("colwise", 3), "proj": "rowwise", "n_head": "divide"})
    class PackedAttention(nn.Module):
        def __init__(self, d_model, n_head):
            super().__init__()
            self.n_head = n_head
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # q | k | v packed: each (B, T, local C)
            hs = q.shape[-1] // self.n_head
            q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, T, -1))


    @mg.tensor_parallel(plan={"wte": "vocab", "head": "rowwise"})
    class LMRowwiseHead(nn.Module):
        def __init__(self, vocab, d_model):
            super().__init__()
            self.wte = nn.Embedding(vocab, d_model)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, ids):
            return self.head(torch.tanh(self.wte(ids)))


    @mg.tensor_parallel(plan={"wte": "vocab", "head": "colwise"})
    class LMColwiseHead(nn.Module):
        def __init__(self, vocab, d_model):
            super().__init__()
            self.wte = nn.Embedding(vocab, d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)

        def forward(self, ids):
            return self.head(torch.tanh(self.wte(ids)))  # returned logits: gathered (Replicate)


    class Inner(nn.Module):
        def __init__(self, d_model):
            super().__init__()
            self.up = nn.Linear(d_model, 2 * d_model)
            self.down = nn.Linear(2 * d_model, d_model)


    @mg.tensor_parallel(plan={"inner.up": "colwise", "inner.down": "rowwise"})
    class Dotted(nn.Module):
        def __init__(self, d_model):
            super().__init__()
            self.inner = Inner(d_model)

        def forward(self, x):
            return self.inner.down(torch.relu(self.inner.up(x)))


    @mg.tensor_parallel(
        plan={
            "blocks.*.up": "colwise",
            "blocks.*.down": "rowwise",
            "seq.0": "colwise",
            "seq.2": "rowwise",
            "named.mlp.up": "colwise",
            "named.mlp.down": "rowwise",
        }
    )
    class Containers(nn.Module):
        # plan paths through ModuleList (with *), Sequential and ModuleDict, as torch's plans

        def __init__(self, d_model):
            super().__init__()
            self.blocks = nn.ModuleList([Inner(d_model) for _ in range(2)])
            self.seq = nn.Sequential(
                nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Linear(2 * d_model, d_model)
            )
            self.named = nn.ModuleDict({"mlp": Inner(d_model)})

        def forward(self, x):
            for b in self.blocks:
                x = b.down(torch.relu(b.up(x)))
            x = self.seq(x)
            m = self.named["mlp"]
            return m.down(torch.relu(m.up(x)))


    class Tied(nn.Module):
        def __init__(self, vocab, d_model):
            super().__init__()
            self.wte = nn.Embedding(vocab, d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.wte(ids)))


    @mg.tensor_parallel(plan={"wte": "vocab", "head": "colwise"})
    class TiedLM(Tied):
        # vocab rows and colwise rows are one shard, shared; the logits it returns gathered
        def forward(self, ids):
            return self.head(torch.tanh(self.wte(ids)))


    @mg.tensor_parallel(plan={"wte": "vocab", "head": "rowwise"})
    class TiedRowwise(Tied):
        pass


    @mg.tensor_parallel(plan={"head": "colwise"})
    class TiedHalfPlanned(Tied):
        pass
    """
)

D_MODEL, N_HEAD, VOCAB = 16, 4, 24
TOL = dict(rtol=1e-5, atol=1e-6)
DEFAULT_TOL = dict(rtol=1.3e-6, atol=1e-5)  # torch.testing.assert_close's own, for float32


def _modules(tmp: str):
    serial = load_module(MODELS, "tp_models_serial", Path(tmp))
    parallel = load_module(expand(MODELS), "tp_models_parallel", Path(tmp))
    return serial, parallel


class _CountCollectives:
    """Counts all_reduce / all_gather calls made by the tensor-parallel collectives."""

    def __init__(self):
        from macrogen.runtime import collectives, collectives_linear, collectives_sequence

        self.modules = (collectives, collectives_linear, collectives_sequence)
        self.counts = {"all_reduce": 0, "all_gather": 0}

    def __enter__(self):
        import torch.distributed as real

        class _Counting:
            def __getattr__(_, name):
                attr = getattr(real, name)
                if name in self.counts:

                    def counted(*args, **kwargs):
                        self.counts[name] += 1
                        return attr(*args, **kwargs)

                    return counted
                return attr

        for module in self.modules:
            module.dist = _Counting()
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for module in self.modules:
            module.dist = dist

    def take(self):
        out, self.counts = dict(self.counts), {k: 0 for k in self.counts}
        return out


def _check_block(make_serial, make_parallel, inputs, rank, world, gather_output=False):
    """The block's figures against the unexpanded module, and (serial, its output) for more."""
    from macrogen.runtime.tensor_parallel import full_gradients

    torch.manual_seed(0)
    serial = make_serial()
    torch.manual_seed(0)
    parallel = make_parallel()
    x_s = inputs.clone().requires_grad_(inputs.is_floating_point())
    x_p = inputs.clone().requires_grad_(inputs.is_floating_point())
    out_s = serial(x_s)
    seed = torch.Generator().manual_seed(1)
    weight = torch.randn(out_s.shape, generator=seed)  # a loss with a non-trivial gradient
    (out_s * weight).sum().backward()

    with _CountCollectives() as comm:
        out_p = parallel(x_p)
        forward = comm.take()
        if gather_output:  # each rank holds its slice of the last dim; the loss sums over ranks
            mine = weight.chunk(world, dim=-1)[rank]
            (out_p * mine).sum().backward()
            out_p = torch.cat(_all_gather(out_p.detach(), world), dim=-1)
        else:
            (out_p * weight).sum().backward()
        backward = comm.take()

    report = {
        "forward output": tensor_closeness(out_p, out_s, **TOL),
        "input gradient": (
            tensor_closeness(x_p.grad, x_s.grad, **TOL) if x_s.requires_grad else None
        ),
        "gradients": dict_closeness(
            full_gradients(parallel), {k: p.grad for k, p in serial.named_parameters()}, **TOL
        ),
        "collectives": (forward, backward),
    }
    # checkpoints: gathered = serial (keys, order, shapes, values); loading one shards it
    full = parallel.full_state_dict()
    report["state dict keys"] = (list(full), list(serial.state_dict()))
    report["full_state_dict"] = dict_closeness(full, serial.state_dict(), **DEFAULT_TOL)
    torch.manual_seed(123)  # a different initialization, overwritten by the checkpoint
    fresh = make_parallel()
    fresh.load_full_state_dict(serial.state_dict())
    again = fresh(inputs)
    if gather_output:
        again = torch.cat(_all_gather(again.detach(), world), dim=-1)
    report["loaded checkpoint"] = tensor_closeness(again, out_s.detach(), **TOL)
    return report, serial, out_s.detach()


def _all_gather(t, world):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return parts


def _torch_tp(serial, plan, world):
    """torch's own tensor parallelism (DTensor) on a copy of the serial module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    mesh = init_device_mesh("cpu", (world,))
    module = copy.deepcopy(serial)
    return parallelize_module(module, mesh, {k: styles[v]() for k, v in plan.items()})


# Each block checked: (its name in MODELS, constructor arguments, input: "x" or "ids", whether
# the output is gathered for the comparison); one test per block and aspect.
BLOCKS = {
    "MLP": ("MLP", ("d",), "x", False),
    "Attention": ("Attention", ("d", "heads"), "x", False),
    "PackedAttention": ("PackedAttention", ("d", "heads"), "x", False),
    "LMRowwiseHead": ("LMRowwiseHead", ("vocab", "d"), "ids", False),
    "LMColwiseHead": ("LMColwiseHead", ("vocab", "d"), "ids", False),
    "Dotted": ("Dotted", ("d",), "x", False),
    "Containers": ("Containers", ("d",), "x", False),
    "TiedLM": ("TiedLM", ("vocab", "d"), "ids", False),
    # big rowwise outputs are reduced in row chunks, each while the next is computed;
    # without overlap, every collective runs alone
    "MLP chunked": ("MLP", ("d",), "x", False),
    "MLP without overlap": ("MLP", ("d",), "x", False),
    "PackedAttention without overlap": ("PackedAttention", ("d", "heads"), "x", False),
}
# collectives_linear.CHUNK_ELEMENTS / OVERLAP while the block runs
SETTINGS = {
    "MLP chunked": (1, True),
    "MLP without overlap": (1, False),
    "PackedAttention without overlap": (1, False),
}
# torch's parallelize_module on the same weights: its plan
TORCH_PLANS = {
    "MLP": {"fc": "colwise", "proj": "rowwise"},
    "Attention": {"qkv": "colwise", "proj": "rowwise"},
}


def _block(S, P, name, x, ids, rank, world):
    from macrogen.runtime import collectives_linear

    cls, arg_names, input_name, gather_output = BLOCKS[name]
    args = tuple({"d": D_MODEL, "heads": N_HEAD, "vocab": VOCAB}[a] for a in arg_names)
    saved = collectives_linear.CHUNK_ELEMENTS, collectives_linear.OVERLAP
    collectives_linear.CHUNK_ELEMENTS, collectives_linear.OVERLAP = SETTINGS.get(name, saved)
    try:
        report, serial, out = _check_block(
            lambda: getattr(S, cls)(*args),
            lambda: getattr(P, cls)(*args),
            {"x": x, "ids": ids}[input_name],
            rank,
            world,
            gather_output=gather_output,
        )
    finally:
        collectives_linear.CHUNK_ELEMENTS, collectives_linear.OVERLAP = saved
    if name in TORCH_PLANS:
        ref = _torch_tp(serial, TORCH_PLANS[name], world)
        if name == "Attention":
            ref.n_head = N_HEAD // world  # torch leaves the head count to the user
        report["torch parallelize_module"] = tensor_closeness(ref(x), out, **TOL)
    return report


def _cross_entropy(rank, world, reduction):
    """vocab-parallel cross-entropy from this rank's logit columns against the serial loss."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from macrogen.runtime.collectives import vocab_parallel_cross_entropy

    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    target = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(8))
    target[::5] = -1
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, target, ignore_index=-1, reduction=reduction)
    want.sum().backward()
    mine = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
    with _CountCollectives() as comm:
        got = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, -1, reduction)
        got.sum().backward()
        counts = comm.take()
    return {
        "loss": tensor_closeness(got, want, **TOL),
        "gradient": tensor_closeness(mine.grad, full.grad.chunk(world, dim=-1)[rank], **TOL),
        "collectives": counts,
    }


def _mlp_shards(P, x, world):
    """Parameters are DTensors of the serial shape (local shards), under the serial names."""
    from torch.distributed.tensor import DTensor

    mlp = P.MLP(D_MODEL)
    twin = copy.deepcopy(mlp)  # an EMA copy: same group, own tensors
    out = mlp(x)
    with torch.no_grad():  # the copy runs on its own parameters
        twin.fc.bias.to_local().add_(1.0)
    return {
        "shapes": {k: tuple(v.shape) for k, v in mlp.state_dict().items()},
        "local shapes": {k: tuple(v.to_local().shape) for k, v in mlp.state_dict().items()},
        "fc.weight type": type(mlp.fc.weight).__name__,
        "DTensor parameters": all(isinstance(p, DTensor) for p in mlp.parameters()),
        # a rowwise layer with one reduction is torch's linear + bias add: no Python autograd node
        "output grad_fn": type(out.grad_fn).__name__,
        "copy shares the group": twin.tp_group is mlp.tp_group,
        "copy has its own tensors": twin.fc.weight is not mlp.fc.weight,
        "copy's output": tensor_closeness(twin(x), out, **DEFAULT_TOL),
        "original unchanged": tensor_closeness(mlp(x), out, **DEFAULT_TOL),
        "Attention.n_head": P.Attention(D_MODEL, N_HEAD).n_head,
    }


def _construction_error(build, exception=ValueError) -> str:
    try:
        build()
    except exception as e:
        return str(e).split(" (raised on rank")[0]
    return "no error"


def _two_rank_checks(rank, world, tmp):
    """Every check's figures (or its error), by name: one spawn for them all."""
    os.environ["MACROGEN_TP_SIZE"] = str(world)  # the launch asks for 2-way tensor parallelism
    S, P = _modules(tmp)
    torch.manual_seed(42)
    x = torch.randn(2, 6, D_MODEL)
    ids = torch.randint(0, VOCAB, (2, 6))
    report: dict = {}
    for name in BLOCKS:
        run_check(report, name, lambda name=name: _block(S, P, name, x, ids, rank, world))

    def tied():
        model = P.TiedLM(VOCAB, D_MODEL)
        return model.head.weight is model.wte.weight, len(list(model.parameters()))

    run_check(report, "TiedLM parameters", tied)
    for reduction in REDUCTIONS:
        run_check(
            report,
            f"cross_entropy {reduction}",
            lambda reduction=reduction: _cross_entropy(rank, world, reduction),
        )
    run_check(report, "MLP shards", lambda: _mlp_shards(P, x, world))
    # dimensions the degree does not divide, ties a plan can't keep: a clear error at construction
    builds = {
        "indivisible vocab": lambda: P.LMRowwiseHead(25, D_MODEL),
        "indivisible heads": lambda: P.Attention(D_MODEL, 3),
        "tie split differently": lambda: P.TiedRowwise(VOCAB, D_MODEL),
        "tie half planned": lambda: P.TiedHalfPlanned(VOCAB, D_MODEL),
    }
    for name, build in builds.items():
        run_check(report, name, lambda build=build: _construction_error(build))
    # a divided attribute that differs between ranks (same parameter shapes): refused on all ranks
    run_check(
        report,
        "divided attribute differs between ranks",
        lambda: _construction_error(
            lambda: P.Attention(D_MODEL, N_HEAD * (1 + rank)), RuntimeError
        ),
    )
    return report


REDUCTIONS = ("mean", "sum", "none")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tensor_parallel")
    return run_ranks(_two_rank_checks, 2, args=(str(out),), timeout=150)


@pytest.mark.parametrize("name", BLOCKS)
def test_block_forward_and_input_gradient_match_serial(two_ranks, name):
    for rank, r in enumerate(each_rank(two_ranks, name)):
        assert_within(r["forward output"], f"{name}, rank {rank}: forward output")
        if r["input gradient"] is not None:
            assert_within(r["input gradient"], f"{name}, rank {rank}: input gradient")


@pytest.mark.parametrize("name", BLOCKS)
def test_block_parameter_gradients_match_serial(two_ranks, name):
    for rank, r in enumerate(each_rank(two_ranks, name)):
        assert_within(r["gradients"], f"{name}, rank {rank}: gathered parameter gradient")


@pytest.mark.parametrize("name", BLOCKS)
def test_block_checkpoint_gathers_and_loads(two_ranks, name):
    for rank, r in enumerate(each_rank(two_ranks, name)):
        keys, serial_keys = r["state dict keys"]
        assert keys == serial_keys, f"{name}, rank {rank}: state dict keys"
        assert_within(r["full_state_dict"], f"{name}, rank {rank}: full_state_dict")
        assert_within(r["loaded checkpoint"], f"{name}, rank {rank}: loaded checkpoint's output")


# colwise feeding rowwise: nothing in between; one all-reduce forward (g, after the
# rowwise matmul) and one backward (f: the colwise input gradient, beside the weight gradient)
_PAIR = ({"all_reduce": 1, "all_gather": 0}, {"all_reduce": 1, "all_gather": 0})
_ONE_EACH = {"all_reduce": 1, "all_gather": 0}
COLLECTIVES = {
    "MLP": _PAIR,
    "Attention": _PAIR,
    "PackedAttention": _PAIR,
    "Dotted": _PAIR,
    # big outputs: 4 row chunks, each reduced while the next is computed
    "MLP chunked": ({"all_reduce": 4, "all_gather": 0}, _PAIR[1]),
    "MLP without overlap": _PAIR,
    # vocab (one all-reduce) then a rowwise head on a full input (its slice forward; backward
    # all-gathers the input gradient)
    "LMRowwiseHead": ({"all_reduce": 2, "all_gather": 0}, {"all_reduce": 0, "all_gather": 1}),
    # vocab (one all-reduce forward), colwise head (one all-reduce backward); forward returns
    # the head's output, so it is gathered (one all-gather forward, none backward)
    "LMColwiseHead": ({"all_reduce": 1, "all_gather": 1}, _ONE_EACH),
    "Containers": ({"all_reduce": 4, "all_gather": 0}, {"all_reduce": 4, "all_gather": 0}),
    "TiedLM": ({"all_reduce": 1, "all_gather": 1}, _ONE_EACH),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_block_collectives_per_pass(two_ranks, name):
    """(forward, backward) collective calls, as counted on rank 0."""
    assert each_rank(two_ranks, name)[0]["collectives"] == COLLECTIVES[name]


@pytest.mark.parametrize("name", TORCH_PLANS)
def test_block_matches_torch_parallelize_module(two_ranks, name):
    for rank, r in enumerate(each_rank(two_ranks, name)):
        assert_within(r["torch parallelize_module"], f"{name}, rank {rank}: torch's output")


def test_tied_lm_keeps_one_shared_parameter(two_ranks):
    for rank, (shared, count) in enumerate(each_rank(two_ranks, "TiedLM parameters")):
        assert shared and count == 1, f"rank {rank}: head.weight is wte.weight {shared}, {count}"


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_vocab_parallel_cross_entropy_matches_serial(two_ranks, reduction):
    name = f"cross_entropy {reduction}"
    for rank, r in enumerate(each_rank(two_ranks, name)):
        assert_within(r["loss"], f"{name}, rank {rank}: loss")
        assert_within(r["gradient"], f"{name}, rank {rank}: logits' gradient")


def test_vocab_parallel_cross_entropy_collectives(two_ranks):
    # the row maxima, then the sums of exp and of the target logits together; nothing backward
    counts = each_rank(two_ranks, "cross_entropy mean")[0]["collectives"]
    assert counts == {"all_reduce": 2, "all_gather": 0}


def test_parameters_are_dtensors_of_the_serial_shape_holding_local_shards(two_ranks):
    world = len(two_ranks)
    for rank, r in enumerate(each_rank(two_ranks, "MLP shards")):
        assert r["shapes"] == {
            "fc.weight": (4 * D_MODEL, D_MODEL),
            "fc.bias": (4 * D_MODEL,),
            "proj.weight": (D_MODEL, 4 * D_MODEL),
            "proj.bias": (D_MODEL,),
        }, (rank, r["shapes"])
        assert r["local shapes"] == {
            "fc.weight": (4 * D_MODEL // world, D_MODEL),
            "fc.bias": (4 * D_MODEL // world,),
            "proj.weight": (D_MODEL, 4 * D_MODEL // world),
            "proj.bias": (D_MODEL,),
        }, (rank, r["local shapes"])
        assert r["DTensor parameters"], (rank, r["fc.weight type"])
        assert r["Attention.n_head"] == N_HEAD // world, rank


def test_rowwise_with_one_reduction_has_no_python_autograd_node(two_ranks):
    for rank, r in enumerate(each_rank(two_ranks, "MLP shards")):
        assert r["output grad_fn"] == "AddBackward0", (rank, r["output grad_fn"])


def test_deepcopy_shares_the_group_with_its_own_tensors(two_ranks):
    for rank, r in enumerate(each_rank(two_ranks, "MLP shards")):
        assert r["copy shares the group"] and r["copy has its own tensors"], rank
        # the copy's fc bias moved by 1: its output differs, the original's does not
        assert r["copy's output"] > 1, (rank, r["copy's output"])
        assert_within(r["original unchanged"], f"rank {rank}: the original's output")


CONSTRUCTION_ERRORS = {
    "indivisible vocab": "wte: 25 rows are not divisible by tp=2",
    "indivisible heads": "n_head = 3 is not divisible by tp=2",
    "tie split differently": "head.weight is tied to wte.weight, and the plan cuts them"
    " differently (dim 1 and dim 0): plan both with the same split or untie them\nwte.weight is"
    " tied to head.weight, and the plan cuts them differently (dim 0 and dim 1): plan both with"
    " the same split or untie them",
    "tie half planned": "head.weight is tied to wte.weight, which the plan leaves whole: plan"
    " both with the same split (a vocab embedding and a colwise head share rows) or untie them",
    "divided attribute differs between ranks": "data_parallel at Attention (@tensor_parallel):"
    " rank 1 built a different model than rank 0: parameter 8 is n_head: 'divide' = 4 on rank"
    " 0 but n_head: 'divide' = 8 on rank 1",
}


@pytest.mark.parametrize("name", CONSTRUCTION_ERRORS)
def test_construction_error_is_clear(two_ranks, name):
    """Checked on rank 0, as before."""
    assert each_rank(two_ranks, name)[0] == CONSTRUCTION_ERRORS[name]


# -- DP x TP: the GPT example on 4 ranks (2 data x 2 tensor) ----------------------------

GPT_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
GPT_CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
GLOBAL_BATCH, STEPS = 8, 3


def _optimizer(model):
    # SGD with momentum, not Adam: the key bias of attention has a gradient that is zero
    # up to rounding (softmax ignores a constant added to every score), and Adam's
    # division by sqrt(v) would turn that rounding noise into steps of size lr.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _dp_tp_training(rank, world, source, tmp):
    from macrogen.expand import expand_source
    from macrogen.runtime.mesh import mesh
    from macrogen.runtime.tensor_parallel import full_gradients, full_state_dict

    os.environ["MACROGEN_TP_SIZE"] = "2"
    tmp = Path(tmp) / f"rank{rank}"
    tmp.mkdir()
    S = load_module(source, "gpt_serial", tmp)
    P = load_module(expand_source(source, path="gpt.py").code, "gpt_dp_tp", tmp)
    idx, targets = S.batch(S.GPTConfig(**GPT_CONFIG), GLOBAL_BATCH, seed=1)

    # the serial reference: one process, the whole batch
    torch.manual_seed(0)
    serial = S.GPT(S.GPTConfig(**GPT_CONFIG))
    initial = copy.deepcopy(serial.state_dict())
    optimizer = _optimizer(serial)
    serial_losses, serial_grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = serial(idx, targets)
        loss.backward()
        serial_grads = serial_grads or {k: p.grad.clone() for k, p in serial.named_parameters()}
        optimizer.step()
        serial_losses.append(loss.item())

    # DP x TP: each data rank trains on its share; its two tensor ranks split the layers
    torch.manual_seed(0)
    model = P.GPT(P.GPTConfig(**GPT_CONFIG))
    m = mesh()
    report = {
        "mesh": (m.data_size, m.tensor_size, m.data_rank),
        "qkv shard shape": tuple(model.blocks[0].attn.qkv.weight.to_local().shape),
        # under data parallel each block swaps its own shards: its gradients reach the buckets
        # as its backward ends (the whole model's swap would hand them over at the very end)
        "blocks swap their own": all(LOCAL in b.__dict__ for b in model.blocks),
        # shards cut from the serial initialization
        "initial": dict_closeness(full_state_dict(model), initial, rtol=0, atol=0),
    }
    share = GLOBAL_BATCH // m.data_size
    rows = slice(m.data_rank * share, (m.data_rank + 1) * share)
    optimizer = _optimizer(model)
    losses, grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(idx[rows], targets[rows])
        loss.backward()
        grads = grads or full_gradients(model)
        optimizer.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # tensor ranks agree; the mean over data ranks
        losses.append(total.item() / world)

    full = full_state_dict(model)
    report.update(
        {
            "losses": losses,
            "losses vs serial": tensor_closeness(
                torch.tensor(losses), torch.tensor(serial_losses), rtol=1e-5, atol=0
            ),
            "first-step gradients": dict_closeness(grads, serial_grads, **TOL),
            "state dict keys": (list(full), list(serial.state_dict())),
            "after steps": dict_closeness(full, serial.state_dict(), **TOL),
        }
    )
    return report


def _dp_tp_report(rank, world, source, tmp):
    report: dict = {}
    run_check(report, "gpt", lambda: _dp_tp_training(rank, world, source, tmp))
    return report


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_tp")
    source = GPT_EXAMPLE.read_text()
    return each_rank(run_ranks(_dp_tp_report, 4, args=(source, str(out)), timeout=240), "gpt")


def test_gpt_data_x_tensor_mesh_and_shard_shapes(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert r["mesh"] == (2, 2, rank // 2), (rank, r["mesh"])
        assert r["qkv shard shape"] == (3 * 32 // 2, 32), (rank, r["qkv shard shape"])


def test_gpt_data_x_tensor_blocks_swap_their_own_shards(four_ranks):
    assert all(r["blocks swap their own"] for r in four_ranks)


def test_gpt_data_x_tensor_initial_shards_are_the_serial_initialization(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert_within(r["initial"], f"rank {rank}: initial (exactly)")


def test_gpt_data_x_tensor_losses_match_serial(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert_within(r["losses vs serial"], f"rank {rank}: losses {r['losses']}")


def test_gpt_data_x_tensor_first_step_gradients_match_serial(four_ranks):
    for rank, r in enumerate(four_ranks):
        assert_within(r["first-step gradients"], f"rank {rank}: first-step gradient")


def test_gpt_data_x_tensor_parameters_after_steps_match_serial(four_ranks):
    for rank, r in enumerate(four_ranks):
        keys, serial_keys = r["state dict keys"]
        assert keys == serial_keys, f"rank {rank}: state dict keys"
        assert_within(r["after steps"], f"rank {rank}: after {STEPS} steps")


def test_gpt_data_x_tensor_losses_agree_across_ranks(four_ranks):
    losses = [r["losses"] for r in four_ranks]
    assert losses[0] == losses[1] == losses[2] == losses[3]
