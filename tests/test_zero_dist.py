"""ZeRO-1 (macrogen.runtime.zero) on 2 and 4 gloo ranks, against serial and torch ZeroRedundancyOptimizer.

A @data_parallel GPT with its AdamW (nanoGPT's two parameter groups: decay for
matrices, none for biases and norms) sharded; the serial GPT with the plain
AdamW on the whole batch; DDP with torch's ZeroRedundancyOptimizer. Parameters
after 5 steps must agree; the state_dict is the serial optimizer's and loads
back; each rank holds about 1/world of the optimizer state.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import macrogen as mg
from macrogen.runtime.data_parallel import gradient_sync
from macrogen.runtime.zero import ShardedOptimizer, shard_optimizer
from macrogen.runtime.zero_grads import ShardedGradientError
from tests.distributed import run_ranks
from tests.test_data_parallel_dist import (
    GLOBAL_BATCH,
    CountAllReduce,
    assert_params_close,
    expanded_models,
    micro_batches,
    tiny_config,
)

STEPS = 5
FP32 = dict(rtol=1e-5, atol=1e-6)
# Attention's key bias gets a gradient that is 0 in exact arithmetic (softmax ignores a
# shift shared by all keys); Adam divides its rounding noise by its own size, so where a
# sum is taken in another order (one batch serially, two halves here and in DDP) the
# key bias moves differently (so it does between DDP and serial, and between 2 and 4
# ranks). It is left out of the comparisons.
NOISE_ONLY = ("blocks.0.attn.qkv.bias",)


def nanogpt_groups(model, weight_decay=0.1):
    """nanoGPT's configure_optimizers: decay 2-D weights, not biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def train(model, opt, batch, steps=STEPS, scheduler=None):
    for _ in range(steps):
        opt.zero_grad()
        model(*batch).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _zero_cases(rank: int, world: int, out_dir: str) -> dict:
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config(unused_head=True)  # one parameter no rank uses: its grad stays None
    inputs = batch(config, GLOBAL_BATCH, seed=7)
    mine = micro_batches(inputs, 1, rank, world)[0]
    report = {}
    for name, make in (("adamw", adamw), ("sgd", sgd)):
        torch.manual_seed(0)
        serial = GPT(config)
        serial_opt = make(nanogpt_groups(serial))
        sched = torch.optim.lr_scheduler.StepLR(serial_opt, step_size=2, gamma=0.5)
        train(serial, serial_opt, inputs, scheduler=sched)

        torch.manual_seed(0)
        ours = models.Plain(config)
        opt = shard_optimizer(make(nanogpt_groups(ours)))
        assert isinstance(opt, ShardedOptimizer)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        with CountAllReduce() as count:
            train(ours, opt, mine, scheduler=sched)
        # (one 1-element all-reduce per step: do all ranks still hold the gradients they sent?)
        assert set(count.sizes) == {1}, "gradients are reduce-scattered, not all-reduced"
        assert gradient_sync(ours).gradients_elsewhere
        skip = NOISE_ONLY if name == "adamw" else ()
        assert_params_close(ours, serial, f"ZeRO {name} vs serial", skip=skip, **FP32)
        assert ours.unused.weight.grad is None and serial.unused.weight.grad is None

        # the serial optimizer's state_dict, consolidated on every rank
        got, want = opt.state_dict(), serial_opt.state_dict()
        assert got["param_groups"] == want["param_groups"], name
        assert sorted(got["state"]) == sorted(want["state"]), name
        noisy = {i for i, (n, _) in enumerate(serial.named_parameters()) if n in skip}
        for i, state in want["state"].items():
            for key, value in state.items():
                if not (i in noisy and key == "exp_avg_sq"):
                    torch.testing.assert_close(got["state"][i][key], value, msg=f"{name} {i} {key}")
        if name == "adamw":
            # 1/world of the state: the two moments of this rank's share (+ a step per piece)
            full = sum(v.numel() * 4 for s in want["state"].values() for v in s.values())
            report["state_fraction"] = opt.state_bytes() / full
            # serial -> sharded: load the serial checkpoint and take one more step on both
            fresh = ShardedOptimizer(adamw(nanogpt_groups(ours)))
            fresh.load_state_dict(want)
            train(serial, serial_opt, inputs, steps=1)
            train(ours, fresh, mine, steps=1)
            assert_params_close(ours, serial, "from the serial state_dict", skip=skip, **FP32)
            # sharded -> serial
            again = adamw(nanogpt_groups(serial))
            again.load_state_dict(fresh.state_dict())
            train(serial, again, inputs, steps=1)
            train(ours, fresh, mine, steps=1)
            assert_params_close(ours, serial, "from the sharded state", skip=skip, **FP32)
    return report


