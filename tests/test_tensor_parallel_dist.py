"""@tensor_parallel on 2 gloo ranks: the expanded modules compute what the serial ones do.

One spawned run checks every block (spawning costs more than the checks):
forward output, input gradient and gathered parameter gradients against the
unexpanded module (fp32, rtol 1e-5), collectives per pass, checkpoints both
ways, and the outputs of torch's own ``parallelize_module`` on the same weights.
"""

from __future__ import annotations

import copy
import os
import textwrap
from pathlib import Path

import torch

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
        pass  # vocab rows and colwise rows are one shard, shared; logits sharded (the
        # inherited forward is not rewritten: only the decorated class's own is)


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


def _modules(tmp: str):
    serial = load_module(MODELS, "tp_models_serial", Path(tmp))
    parallel = load_module(expand(MODELS), "tp_models_parallel", Path(tmp))
    return serial, parallel


class _CountCollectives:
    """Counts all_reduce / all_gather calls made by the tensor-parallel collectives."""

    def __init__(self):
        import macrogen.runtime.collectives as collectives

        self.module = collectives
        self.counts = {"all_reduce": 0, "all_gather": 0}

    def __enter__(self):
        real = self.module.dist

        class _Counting:
            def __getattr__(_, name):
                attr = getattr(real, name)
                if name in self.counts:

                    def counted(*args, **kwargs):
                        self.counts[name] += 1
                        return attr(*args, **kwargs)

                    return counted
                return attr

        self.module.dist = _Counting()
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        self.module.dist = dist

    def take(self):
        out, self.counts = dict(self.counts), {k: 0 for k in self.counts}
        return out


def _check_block(name, make_serial, make_parallel, inputs, rank, world, gather_output=False):
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

    torch.testing.assert_close(out_p, out_s, **TOL, msg=f"{name}: forward output")
    if x_s.requires_grad:
        torch.testing.assert_close(x_p.grad, x_s.grad, **TOL, msg=f"{name}: input gradient")
    from macrogen.runtime.tensor_parallel import full_gradients

    grads = full_gradients(parallel)
    for key, p in serial.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, **TOL, msg=f"{name}: gradient of {key}")

    # checkpoints: gathered = serial (keys, order, shapes, values); loading one shards it
    full = parallel.full_state_dict()
    assert list(full) == list(serial.state_dict()), f"{name}: state dict keys"
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(full[key], value, msg=f"{name}: full_state_dict[{key}]")
    torch.manual_seed(123)  # a different initialization, overwritten by the checkpoint
    fresh = make_parallel()
    fresh.load_full_state_dict(serial.state_dict())
    again = fresh(inputs)
    if gather_output:
        again = torch.cat(_all_gather(again.detach(), world), dim=-1)
    torch.testing.assert_close(again, out_s.detach(), **TOL, msg=f"{name}: loaded checkpoint")
    return serial, out_s.detach(), forward, backward


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


