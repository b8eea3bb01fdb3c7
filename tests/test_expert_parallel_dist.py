"""``mg.parallelize(model, ep=E)`` against the serial model on the global batch.

Float64, one spawn of 2 gloo ranks (ep=2) and one of 4 (ep=2 x data parallel 2, and ep=4),
each looping over its cases: transformers' Qwen2-MoE, Mixtral and OLMoE from shrunk configs, and a
plain MoE of our own (``tests.expert_models.PlainMoE``), and one with its experts in
``nn.ModuleList``s in two forms of the loop (``ListMoE``, expert 3 never picked: its
``state_dict`` values and a strict ``load_state_dict`` of the serial keys too); the same models with
their blocks recomputed (``recompute=``: the routing runs again in backward) and under ZeRO-1
(``dp="zero1"`` with ``mg.shard_optimizer``: the experts' state sharded over their replicas,
its DCP state round-tripped). Each rank trains on its rows of the
global batch, the serial copy on all of them, 3 AdamW steps: the losses (averaged over the
ranks), ``mg.clip_grad_norm_``'s norm (torch's where one mesh), the gradients of the first step and the parameters after
the last (gathered whole) equal the serial model's within 1e-10. Uneven loads: a router
biased so one expert takes most pairs and one none; and one where every pair goes to rank
0's experts (rank 1 computes nothing). ``save_pretrained`` on every rank writes the serial
weights. The all-to-alls move exactly the routed pairs' hidden
states: tokens x top_k x hidden x 8 bytes each way, forward, and again in backward.
"""

from __future__ import annotations

import copy
import os
import re
import textwrap
import time
from pathlib import Path

import pytest
import torch

import macrogen as mg
from tests.distributed import run_ranks
from tests.helpers import expand, load_module

pytest.importorskip("transformers")

SOURCE = textwrap.dedent(
    """
    import torch

    import macrogen as mg


    def ep2_zero1(model):
        return mg.parallelize(model, ep=2, dp="zero1")


    def ep2_zero1_recompute(model):
        return mg.parallelize(model, ep=2, dp="zero1", recompute="blocks")


    def sharded(model):  # ZeRO-1: AdamW's state sharded (the experts' over their replicas)
        return mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))


    def ep2(model):
        return mg.parallelize(model, ep=2)


    def ep4(model):
        return mg.parallelize(model, ep=4)


    def ep2_fsdp(model):
        return mg.parallelize(model, ep=2, dp="fsdp")


    def ep2_recompute(model):
        return mg.parallelize(model, ep=2, recompute="blocks")


    def ep2_recompute2(model):  # every 2nd block: the first of the two
        return mg.parallelize(model, ep=2, recompute=2)


    def ep2_fsdp_recompute(model):
        return mg.parallelize(model, ep=2, dp="fsdp", recompute="blocks")


    def tp2_ep2_recompute(model):
        return mg.parallelize(model, tp=2, ep=2, tp_plan="hf", recompute="blocks")


    def tp2_ep2(model):
        return mg.parallelize(model, tp=2, ep=2, tp_plan="hf")


    def tp2_ep2_plain(model):
        return mg.parallelize(model, tp=2, ep=2, tp_plan={
            "blocks.*.experts.w_in": "colwise",
            "blocks.*.experts.w_out": "rowwise",
            "blocks.*.experts": "moe_experts",
            "blocks.*.router": "replicate",
        })


    def tp2_ep2_whole(model):  # the experts out of the plan: whole on each tensor rank
        return mg.parallelize(model, tp=2, ep=2, tp_plan={"head": "colwise_gather_output"})
    """
)

SKEWED = [6.0, 3.0, 0.0, -1e4]  # expert 0 takes most pairs, expert 3 none
ONE_RANK = [4.0, 4.0, -1e4, -1e4]  # every pair to experts 0 and 1: rank 0 of ep=2 does all
ROWS = 4  # rows of the global batch per step
STEPS = 3

