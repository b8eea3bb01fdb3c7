"""``ep=`` for experts held in a plain ``nn.ModuleList``: the mixture block as people write it.

    class MoE(nn.Module):
        def __init__(self):
            self.gate = nn.Linear(hidden, n, bias=False)  # the router
            self.experts = nn.ModuleList([Expert() for _ in range(n)])

        def forward(self, x):
            weights, index = torch.topk(self.gate(x).softmax(-1), k)
            out = torch.zeros_like(x)
            for e, expert in enumerate(self.experts):  # or only the experts hit
                token, slot = torch.where(index == e)
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
            return out

The block keeps its own forward, run twice per call. The first pass records each expert
call's input rows (the experts answer zeros). The rows go to their experts' ranks in one
all-to-all (``ExpertRouter``: counts first, uneven splits), each rank runs its own experts'
modules (their own forward) on what it received, and a second all-to-all brings the outputs
back. The second pass runs the forward again and each expert call answers its outputs, which
the block weights and sums in its own order, as serially. Gradients: the expert inputs' through
the first pass (its graph is the one that made them), the router's through the second.

Storage: each parameter of the experts stacked ``(experts, ...)`` under the expert's own name
(``experts.fc1.weight``), a DTensor ``Shard(0)`` on the (replica x expert) grid as stacked
experts are, so ``numel`` and ``clip_grad_norm_`` see the serial model. A parameter of one
expert cannot be a DTensor that lives on one rank only, so ``state_dict`` gives the serial keys
(``experts.3.fc1.weight``) with whole tensors, gathered (every rank calls it, as for
``save_pretrained``), and ``load_state_dict`` takes them back.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Function
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from macrogen.runtime.expert_routing import ExpertRouter
from macrogen.runtime.parallelize.engine import dtensor_parameter
from macrogen.runtime.parallelize.local import OWN_SWAP, weakly_bound

if TYPE_CHECKING:
    from macrogen.runtime.expert_parallel import ExpertParallel

AVERAGED_HERE = "_mg_averaged_by_experts"  # on an expert parameter: data parallel leaves it


def expert_lists(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks holding their experts in an ``nn.ModuleList`` named ``experts``."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module._modules.get("experts"), nn.ModuleList)
        and len(module._modules["experts"])
    ]


def _router(block: nn.Module, n: int) -> nn.Linear | None:
    """The block's router: an ``nn.Linear`` to its ``n`` experts, outside them."""
    inside = {id(m) for m in block._modules["experts"].modules()}  # type: ignore[union-attr]
    for module in block.modules():
        if id(module) not in inside and isinstance(module, nn.Linear) and module.out_features == n:
            return module
    return None


def list_problem(block: nn.Module) -> str | None:
    """Why ep cannot serve ``block`` (its experts in a ModuleList), or None. Checked serially,
    in float64 on a copy, before anything is cut: the two-pass forward (module docstring) with
    each expert run on its rows among other rows must give the block's own output."""
    experts: nn.ModuleList = block._modules["experts"]  # type: ignore[assignment]
    n, first = len(experts), experts[0]
    shapes = [(name, p.shape) for name, p in first.named_parameters()]
    if not shapes:
        return "its experts have no parameters: nothing to deal over the ranks"
    for expert in experts:
        if (
            type(expert) is not type(first)
            or [(name, p.shape) for name, p in expert.named_parameters()] != shapes
        ):
            return "its experts differ in class or parameter shapes: ep stacks them by name"
    if any(True for _ in experts.buffers()):
        return "its experts hold buffers: ep deals the experts' parameters only"
    if any(p.is_meta for p in experts.parameters()):
        return (
            "ep over an nn.ModuleList of experts needs the model built with values (not on the"
            " meta device): build it on the CPU, or stack the experts into one experts module"
        )
    router = _router(block, n)
    if router is None:
        return (
            f"no router: ep over an nn.ModuleList of experts needs the block's router, an"
            f" nn.Linear from the hidden size to its {n} experts (a gate)"
        )
    return _probe(block, router.in_features)