def _zero_vs_torch(rank: int, world: int, out_dir: str) -> dict:
    """5 AdamW steps: ours, serial and DDP + ZeroRedundancyOptimizer agree."""
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=3)
    mine = micro_batches(inputs, 1, rank, world)[0]
    torch.manual_seed(0)
    serial = GPT(config)
    train(serial, adamw(serial.parameters()), inputs)
    torch.manual_seed(0)
    ref_model = GPT(config)
    ref = DDP(ref_model)
    train(ref, ZeroRedundancyOptimizer(ref.parameters(), torch.optim.AdamW, lr=1e-2,
                                       betas=(0.9, 0.95)), mine)  # fmt: skip
    torch.manual_seed(0)
    ours = models.Plain(config)
    opt = models.sharded_adamw(ours.parameters())  # an expanded mg.shard_optimizer site
    assert isinstance(opt, ShardedOptimizer)
    train(ours, opt, mine)
    return {
        "pieces": len(opt.pieces),
        "vs torch ZeRO": worst_error(ours, ref_model),
        "vs serial": worst_error(ours, serial),
        "checksum": sum(p.detach().double().sum().item() for p in ours.parameters()),
    }


def worst_error(got: torch.nn.Module, want: torch.nn.Module) -> tuple[float, str]:
    """The largest ``|got - want|`` over the parameters (less NOISE_ONLY), as a multiple of
    what FP32 allows there (``atol + rtol * |want|``, torch.testing.assert_close's test),
    and the parameter's name: the parent asserts it is at most 1."""
    worst, where = 0.0, ""
    for (name, a), (name_b, b) in zip(got.named_parameters(), want.named_parameters()):
        assert name == name_b, (name, name_b)
        if name in NOISE_ONLY:
            continue
        a, b = a.detach().double(), b.detach().double()
        allowed = FP32["atol"] + FP32["rtol"] * b.abs()
        ratio = ((a - b).abs() / allowed).max().item()
        if ratio > worst:
            worst, where = ratio, name
    return worst, where


def test_sharded_adamw_and_sgd_equal_serial_and_round_trip_the_state_dict(tmp_path):
    results = run_ranks(_zero_cases, 2, args=(str(tmp_path),), timeout=150)
    for r in results:
        assert 0.45 <= r["state_fraction"] <= 0.56, r


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_adamw_equals_torch_zero_redundancy_optimizer(tmp_path, world):
    results = run_ranks(_zero_vs_torch, world, args=(str(tmp_path),), timeout=180)
    for rank, r in enumerate(results):
        assert r["pieces"] > 0, (rank, r)
        for rival in ("vs torch ZeRO", "vs serial"):
            error, name = r[rival]
            assert error <= 1, (
                f"rank {rank}: ZeRO on {world} ranks {rival}: {name} is {error:.3g} x FP32's tolerance off"
            )
    # every rank ends with the same parameters (each stepped its shard, then gathered)
    assert len({r["checksum"] for r in results}) == 1, [r["checksum"] for r in results]


def test_world_size_one_returns_the_optimizer_itself():
    layer = torch.nn.Linear(2, 2)
    opt = sgd(layer.parameters())
    assert shard_optimizer(opt) is opt
    layer(torch.ones(1, 2)).sum().backward()
    norm = layer.weight.grad.norm().hypot(layer.bias.grad.norm())
    torch.testing.assert_close(mg.clip_grad_norm_(opt, 0.1), norm)  # torch's, unsharded
    torch.testing.assert_close(
        layer.weight.grad.norm().hypot(layer.bias.grad.norm()),
        torch.tensor(0.1),
        rtol=1e-4,
        atol=1e-5,
    )