CASES = {  # name: (model, router bias, parallelize function, ranks)
    "qwen2_moe": ("qwen2_moe", None, "ep2", (2, 4)),
    "qwen2_moe skewed": ("qwen2_moe", SKEWED, "ep2", (2,)),
    "qwen2_moe one rank": ("qwen2_moe", ONE_RANK, "ep2", (2,)),
    "mixtral": ("mixtral", None, "ep2", (2,)),
    "olmoe": ("olmoe", None, "ep2", (2,)),
    "plain": ("plain", None, "ep2", (2, 4)),
    "plain ep4": ("plain", None, "ep4", (4,)),
    "qwen2_moe fsdp": ("qwen2_moe", None, "ep2_fsdp", (2, 4)),
    "plain fsdp": ("plain", None, "ep2_fsdp", (4,)),
    "module list": ("list", None, "ep2", (2, 4)),  # experts in nn.ModuleLists, expert 3 starved
    "module list hit": ("list hit", None, "ep2", (2,)),  # only the experts hit: none starved
    # tp=2 inside the experts x ep=2 over the data ranks (4 ranks: 2 data x 2 tensor)
    "qwen2_moe tp2": ("qwen2_moe", None, "tp2_ep2", (4,)),
    "qwen2_moe tp2 skewed": ("qwen2_moe", SKEWED, "tp2_ep2", (4,)),
    "qwen2_moe tp2 one rank": ("qwen2_moe", ONE_RANK, "tp2_ep2", (4,)),
    # (its router's softmax in float64: in float32, as transformers computes it, the float64
    # rounding of the attention's tensor-parallel sum reaches the routing weights as float32's)
    "mixtral tp2": ("mixtral exact", None, "tp2_ep2", (4,)),
    "plain tp2": ("plain", None, "tp2_ep2_plain", (4,)),  # a hand plan
    "plain tp2 whole experts": ("plain", None, "tp2_ep2_whole", (4,)),
    # ZeRO-1 (mg.shard_optimizer): the experts' state sharded over their replica group
    "qwen2_moe zero1": ("qwen2_moe", None, "ep2_zero1", (2, 4)),
    "plain zero1": ("plain", None, "ep2_zero1", (2, 4)),
    "qwen2_moe zero1 recompute": ("qwen2_moe", None, "ep2_zero1_recompute", (4,)),
    "module list zero1": ("list", None, "ep2_zero1", (2, 4)),
    # the blocks recomputed in backward: their routing and its all-to-alls run again there
    "qwen2_moe recompute": ("qwen2_moe", None, "ep2_recompute", (2, 4)),
    "qwen2_moe recompute one rank": ("qwen2_moe", ONE_RANK, "ep2_recompute", (2,)),
    "mixtral recompute/2": ("mixtral", None, "ep2_recompute2", (2,)),
    "plain recompute": ("plain", None, "ep2_recompute", (2, 4)),
    "module list recompute": ("list", None, "ep2_recompute", (2,)),
    "qwen2_moe fsdp recompute": ("qwen2_moe", None, "ep2_fsdp_recompute", (4,)),
    "qwen2_moe tp2 recompute": ("qwen2_moe", SKEWED, "tp2_ep2_recompute", (4,)),
}
# the share of the MoE layers whose forward (and routing) runs again in backward
RECOMPUTED = {
    "ep2_recompute": 1.0,
    "ep2_recompute2": 0.5,
    "ep2_fsdp_recompute": 1.0,
    "tp2_ep2_recompute": 1.0,
    "ep2_zero1_recompute": 1.0,
}
TENSOR = {
    "tp2_ep2": 2,
    "tp2_ep2_recompute": 2,
    "tp2_ep2_plain": 2,
    "tp2_ep2_whole": 2,
}  # the tensor-parallel ways of a parallelize function


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _build(kind, bias):
    from tests.expert_models import ListMoE, PlainMoE, bias_routers, transformers_model

    torch.manual_seed(0)
    if kind.startswith("list"):
        return ListMoE(hit=kind == "list hit", starved=None if kind == "list hit" else 3)
    exact = kind.endswith(" exact")  # routers' softmax in float64 (expert_models.biased_forward)
    kind = kind.removesuffix(" exact")
    model = PlainMoE() if kind == "plain" else transformers_model(kind)
    if bias is not None or exact:
        bias_routers(model, bias or [0.0] * 4, exact=exact)
    return model