def _probe(block: nn.Module, hidden: int) -> str | None:
    twin = copy.deepcopy(block).to(torch.float64).eval()  # (dropout: the runs repeat it)
    real: nn.ModuleList = twin._modules["experts"]  # type: ignore[assignment]
    device = next(twin.parameters()).device
    generator = torch.Generator().manual_seed(0)
    want: Any = None
    x = torch.empty(0)
    for shape in ((6, hidden), (2, 3, hidden)):  # (tokens, hidden), (batch, seq, hidden)
        x = torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
        try:
            with torch.no_grad():
                want = twin(x)
            break
        except Exception:  # noqa: BLE001 (the other input shape)
            continue
    if want is None:
        return f"ep could not call it on a (tokens, {hidden}) or (batch, seq, {hidden}) probe"
    stand_in = ExpertCalls(len(real), _output_size(real[0], hidden, x))
    twin._modules["experts"] = stand_in
    calls = stand_in.begin()
    try:
        with torch.no_grad():
            twin(x)
            if not calls.recorded:
                return "its forward calls none of its experts on a probe"
            answers = []
            for e, rows in calls.recorded:  # each expert among other tokens, as on its rank
                flat = rows.reshape(-1, rows.shape[-1])
                before = torch.randn((2, flat.shape[1]), generator=generator, dtype=flat.dtype)
                after = torch.randn((3, flat.shape[1]), generator=generator, dtype=flat.dtype)
                out = real[e](torch.cat([before.to(device), flat, after.to(device)]))
                answers.append((e, out[2 : 2 + flat.shape[0]]))
            calls.answer_with(answers)
            got = twin(x)
            calls.finish()
    except Exception as error:  # noqa: BLE001 (said in the message)
        said = (str(error).splitlines() or [""])[0]
        return (
            "its forward uses its experts other than by calling each on its tokens, expert(x)"
            f" ({type(error).__name__}: {said})"
        )
    finally:
        stand_in.end()
    ours, theirs = tree_leaves(got), tree_leaves(want)
    pairs = [(a, b) for a, b in zip(ours, theirs) if isinstance(b, torch.Tensor)]
    scale = max((float(b.abs().max()) for _, b in pairs if b.numel()), default=0.0) + 1e-30
    if len(ours) != len(theirs) or any(
        not isinstance(a, torch.Tensor) or a.shape != b.shape or float((a - b).abs().max()) > 1e-9 * scale
        for a, b in pairs if b.numel()
    ):  # fmt: skip
        return (
            "its output changes when each expert runs on its tokens among other tokens (an"
            " expert's output for a token depends on the call's other tokens, or the forward"
            " is not repeatable): ep runs each expert once on its tokens from every rank"
        )
    return None


def _output_size(expert: nn.Module, hidden: int, like: torch.Tensor) -> int:
    with torch.no_grad():
        return int(expert(like.new_zeros((1, hidden))).shape[-1])