def test_optimizers_that_are_not_elementwise_are_refused(monkeypatch):
    import macrogen.runtime.groups as groups

    monkeypatch.setattr(groups, "world_size", lambda group=None: 2)
    lbfgs = torch.optim.LBFGS(torch.nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="LBFGS does not update each element on its own"):
        shard_optimizer(lbfgs)


def _overlap_cases(rank: int, world: int, out_dir: str) -> dict:
    """The overlapped step: gradients sent during backward, parameters written where read.

    Several buckets (ManyBuckets' plan). Whatever reads the parameters between
    step() and the next forward reads the updated values; gradients that change
    after backward (another backward, an in-place change the shares can't take)
    are sent again from step(), a scalar write or a GradScaler's unscale acts on
    the averaged shares; every step equals the serial program's.
    """
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=5)
    mine = micro_batches(inputs, 1, rank, world)[0]
    torch.manual_seed(0)
    serial = GPT(config)
    serial_opt = sgd(serial.parameters())
    torch.manual_seed(0)
    ours = models.ManyBuckets(config)
    opt = shard_optimizer(sgd(ours.parameters()))
    assert len(opt.buckets) >= 3, len(opt.buckets)
    report: dict = {}

    def both(*, micro: int = 1, change=None) -> None:
        for model, o, rows in ((serial, serial_opt, 1), (ours, opt, world)):
            o.zero_grad()
            for piece in micro_batches(inputs, micro, rank if rows > 1 else 0, rows):
                (model(*piece) / micro).backward()
            for p in model.parameters() if change else ():
                if p.grad is not None:
                    change(p.grad)
            o.step()

    # 1. sent during backward, all of it; nothing sent again
    opt.zero_grad()
    ours(*mine).backward()
    assert opt._launched == len(opt.buckets), "every bucket left during backward"
    opt.step()
    serial_opt.zero_grad()
    serial(*inputs).backward()
    serial_opt.step()
    assert opt.resends == 0
    # the parameters are in flight; reading one waits for its bucket only (and earlier ones)
    assert id(ours.lm_head.weight) in opt.watch.in_flight
    _ = ours.wte.weight * 1  # the first bucket gathered: the forward's first layer
    assert id(ours.wte.weight) not in opt.watch.in_flight
    assert id(ours.lm_head.weight) in opt.watch.in_flight, "the last layer's bucket is still out"
    saved = {k: v.clone() for k, v in ours.state_dict().items()}  # a checkpoint, now
    doubled = [p * 2 for p in ours.parameters()]  # an EMA-like read
    opt.finish_gather()
    for (k, p), d in zip(ours.named_parameters(), doubled):
        assert torch.equal(saved[k], p), f"state_dict() read a stale {k}"
        assert torch.equal(d, p * 2), f"a torch op read a stale {k}"
    assert_params_close(ours, serial, "step 1", **FP32)

    # 2. no_grad inference on rank 0 only, between step() and the next forward
    both()
    if rank == 0:
        with torch.no_grad():
            early = ours(*mine)
        opt.finish_gather()
        with torch.no_grad():
            assert torch.equal(early, ours(*mine)), "inference read stale parameters"
    # the parameters are views of the gathered buffers: stepped and gathered in place
    for bucket in opt.buckets:
        assert all(bucket.bound), "every parameter of this GPT can be a view"
        base = bucket.full.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == base for p in bucket.params)
    # .data replaced (bound again at the step, its values taken), or strided (copied in and out)
    fc = ours.blocks[0].mlp.fc.weight
    ours.wte.weight.data = ours.wte.weight.data.clone()
    fc.data = fc.data.t().contiguous().t()
    both()
    assert (
        ours.wte.weight.untyped_storage().data_ptr()
        == opt.buckets[-1].full.untyped_storage().data_ptr()
    )
    assert not fc.is_contiguous() and not opt.buckets[opt._slot[10][0]].bound[opt._slot[10][1]]
    assert_params_close(ours, serial, "re-bound and strided parameters", **FP32)
    # 3. two backwards before step(): the first one's sends are out of date
    both(micro=2)
    assert opt.resends == 1
    # 4. gradients written after backward (in place) in a way the shares can't take: sent again
    both(change=lambda g: g.add_(g))
    assert opt.resends == 2
    both()
    assert opt.resends == 2
    # ... by a scalar, as clip_grad_norm_ or clip_grad_value_ would: done to the shares
    both(change=lambda g: g.mul_(0.5))
    both(change=lambda g: g.clamp_(-1e-3, 1e-3))
    assert opt.resends == 2
    assert_params_close(ours, serial, "scalar writes", **FP32)
    # 5. a GradScaler's unscale_ (its kernel bumps no version counter): unscales the shares
    for model, o, b in ((serial, serial_opt, inputs), (ours, opt, mine)):
        o.zero_grad()
        model(*b).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), torch.tensor(0.5))
        o.step()
    assert opt.resends == 2
    assert_params_close(ours, serial, "after 8 steps", **FP32)
    report["buckets"] = len(opt.buckets)

    # @data_parallel(accumulate=4): only the 4th backward sends, nothing is sent twice
    torch.manual_seed(0)
    serial = GPT(config)
    serial_opt = sgd(serial.parameters())
    torch.manual_seed(0)
    ours = models.Accumulating(config)
    opt = shard_optimizer(sgd(ours.parameters()))
    for _ in range(2):
        both(micro=4)
    assert opt.resends == 0
    assert_params_close(ours, serial, "accumulate=4", **FP32)
    return report