def _loss(model, ids):
    if hasattr(model, "config"):
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    return model(ids, ids)


ORDERS = (1.0, float("inf"), 2.0)  # norm orders clipped by (the largest max_norm: no scaling)


def _train(model, rows, sharded=None, torch_clip=False):
    """3 AdamW steps on ``rows`` of each global batch: losses, norms, first gradients, params.
    ``sharded``: the ZeRO-1 optimizer's maker; each rank's ``.grad`` is then its own, and the
    first gradients are each parameter's averaged-gradient norm (torch's, on the shares);
    ``torch_clip``: torch's ``clip_grad_norm_`` of the parameters first (its norm too)."""
    from tests.expert_models import batches

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if sharded is not None:
        opt = sharded(model)
    losses, norms, first = [], [], None
    for ids in batches(STEPS, ROWS):
        loss = _loss(model, ids[rows])
        loss.backward()
        # the serial norm; under ep x FSDP from gradients on two meshes (torch's one stack raises)
        if torch_clip:  # (under ZeRO-1 on the averaged gradients' shares: zero_grads)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        clipped = list(model.parameters()) if sharded is None else opt
        norms += [float(mg.clip_grad_norm_(clipped, 1e9, order)) for order in ORDERS]
        if first is None and sharded is None:
            first = _serial(model, {n: _full(p.grad).clone() for n, p in model.named_parameters()
                                    if p.grad is not None})  # fmt: skip
        elif first is None:
            named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
            norms_ = torch._foreach_norm([g for _, g in named])
            first = {n: _full(v).reshape(()) for (n, _), v in zip(named, norms_)}
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    if sharded is not None:
        opt.finish_gather()
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return losses, norms, first, _serial(model, params), opt


def _stacked_norms(model, grads):
    """Each serial gradient's norm, under ``model``'s names: an ``ExpertList``'s experts'
    (``experts.0.fc1.weight``, ...) as the norm of their stack (``experts.fc1.weight``)."""
    from macrogen.runtime.expert_modules import ExpertList

    norms = {n: g.norm() for n, g in grads.items()}
    for prefix, module in model.named_modules():
        if isinstance(module, ExpertList):
            for name in module.names:
                keys = [f"{prefix}.{i}.{name}" for i in range(module.serial_experts)]
                norms[f"{prefix}.{name}"] = torch.stack([norms.pop(k) for k in keys]).norm()
    return norms


def _serial(model, named):
    """``named`` under the serial model's names: an ``ExpertList``'s stacked ``experts.fc1.weight``
    split into ``experts.0.fc1.weight``, ... (its ``state_dict``'s keys)."""
    from macrogen.runtime.expert_modules import ExpertList

    for prefix, module in model.named_modules():
        if isinstance(module, ExpertList):
            for name in module.names:
                if f"{prefix}.{name}" in named:
                    whole = named.pop(f"{prefix}.{name}")
                    named.update({f"{prefix}.{i}.{name}": t for i, t in enumerate(whole)})
    return named


def _gap(ours, theirs):
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    return max(float((ours[k] - v).abs().max()) for k, v in theirs.items())