def _two_rank_checks(rank, world, tmp):
    os.environ["MACROGEN_TP_SIZE"] = str(world)  # the launch asks for 2-way tensor parallelism
    S, P = _modules(tmp)
    torch.manual_seed(42)
    x = torch.randn(2, 6, D_MODEL)
    ids = torch.randint(0, VOCAB, (2, 6))
    counts = {}

    serial, out, fwd, bwd = _check_block(
        "MLP", lambda: S.MLP(D_MODEL), lambda: P.MLP(D_MODEL), x, rank, world
    )
    counts["MLP"] = (fwd, bwd)
    ref = _torch_tp(serial, {"fc": "colwise", "proj": "rowwise"}, world)
    torch.testing.assert_close(ref(x), out, **TOL, msg="MLP: torch parallelize_module")

    serial, out, fwd, bwd = _check_block(
        "Attention",
        lambda: S.Attention(D_MODEL, N_HEAD),
        lambda: P.Attention(D_MODEL, N_HEAD),
        x,
        rank,
        world,
    )
    counts["Attention"] = (fwd, bwd)
    ref = _torch_tp(serial, {"qkv": "colwise", "proj": "rowwise"}, world)
    ref.n_head = N_HEAD // world  # torch leaves the head count to the user
    torch.testing.assert_close(ref(x), out, **TOL, msg="Attention: torch parallelize_module")

    _, _, fwd, bwd = _check_block(
        "PackedAttention",
        lambda: S.PackedAttention(D_MODEL, N_HEAD),
        lambda: P.PackedAttention(D_MODEL, N_HEAD),
        x,
        rank,
        world,
    )
    counts["PackedAttention"] = (fwd, bwd)
    _, _, fwd, bwd = _check_block(
        "LMRowwiseHead",
        lambda: S.LMRowwiseHead(VOCAB, D_MODEL),
        lambda: P.LMRowwiseHead(VOCAB, D_MODEL),
        ids,
        rank,
        world,
    )
    counts["LMRowwiseHead"] = (fwd, bwd)
    _, _, fwd, bwd = _check_block(
        "LMColwiseHead",
        lambda: S.LMColwiseHead(VOCAB, D_MODEL),
        lambda: P.LMColwiseHead(VOCAB, D_MODEL),
        ids,
        rank,
        world,
    )
    counts["LMColwiseHead"] = (fwd, bwd)
    _, _, fwd, bwd = _check_block(
        "Dotted", lambda: S.Dotted(D_MODEL), lambda: P.Dotted(D_MODEL), x, rank, world
    )
    counts["Dotted"] = (fwd, bwd)

    _, _, fwd, bwd = _check_block(
        "Containers", lambda: S.Containers(D_MODEL), lambda: P.Containers(D_MODEL), x, rank, world
    )
    counts["Containers"] = (fwd, bwd)
    _, _, fwd, bwd = _check_block(
        "TiedLM",
        lambda: S.TiedLM(VOCAB, D_MODEL),
        lambda: P.TiedLM(VOCAB, D_MODEL),
        ids,
        rank,
        world,
        gather_output=True,
    )
    counts["TiedLM"] = (fwd, bwd)
    tied = P.TiedLM(VOCAB, D_MODEL)
    assert tied.head.weight is tied.wte.weight and len(list(tied.parameters())) == 1

    # vocab-parallel cross-entropy from this rank's logit columns equals the serial loss
    import torch.distributed as dist
    import torch.nn.functional as F

    from macrogen.runtime.collectives import vocab_parallel_cross_entropy

    logits = torch.randn(12, VOCAB, generator=torch.Generator().manual_seed(7)) * 3
    target = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(8))
    target[::5] = -1
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, ignore_index=-1, reduction=reduction)
        want.sum().backward()
        mine = logits.chunk(world, dim=-1)[rank].clone().requires_grad_()
        with _CountCollectives() as comm:
            got = vocab_parallel_cross_entropy(mine, target, dist.group.WORLD, -1, reduction)
            got.sum().backward()
            counts[f"cross_entropy {reduction}"] = comm.take()
        torch.testing.assert_close(got, want, **TOL, msg=f"cross_entropy {reduction}")
        torch.testing.assert_close(mine.grad, full.grad.chunk(world, dim=-1)[rank], **TOL)

    # big rowwise outputs are reduced in row chunks, each while the next is computed;
    # without overlap, every collective runs alone
    import macrogen.runtime.collectives as collectives

    collectives.CHUNK_ELEMENTS = 1
    _, _, fwd, bwd = _check_block(
        "MLP chunked", lambda: S.MLP(D_MODEL), lambda: P.MLP(D_MODEL), x, rank, world
    )
    counts["MLP chunked"] = (fwd, bwd)
    collectives.OVERLAP = False
    _, _, fwd, bwd = _check_block(
        "MLP without overlap", lambda: S.MLP(D_MODEL), lambda: P.MLP(D_MODEL), x, rank, world
    )
    counts["MLP without overlap"] = (fwd, bwd)
    _check_block(
        "PackedAttention without overlap",
        lambda: S.PackedAttention(D_MODEL, N_HEAD),
        lambda: P.PackedAttention(D_MODEL, N_HEAD),
        x,
        rank,
        world,
    )
    collectives.OVERLAP, collectives.CHUNK_ELEMENTS = True, 1 << 20

    # shards are plain tensors of the local shape, under the serial names
    mlp = P.MLP(D_MODEL)
    shapes = {k: tuple(v.shape) for k, v in mlp.state_dict().items()}
    assert shapes == {
        "fc.weight": (4 * D_MODEL // world, D_MODEL),
        "fc.bias": (4 * D_MODEL // world,),
        "proj.weight": (D_MODEL, 4 * D_MODEL // world),
        "proj.bias": (D_MODEL,),
    }, shapes
    assert type(mlp.fc.weight) is torch.nn.Parameter
    # a rowwise layer with one reduction is torch's linear + bias add: no Python autograd node
    assert type(mlp(x).grad_fn).__name__ == "AddBackward0", mlp(x).grad_fn
    twin = copy.deepcopy(mlp)  # an EMA copy: same group, own tensors
    assert twin.fc.group is mlp.fc.group and twin.fc.weight is not mlp.fc.weight
    torch.testing.assert_close(twin(x), mlp(x))
    assert P.Attention(D_MODEL, N_HEAD).n_head == N_HEAD // world

    # dimensions the degree does not divide, ties a plan can't keep: a clear error at construction
    errors = []
    for build in (
        lambda: P.LMRowwiseHead(25, D_MODEL),
        lambda: P.Attention(D_MODEL, 3),
        lambda: P.TiedRowwise(VOCAB, D_MODEL),
        lambda: P.TiedHalfPlanned(VOCAB, D_MODEL),
    ):
        try:
            build()
        except ValueError as e:
            errors.append(str(e))
    # a divided attribute that differs between ranks (same parameter shapes): refused on all ranks
    try:
        P.Attention(D_MODEL, N_HEAD * (1 + rank))
    except RuntimeError as e:
        errors.append(str(e).split(" (raised on rank")[0])
    return counts, errors


def test_tensor_parallel_blocks_match_serial_on_two_ranks(tmp_path):
    results = run_ranks(_two_rank_checks, 2, args=(str(tmp_path),), timeout=150)
    counts, errors = results[0]
    # colwise feeding rowwise: nothing in between; one all-reduce forward (g, after the
    # rowwise matmul) and one backward (f: the colwise input gradient, beside the weight
    # gradient)
    block = ({"all_reduce": 1, "all_gather": 0}, {"all_reduce": 1, "all_gather": 0})
    assert counts["MLP"] == block
    assert counts["Attention"] == block
    assert counts["PackedAttention"] == block
    assert counts["Dotted"] == block
    # big outputs: 4 row chunks, each reduced while the next is computed
    assert counts["MLP chunked"] == ({"all_reduce": 4, "all_gather": 0}, block[1])
    assert counts["MLP without overlap"] == block
    # vocab (one all-reduce) then a rowwise head on a full input (its slice forward; backward
    # all-gathers the input gradient)
    assert counts["LMRowwiseHead"] == (
        {"all_reduce": 2, "all_gather": 0},
        {"all_reduce": 0, "all_gather": 1},
    )
    # vocab (one all-reduce forward), colwise head (one all-reduce backward); forward returns
    # the head's output, so it is gathered (one all-gather forward, none backward)
    one_each = {"all_reduce": 1, "all_gather": 0}
    assert counts["LMColwiseHead"] == ({"all_reduce": 1, "all_gather": 1}, one_each)
    assert counts["Containers"] == (
        {"all_reduce": 4, "all_gather": 0},
        {"all_reduce": 4, "all_gather": 0},
    )
    assert counts["TiedLM"] == (one_each, one_each)
    # the row maxima, then the sums of exp and of the target logits together; nothing backward
    assert counts["cross_entropy mean"] == {"all_reduce": 2, "all_gather": 0}
    assert errors == [
        "LMRowwiseHead.wte.num_embeddings = 25 is not divisible by the tensor-parallel size 2; choose a size that divides it",
        "Attention.n_head = 3 is not divisible by the tensor-parallel size 2; choose a size that divides it",
        "TiedRowwise.head.weight is tied to TiedRowwise.wte.weight, but the plan splits them"
        " differently (dim 1 vs 0): a tie keeps one shard, so plan both with the same split (a"
        " vocab embedding and a colwise head share rows) or untie them",
        "TiedHalfPlanned.wte.weight is tied to TiedHalfPlanned.head.weight, which the plan shards;"
        " plan both with the same split (a vocab embedding and a colwise head share rows) or"
        " untie them",
        "tensor_parallel: rank 1 built a different model than rank 0: Attention's divided"
        " attributes (serial values): (('Attention.n_head', 4),) on rank 0 but"
        " (('Attention.n_head', 8),)",
    ]


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
    assert (m.data_size, m.tensor_size, m.data_rank) == (2, 2, rank // 2)
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 32 // 2, 32)
    seeded = full_state_dict(model)  # shards cut from the serial initialization
    for key, value in initial.items():
        torch.testing.assert_close(seeded[key], value, rtol=0, atol=0, msg=f"initial {key}")
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

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(serial_losses), rtol=1e-5, atol=0)
    for key, g in serial_grads.items():
        torch.testing.assert_close(grads[key], g, **TOL, msg=f"first-step gradient of {key}")
    full = full_state_dict(model)
    assert list(full) == list(serial.state_dict())
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(full[key], value, **TOL, msg=f"{key} after {STEPS} steps")
    return losses


def test_gpt_example_data_x_tensor_parallel_on_four_ranks(tmp_path):
    source = GPT_EXAMPLE.read_text()
    losses = run_ranks(_dp_tp_training, 4, args=(source, str(tmp_path)), timeout=240)
    assert losses[0] == losses[1] == losses[2] == losses[3]