def test_overlapped_step_never_reads_stale_parameters_or_gradients(tmp_path):
    results = run_ranks(_overlap_cases, 2, args=(str(tmp_path),), timeout=150)
    assert all(r["buckets"] >= 3 for r in results)


def _torch_clip(opt, params, limit, norm_type):
    return torch.nn.utils.clip_grad_norm_(params, limit, norm_type)


def _torch_clip_loop(opt, params, limit, norm_type):  # one norm per tensor, one mul_ per tensor
    return torch.nn.utils.clip_grad_norm_(params, limit, norm_type, foreach=False)


def _torch_clip_in_two(opt, params, limit, norm_type):
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, limit, norm)
    return norm


def _sharded_clip(opt, params, limit, norm_type):
    return opt.clip_grad_norm_(limit, norm_type=norm_type)


def _macrogen_clip(opt, params, limit, norm_type):  # (it also runs unsharded)
    return mg.clip_grad_norm_(opt, limit, norm_type)


CLIPS = (
    (2.0, _torch_clip),
    (2.0, _sharded_clip),
    (math.inf, _torch_clip_loop),
    (1.0, _torch_clip_in_two),
    (math.inf, _macrogen_clip),
    (1.0, _torch_clip),
    (2.0, _torch_clip_loop),
)


def _clip_cases(rank: int, world: int, out_dir: str) -> dict:
    """Clipping after backward, as the serial program clips: torch's clip_grad_norm_ (and its
    parts) of the local .grads, opt.clip_grad_norm_ and mg.clip_grad_norm_ all clip by the
    averaged gradients' norm and return it; clip_grad_value_ clamps the averaged gradients."""
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=11)
    mine = micro_batches(inputs, 1, rank, world)[0]
    torch.manual_seed(0)
    serial = GPT(config)
    serial_opt = adamw(serial.parameters())
    torch.manual_seed(0)
    ours = models.ManyBuckets(config)
    opt = shard_optimizer(adamw(ours.parameters()))
    params = list(ours.parameters())
    report: dict = {"norms": []}
    for norm_type, clip in CLIPS:
        serial_opt.zero_grad()
        serial(*inputs).backward()
        grads = [p.grad for p in serial.parameters() if p.grad is not None]
        # half the serial norm: the clipping triggers (every rank computes the same serial run)
        limit = float(torch.nn.utils.get_total_norm(grads, norm_type)) / 2
        want = torch.nn.utils.clip_grad_norm_(serial.parameters(), limit, norm_type)
        serial_opt.step()
        opt.zero_grad()
        ours(*mine).backward()
        got = clip(opt, params, limit, norm_type)
        opt.step()
        torch.testing.assert_close(got, want, **FP32, msg=f"{clip.__name__} {norm_type}")
        report["norms"].append(float(got))
    for model, o, rows in ((serial, serial_opt, inputs), (ours, opt, mine)):
        o.zero_grad()
        model(*rows).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        o.step()
    assert opt.resends == 0, "the shares sent during backward were clipped, not sent again"
    assert_params_close(ours, serial, "clipped ZeRO vs serial", skip=NOISE_ONLY, **FP32)

    # what the shares can't give is refused, on every rank, before any collective
    opt.zero_grad()
    ours(*mine).backward()
    grad = params[0].grad
    for refused, why in (
        (lambda: grad.norm(dim=0), "along a dim"),
        (lambda: torch._foreach_norm([grad, torch.ones(3)]), "mixes them"),
        (lambda: torch.linalg.vector_norm(grad, -1.0), "ord=-1.0"),
        (lambda: grad.mul_(torch.ones_like(grad)), "not scalars"),
    ):
        with pytest.raises(ShardedGradientError, match=why):
            refused()
    torch.nn.utils.clip_grad_norm_(params, 0.05)
    grad.add_(1.0)  # written after the clip averaged them: step() would lose it
    with pytest.raises(ShardedGradientError, match=r"written after the gradients were averaged"):
        opt.step()
    opt.zero_grad()
    ours(*mine).backward()
    opt.step()
    _ = params[0].grad.norm()  # after step(): logging a local norm is the user's business
    opt.zero_grad()
    return report