def _cases(rank, world, tmp):
    import warnings

    import torch.distributed as dist
    import transformers

    from macrogen.runtime import mesh
    from macrogen.runtime.expert_parallel import expert_parallel_of

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float64)
    module = load_module(expand(SOURCE), f"ep_parity_{rank}", Path(tmp))
    only = os.environ.get("MG_EP_CASES")  # (a quick run of some cases: "qwen2_moe tp2,plain")
    out = {}
    for name, (kind, bias, how, worlds) in CASES.items():
        if world not in worlds or (only and name not in only.split(",")):
            continue
        tp = TENSOR.get(how, 1)  # the tensor ranks of a data rank train on its rows
        per_rank = ROWS // (world // tp)
        mine = slice(rank // tp * per_rank, (rank // tp + 1) * per_rank)
        start = time.perf_counter()
        mesh.reset()  # (one mesh per program: each case is a program of its own)
        serial = _build(kind, bias)
        reference = copy.deepcopy(serial)
        model = getattr(module, how)(serial)
        zero1 = "zero1" in how
        want = _train(reference, slice(None), torch_clip=zero1)
        got = _train(model, mine, module.sharded if zero1 else None, torch_clip=zero1)
        if zero1:  # (each parameter's averaged gradient's norm: ZeRO-1 holds shares of it)
            norms = _stacked_norms(model, want[2])
            want[2].clear()
            want[2].update(norms)
        losses = [loss.clone() for loss in got[0]]
        for loss in losses:
            dist.all_reduce(loss)
        state = expert_parallel_of(model)
        out[name] = {
            "seconds": time.perf_counter() - start,
            "float32 loss": got[0][0].dtype == torch.float32,
            "losses": max(abs(float(a) / world - float(b)) for a, b in zip(losses, want[0])),
            "norms": max(
                abs(a - b) / max(abs(b), 1.0) for a, b in zip(got[1], want[1])
            ),  # relative
            "norm pairs": list(zip(got[1], want[1])),
            "gradients": _gap(got[2], want[2]),
            "parameters": _gap(got[3], want[3]),
            "numel": sum(p.numel() for p in model.parameters())
            == sum(p.numel() for p in reference.parameters()),
            "state_dict": {k: tuple(v.shape) for k, v in model.state_dict().items()}
            == {k: tuple(v.shape) for k, v in reference.state_dict().items()},
            "state_dict values": _gap(
                {k: _full(v) for k, v in model.state_dict().items()}, reference.state_dict()
            ),
            "local experts": sorted({m.num_experts for _, m in state.experts}),
            "own storage": _own_storage(state),
            "bytes": _bytes(model, state, mine, kind),
            "recomputed": RECOMPUTED.get(how, 0.0),
            "evaluation": _evaluation(model, reference, mine),
        }
        got[4].zero_grad()  # (ZeRO-1: the reduce-scatters of _bytes's backward, never stepped)
        if zero1:  # the rest's buckets cut over the data ranks, the experts' over their replicas
            out[name]["buckets over"] = sorted({b.world for b in got[4].buckets})
        if tp > 1:
            out[name].update(_on_the_grid(model, reference))
    per_rank = ROWS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    mesh.reset()
    if world == 2 and not only:
        out["transformers' own ep"] = _against_transformers(module, mine)
        out["save_pretrained"] = _saved(module, Path(tmp), rank)
        out["module list load_state_dict"] = _reloaded(module)
        out["module list dropout"] = _dropout(module, mine)
        out["module list hit starved"] = _starved(module, mine)
    if world == 4 and not only:
        mesh.reset()
        out["save_pretrained tp2"] = _saved(module, Path(tmp), rank, "tp2_ep2")
        mesh.reset()
        out["checkpoint tp2"] = _checkpointed(module, Path(tmp), rank, world)
    if not only or "checkpoint zero1" in only:
        mesh.reset()
        out["checkpoint zero1"] = _checkpointed(module, Path(tmp), rank, world, "ep2_zero1")
    return out


def _checkpointed(module, tmp, rank, world, how="tp2_ep2"):
    """tp x ep (and ep under ZeRO-1) through ``resumable``'s DCP state (``checkpoint_state``:
    the packed experts saved whole, cut again on load; the sharded optimizer's state in the
    serial optimizer's format, the experts' as DTensors): saved after a step, loaded into another
    model's and optimizer's, the parameters and the optimizer state come back exactly."""
    import torch.distributed.checkpoint as dcp

    from macrogen.runtime import mesh
    from macrogen.runtime.checkpoint_state import get_state, set_state
    from tests.expert_models import batches

    tp = TENSOR.get(how, 1)
    per_rank = ROWS // (world // tp)
    ids = batches(1, ROWS)[0][rank // tp * per_rank : (rank // tp + 1) * per_rank]
    trained = []
    for seed in (0, 3):  # the saved model, and one to load into
        mesh.reset()
        model = getattr(module, how)(_build("qwen2_moe", None) if seed == 0 else _shuffled(seed))
        if "zero1" in how:
            opt = module.sharded(model)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        trained.append((model, opt))
    (model, opt), (other, other_opt) = trained
    model_sd, optim_sd, _ = get_state(model, [opt], load=False)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / f"{how}_dcp"))
    into = get_state(other, [other_opt], load=True)
    dcp.load({"model": into[0], "optim": into[1]}, checkpoint_id=str(tmp / f"{how}_dcp"))
    set_state(other, [other_opt], *into)

    def whole(m, o):
        params = {n: _full(p.detach()) for n, p in m.named_parameters()}
        names = {id(p): n for n, p in m.named_parameters()}
        order = [names[id(p)] for g in o.param_groups for p in g["params"]]
        states = {f"{order[i]} {k}": _full(v) for i, state in o.state_dict()["state"].items()
                  for k, v in state.items() if k != "step"}  # fmt: skip
        return {**params, **states}

    return {"gap": _gap(whole(other, other_opt), whole(model, opt))}