class _Calls:
    """One call of a block: the experts' calls recorded (first pass), then answered (second)."""

    def __init__(self, out_size: int):
        self.out_size = out_size
        self.recorded: list[tuple[int, torch.Tensor]] = []
        self.answers: dict[int, list[torch.Tensor]] | None = None

    def __call__(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.answers is None:
            self.recorded.append((e, x))
            return x.new_zeros((*x.shape[:-1], self.out_size))
        queue = self.answers.get(e)
        if not queue or queue[0].shape[:-1] != x.shape[:-1]:
            raise RuntimeError(_NOT_REPEATED)
        return queue.pop(0)

    def answer_with(self, outputs: list[tuple[int, torch.Tensor]]) -> None:
        """Each recorded call's output rows, reshaped as its input's rows."""
        self.answers = {}
        for (e, x), (_, out) in zip(self.recorded, outputs):
            self.answers.setdefault(e, []).append(out.reshape(*x.shape[:-1], out.shape[-1]))

    def finish(self) -> None:
        if self.answers is not None and any(self.answers.values()):
            raise RuntimeError(_NOT_REPEATED)


_NOT_REPEATED = (
    "an expert-parallel block called its experts differently in its two passes of one call:"
    " ep over an nn.ModuleList of experts runs the block's forward twice (with the same random"
    " draws), which must call the same experts on the same number of tokens"
)


class _ExpertCall:
    """``block.experts[e]`` while the block's forward runs: ``expert(x)`` goes to its rank."""

    def __init__(self, calls: _Calls, index: int):
        self.calls, self.index = calls, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expert {self.index} was called on a {type(x).__name__}")
        return self.calls(self.index, x)


class ExpertCalls(nn.Module):
    """Where the block's ``nn.ModuleList`` was: indexing and iterating give its experts' calls
    while the block's forward runs (``begin`` .. ``end``)."""

    def __init__(self, experts: int, out_size: int):
        super().__init__()
        self.serial_experts = experts  # the serial model's count (len(block.experts))
        self.out_size = out_size  # an expert's output features
        self.calls: _Calls | None = None

    def begin(self) -> _Calls:
        self.calls = _Calls(self.out_size)
        return self.calls

    def end(self) -> None:
        self.calls = None

    def __len__(self) -> int:
        return self.serial_experts

    def __getitem__(self, index: Any) -> _ExpertCall:
        if self.calls is None:
            raise RuntimeError(
                "the experts of an expert-parallel block are called inside its forward only"
                " (each rank holds some of them)"
            )
        i = operator.index(index)
        if not -self.serial_experts <= i < self.serial_experts:
            raise IndexError(f"expert {i} of {self.serial_experts}")
        return _ExpertCall(self.calls, i % self.serial_experts)

    def __iter__(self) -> Iterator[_ExpertCall]:
        return (self[i] for i in range(self.serial_experts))


class ExpertList(ExpertCalls):
    """The block's experts, dealt: each parameter stacked ``(experts, ...)`` under its name in
    the expert, this rank's experts local; their modules (on meta) run on slices of them."""

    def __init__(self, experts: nn.ModuleList, sizes: tuple[int, int], state: ExpertParallel):
        super().__init__(len(experts), sizes[1])
        self.in_size = sizes[0]  # an expert's input features (the router's)
        self.where = "experts"  # its name in the model, for messages
        self.num_experts = len(experts) // state.size  # this rank's, as for stacked experts
        self.shard = (state.rank, state.size)
        first = state.rank * self.num_experts
        self.names = [name for name, _ in experts[0].named_parameters()]
        for name in self.names:
            serial = [e.get_parameter(name) for e in experts]
            whole = torch.stack([p.detach() for p in serial]).requires_grad_(
                serial[0].requires_grad
            )
            # a copy, not a view at an offset of the stack (as ``_shard_experts``: DCP's async
            # save takes a DTensor over such a view for a plain tensor's storage)
            local = whole[first : first + self.num_experts].clone(
                memory_format=torch.contiguous_format
            )
            param = dtensor_parameter(whole, local, [Replicate(), Shard(0)], state.device_mesh)
            setattr(param, AVERAGED_HERE, True)
            owner: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]  # type: ignore[assignment]
            owner.register_parameter(leaf, param)
        # this rank's experts' own modules run the forward; their values are the stacked ones
        self.modules_here = [experts[i].to("meta") for i in range(first, first + self.num_experts)]
        self.register_state_dict_post_hook(_serial_keys)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_stacked_keys)  # type: ignore[no-untyped-call]

    def stacked(self) -> list[Any]:
        """The stacked DTensor parameters, in ``names``' order."""
        return [self.get_parameter(name) for name in self.names]


def deal_expert_lists(
    lists: list[tuple[str, nn.Module]], state: ExpertParallel, parameters: type[Function]
) -> list[tuple[str, nn.Module]]:
    """Each block's experts stacked and dealt (``ExpertList``), its forward routed.
    ``parameters`` gives the stacks' local tensors and reduces their gradients as stacked
    experts' are (``expert_parallel.ExpertParameters``)."""
    dealt: list[tuple[str, nn.Module]] = []
    for name, block in lists:
        experts: nn.ModuleList = block._modules["experts"]  # type: ignore[assignment]
        router = _router(block, len(experts))
        assert router is not None  # (list_problem checked)
        like = next(experts.parameters())
        out_size = _output_size(experts[0], router.in_features, like)
        held = ExpertList(experts, (router.in_features, out_size), state)
        block._modules["experts"] = held
        held.__dict__[OWN_SWAP] = True  # its stacks' local tensors: _run_experts, per call
        routes = ExpertRouter(state.group, state.rank, state.size, held.num_experts, state.traffic)
        passes = (held, routes, state, parameters, type(block).forward)
        block.forward = weakly_bound(_two_passes, block, *passes)
        held.where = f"{name}.experts" if name else "experts"
        dealt.append((held.where, held))
    return dealt