def test_clip_grad_norm_of_the_sharded_optimizer_equals_serial(tmp_path):
    results = run_ranks(_clip_cases, 2, args=(str(tmp_path),), timeout=150)
    assert results[0]["norms"] == results[1]["norms"]


def _scaler_cases(rank: int, world: int, out_dir: str) -> dict:
    """torch.amp.GradScaler: an inf in one rank's gradients makes every rank skip the step."""
    from examples.gpt import GPT, batch

    models = expanded_models(out_dir, rank)
    config = tiny_config()
    inputs = batch(config, GLOBAL_BATCH, seed=13)
    mine = micro_batches(inputs, 1, rank, world)[0]
    torch.manual_seed(0)
    serial = GPT(config)
    serial_opt = sgd(serial.parameters())
    torch.manual_seed(0)
    ours = models.ManyBuckets(config)
    opt = shard_optimizer(sgd(ours.parameters()))
    # a parameter that lies in rank 0's chunk of its bucket: the inf goes into rank 1's
    # local gradient only, so only rank 1's own inf check would see it
    poisoned = opt.buckets[0].params[0]
    assert opt.buckets[0].offsets[0] < opt.buckets[0].chunk
    name = next(n for n, p in ours.named_parameters() if p is poisoned)
    report: dict = {"scales": [], "skipped": []}
    scalers = {id(serial_opt): torch.amp.GradScaler("cpu", init_scale=2.0**10),
               id(opt): torch.amp.GradScaler("cpu", init_scale=2.0**10)}  # fmt: skip
    for step in range(4):
        before = [p.detach().clone() for p in ours.parameters()]
        for model, o, rows, poison in (
            (serial, serial_opt, inputs, step == 1),
            (ours, opt, mine, step == 1 and rank == 1),
        ):
            scaler = scalers[id(o)]
            o.zero_grad()
            scaler.scale(model(*rows)).backward()
            if poison:
                dict(model.named_parameters())[name].grad.view(-1)[0] = float("inf")
            if step == 2:  # unscaled by hand, then clipped (the averaged gradients' norm)
                scaler.unscale_(o)
                mg.clip_grad_norm_(o, 0.05)
            scaler.step(o)
            scaler.update()
        opt.finish_gather()
        skipped = all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))
        report["skipped"].append(skipped)
        report["scales"].append(scalers[id(opt)].get_scale())
        assert report["scales"][-1] == scalers[id(serial_opt)].get_scale(), step
        assert_params_close(ours, serial, f"GradScaler step {step}", **FP32)
    report["params"] = [p.detach().clone() for p in ours.parameters()]
    return report


def test_grad_scaler_skips_the_step_on_every_rank_when_one_rank_finds_an_inf(tmp_path):
    results = run_ranks(_scaler_cases, 2, args=(str(tmp_path),), timeout=150)
    for r in results:
        assert r["skipped"] == [False, True, False, False], r["skipped"]
        assert r["scales"][1] == r["scales"][0] / 2, "the scale backed off on every rank"
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "the ranks' parameters parted"