def _shuffled(seed):
    """Qwen2-MoE with other values (normal draws from ``seed``)."""
    torch.manual_seed(seed)
    model = _build("qwen2_moe", None)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _on_the_grid(model, reference):
    """tp x ep: every parameter on the one (ep_replicate, ep, tensor) mesh, the experts' cut on
    both, and torch's full state dict (DCP's ``get_model_state_dict``) the serial one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "meshes": {p.device_mesh.mesh_dim_names for p in model.parameters()},
        "expert placements": sorted(
            {str(tuple(p.placements)) for n, p in model.named_parameters() if ".experts." in n}
        ),  # fmt: skip
        "full state dict": _gap(full, reference.state_dict()),
    }


def _own_storage(state):
    """Each expert parameter's local tensor holds its own experts' bytes, not a view of the
    serial tensor (which would keep every expert alive on every rank). FSDP: its own storage."""
    if state.fully_sharded:
        return True
    locals_ = [p.to_local() for _, m in state.experts for p in m.parameters()]
    return all(t.untyped_storage().nbytes() == t.nbytes for t in locals_)


def _starved(module, rows):
    """The ``expert_hit`` form with an expert no rank's tokens reach: refused in training (its
    serial gradient is None, which the optimizer skips), answered in evaluation."""
    from tests.expert_models import ListMoE, batches

    torch.manual_seed(0)
    model = module.ep2(ListMoE(hit=True, starved=3))
    ids = batches(1, ROWS)[0][rows]
    with torch.no_grad():
        model(ids, ids)
    try:
        model(ids, ids)
    except RuntimeError as error:
        return {"gap": 0, "message": str(error)}
    return {"gap": 1, "message": ""}


def _dropout(module, rows):
    """A block with dropout before its router: the second pass draws the first's masks, and the
    next block the serial model's next ones (the serial model on this rank's rows, same seed)."""
    from tests.expert_models import ListMoE, batches

    torch.manual_seed(0)
    reference = ListMoE(dropout=0.25)
    model = module.ep2(copy.deepcopy(reference))
    ids = batches(1, ROWS)[0][rows]
    torch.manual_seed(5)
    ours = model(ids, ids)
    torch.manual_seed(5)
    return {"gap": abs(float(ours) - float(reference(ids, ids)))}


def _reloaded(module):
    """A ModuleList model's ``load_state_dict`` takes the serial keys (strict): each rank keeps
    its experts, and ``state_dict`` gives them back whole."""
    from torch.distributed.tensor.experimental import implicit_replication

    from tests.expert_models import ListMoE

    torch.manual_seed(0)
    reference = ListMoE()
    model = module.ep2(copy.deepcopy(reference))
    torch.manual_seed(1)
    wanted = {k: torch.randn_like(v) for k, v in ListMoE().state_dict().items()}
    with implicit_replication():  # (the rest of the model: replicated DTensors)
        model.load_state_dict(wanted)
    return {"gap": _gap({k: _full(v) for k, v in model.state_dict().items()}, wanted)}


def _saved(module, tmp, rank, how="ep2"):
    """``save_pretrained`` on every rank writes the serial weights; ``from_pretrained`` reads them."""
    import torch.distributed as dist

    reference = _build("qwen2_moe", None)
    model = getattr(module, how)(copy.deepcopy(reference))
    model.save_pretrained(tmp / how, is_main_process=rank == 0)
    dist.barrier()
    loaded = type(reference).from_pretrained(tmp / how, dtype=torch.float64)
    return {"gap": _gap(loaded.state_dict(), reference.state_dict())}


def _against_transformers(module, rows):
    """transformers' own expert parallelism (``apply_expert_parallelism`` with the config's
    ``base_model_ep_plan``, its ``AllToAllEP``) on the same rows: the same loss and, once its
    summed expert gradients are divided by the ranks, the same expert gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    from tests.expert_models import batches

    ours = module.ep2(_build("qwen2_moe", SKEWED))
    theirs = _build("qwen2_moe", SKEWED)
    grid = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "tp"))
    names = [n for n, _ in theirs.named_modules()] + [n for n, _ in theirs.named_parameters()]
    plan = {n: style for pattern, style in theirs.config.base_model_ep_plan.items()
            for n in names if re.fullmatch(r"model\." + re.escape(pattern).replace(r"\*", r"\d+"), n)}  # fmt: skip
    apply_expert_parallelism(theirs, grid["ep"], grid["tp"], plan)
    ids = batches(1, ROWS)[0][rows]
    losses = [_loss(m, ids) for m in (ours, theirs)]
    for loss in losses:
        loss.backward()
    gaps = [abs(float(losses[0]) - float(losses[1]))]
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if ".experts." in name:
            mine, other = p.grad.to_local(), q.grad.to_local() / dist.get_world_size()
            gaps.append(float((mine - other).abs().max()))
    return {"gap": max(gaps), "experts compared": len(gaps) - 1}