def _two_passes(
    block: nn.Module,
    experts: ExpertList,
    router: ExpertRouter,
    state: ExpertParallel,
    parameters: type[Function],
    forward: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    calls = experts.begin()
    try:
        before = _random_state()
        forward(block, *args, **kwargs)  # records the expert calls; its output is not used
        if torch.is_grad_enabled():
            _check_every_expert_called(experts, calls.recorded)
        ran = _run_experts(experts, router, (state, parameters), calls.recorded)
        calls.answer_with(ran)
        experts_done = _random_state()
        _set_random_state(before)  # the second pass draws what the first drew (dropout, jitter)
        out = forward(block, *args, **kwargs)
        calls.finish()
        _set_random_state(experts_done)  # (the second pass drew the first's again)
    finally:
        experts.end()
    return out


def _check_every_expert_called(experts: ExpertList, recorded: list[tuple[int, Any]]) -> None:
    """A forward that calls only the experts with tokens (``expert_hit``) leaves an expert no
    token on any rank reached without a gradient serially (None: the optimizer skips it), but
    its stacked slice gets zeros here (weight decay, momentum and Adam's step count would move
    it): that step is refused, on every rank alike (the calls are counted over every rank)."""
    called = torch.zeros(experts.serial_experts, dtype=torch.int64)
    for e, _ in recorded:
        called[e] = 1
    dist.all_reduce(called, op=dist.ReduceOp.MAX)
    missing = (called == 0).nonzero().flatten().tolist()
    if missing:
        raise RuntimeError(
            f"{experts.where}: expert {missing[0]} got no token on any rank and the block's"
            " forward did not call it, so serially it has no gradient and the optimizer skips"
            " it; ep's stacked experts would step it with a zero gradient: call every expert"
            " (for e, expert in enumerate(self.experts), empty calls included) to train with"
            " experts that may get no tokens"
        )


def _random_state() -> list[torch.Tensor]:
    """The CPU generator's state, and the current accelerator's (CUDA)."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _set_random_state(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def _run_experts(
    experts: ExpertList,
    router: ExpertRouter,
    reduced: tuple[ExpertParallel, type[Function]],
    recorded: list[tuple[int, torch.Tensor]],
) -> list[tuple[int, torch.Tensor]]:
    """Every recorded call's rows through its expert on its rank, and back (one dispatch and
    one combine per block call, on every rank, whatever it recorded)."""
    state, parameters = reduced
    params = experts.stacked()
    grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    if grad:
        local = parameters.apply(state, *params)
    else:
        local = [p.to_local() for p in params]
    rows = [x.reshape(-1, x.shape[-1]) for _, x in recorded]
    send = torch.cat(rows) if rows else local[0].new_zeros((0, experts.in_size))
    if grad and not send.requires_grad:  # its backward all-to-all must run as the others' do
        send = send.detach().requires_grad_()
    ids = torch.cat([torch.full((r.shape[0],), e, dtype=torch.long, device=send.device)
                     for (e, _), r in zip(recorded, rows)]) if rows else \
        torch.zeros((0,), dtype=torch.long, device=send.device)  # fmt: skip
    index = ids.unsqueeze(-1)
    recv, routes = router.dispatch(send, index)
    mine = routes.recv_experts[:, 0]
    order = torch.argsort(mine, stable=True)
    counts = torch.bincount(mine, minlength=experts.num_experts).tolist()
    outs = [
        functional_call(module, {n: t[j] for n, t in zip(experts.names, local)}, (piece,))
        for j, (module, piece) in enumerate(zip(experts.modules_here, recv[order].split(counts)))
        if piece.shape[0]
    ]
    if outs:
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        out = torch.cat(outs)[inverse]
    else:  # no rows here: one row of zeros keeps the experts and the reverse all-to-all in
        # backward (zero gradients, as serially), in step with the other ranks'
        module = experts.modules_here[0]
        first = {n: t[0] for n, t in zip(experts.names, local)}
        out = functional_call(module, first, (recv.sum(dim=0, keepdim=True),))[:0]
    ones = torch.ones((send.shape[0], 1), dtype=send.dtype, device=send.device)
    like = send.new_zeros((send.shape[0], out.shape[-1]))
    back = router.combine(out, routes, index, ones, like)  # (x 1, + 0: the outputs exactly)
    return list(zip([e for e, _ in recorded], back.split([r.shape[0] for r in rows])))


def _serial_keys(module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    """The serial model's keys and whole values: ``experts.3.fc1.weight`` (a gather)."""
    assert isinstance(module, ExpertList)
    whole = {}
    for name in module.names:
        value = state_dict.pop(prefix + name).detach()
        whole[name] = value.full_tensor() if isinstance(value, DTensor) else value
    for i in range(module.serial_experts):
        for name in module.names:
            state_dict[f"{prefix}{i}.{name}"] = whole[name][i].clone()


def _stacked_keys(module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    """``load_state_dict`` of the serial keys: each rank keeps its experts, stacked."""
    assert isinstance(module, ExpertList)
    rank, size = module.shard
    for name in module.names:
        keys = [f"{prefix}{i}.{name}" for i in range(module.serial_experts)]
        if not all(k in state_dict for k in keys):
            continue  # (torch names the missing key)
        values = [state_dict.pop(k) for k in keys]
        whole = torch.stack([v.full_tensor() if isinstance(v, DTensor) else v for v in values])
        param = module.get_parameter(name)
        assert isinstance(param, DTensor)
        local = whole.chunk(size)[rank].to(param.to_local().device, param.dtype).contiguous()
        state_dict[prefix + name] = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