def _evaluation(model, reference, rows):
    """Under no_grad (routing without its backward), the trained models' losses on the rows."""
    from tests.expert_models import batches

    ids = batches(2, ROWS)[1][rows]
    with torch.no_grad():
        return abs(float(_loss(model, ids)) - float(_loss(reference, ids)))


def _bytes(model, state, rows, kind):
    """One forward and backward's routing bytes beside the routed pairs' size."""
    from tests.expert_models import batches

    ids = batches(1, ROWS)[0][rows]
    state.traffic.reset()
    loss = _loss(model, ids)
    t = state.traffic
    forward = {"dispatched": t.dispatched, "combined": t.combined, "pairs": t.pairs}
    loss.backward()
    model.zero_grad()
    k = 2
    hidden = 16 if kind == "plain" or kind.startswith("list") else 32
    routed = len(state.experts) * ids.numel() * k * hidden * 8
    # a recomputed block's forward in backward routes its tokens again
    again = {"dispatched again": t.dispatched - forward["dispatched"],
             "combined again": t.combined - forward["combined"]}  # fmt: skip
    return {"routed": routed, **forward, "backward": t.backward, **again}


def _check(results):
    measured = [g for r in results for g in r.values() if "gap" not in g]
    print({k: max(g[k] for g in measured) for k in ("losses", "norms", "gradients", "parameters")})
    for name, gaps in [(n, g) for r in results for n, g in r.items() if "gap" not in g]:
        # (transformers computes its loss in float32, on purpose: its rounding, in another order)
        assert gaps["losses"] < (1e-5 if gaps["float32 loss"] else 1e-10), (name, gaps)
        assert gaps["norms"] < 1e-10, (name, gaps["norm pairs"])
        assert gaps["gradients"] < 1e-10, (name, gaps)
        assert gaps["parameters"] < 1e-10, (name, gaps)
        assert gaps["evaluation"] < (1e-5 if gaps["float32 loss"] else 1e-10), (name, gaps)
        assert gaps["numel"] and gaps["state_dict"], (name, gaps)
        assert gaps["own storage"], name
        assert gaps["state_dict values"] < 1e-10, (name, gaps)
        b = gaps["bytes"]  # this rank: its pairs out, the rows its experts ran back
        assert b["dispatched"] == b["routed"], (name, b)
        assert b["backward"] == b["dispatched"] + b["combined"], (name, b)
        # the recomputed blocks route their pairs again in backward (every MoE layer as many)
        assert b["dispatched again"] == b["routed"] * gaps["recomputed"], (name, b)
    for name in [
        n for n, g in results[0].items() if "gap" not in g
    ]:  # over the ranks, each way: every routed pair once
        routed = sum(r[name]["bytes"]["routed"] for r in results)
        assert sum(r[name]["bytes"]["combined"] for r in results) == routed, name
        again = sum(r[name]["bytes"]["dispatched again"] for r in results)
        assert sum(r[name]["bytes"]["combined again"] for r in results) == again, name


@pytest.mark.timeout(300)
def test_expert_parallel_equals_serial_on_2_ranks(tmp_path):
    results = run_ranks(_cases, 2, args=(str(tmp_path),), timeout=280)
    print({name: round(r.get("seconds", 0), 2) for name, r in results[0].items()})
    _check(results)
    print(results[0]["transformers' own ep"])
    assert results[0]["qwen2_moe"]["local experts"] == [2]
    for rank_results in results:  # ZeRO-1: the experts' state over their replica group (of 1)
        assert rank_results["qwen2_moe zero1"]["buckets over"] == [1, 2]
        assert rank_results["checkpoint zero1"]["gap"] == 0, rank_results["checkpoint zero1"]
    assert results[1]["qwen2_moe one rank"]["bytes"]["combined"] == 0  # its experts got nothing
    for rank_results in results:
        assert rank_results["save_pretrained"]["gap"] == 0, rank_results["save_pretrained"]
        assert rank_results["module list load_state_dict"]["gap"] == 0
        assert rank_results["module list dropout"]["gap"] < 1e-10, rank_results
        starved = rank_results["module list hit starved"]["message"]
        assert starved.startswith("blocks.0.experts: expert 3 got no token on any rank"), starved
        theirs = rank_results["transformers' own ep"]
        assert theirs["gap"] < 1e-10 and theirs["experts compared"] == 4, theirs


@pytest.mark.timeout(300)
def test_expert_parallel_with_data_parallel_equals_serial_on_4_ranks(tmp_path):
    results = run_ranks(_cases, 4, args=(str(tmp_path),), timeout=280)
    print({name: round(r.get("seconds", 0), 2) for name, r in results[0].items()})
    _check(results)
    assert results[0]["plain ep4"]["local experts"] == [1]
    grid = {("ep_replicate", "ep", "tensor")}
    for rank, rank_results in enumerate(results):
        assert rank_results["save_pretrained tp2"]["gap"] == 0, rank_results["save_pretrained tp2"]
        assert rank_results["checkpoint tp2"]["gap"] == 0, rank_results["checkpoint tp2"]
        assert rank_results["checkpoint zero1"]["gap"] == 0, rank_results["checkpoint zero1"]
        assert rank_results["qwen2_moe zero1"]["buckets over"] == [2, 4]
        for name in ("qwen2_moe tp2", "plain tp2", "plain tp2 whole experts"):
            assert rank_results[name]["meshes"] == grid, rank_results[name]["meshes"]
            assert rank_results[name]["full state dict"] < 1e-10, rank_results[name]
        assert rank_results["qwen2_moe tp2"]["expert placements"] == [
            "(Replicate(), Shard(dim=0), Shard(dim=2))",  # down_proj: rowwise
            "(Replicate(), Shard(dim=0), _StridedShard(dim=1, sf=2))",  # gate_up_proj: packed
        ], rank_results["qwen2_moe tp2"]["expert placements"]
        assert rank_results["plain tp2 whole experts"]["expert placements"] == [
            "(Replicate(), Shard(dim=0), Replicate())"
        ]
        # every pair to data rank 0's experts: data rank 1's tensor ranks (2, 3) run none
        assert (rank_results["qwen2_moe tp2 one rank"]["bytes"]["combined"] == 0) == (rank >= 2)
