"""``mg.parallelize`` on models people train, built as they build them, against the serial model.

Each case expands a small training file (the unexpanded file is the serial
program), runs it on gloo ranks, and compares with the same file run serially
in the same process: initial weights (exactly), losses, gradients and
parameters after 3 AdamW steps (float64, within 1e-10), ``num_parameters()``,
the global gradient norm from torch's ``clip_grad_norm_``, and
``save_pretrained`` -> ``from_pretrained``.

Models: transformers' ``LlamaForCausalLM`` (grouped-query attention, the plan it
ships: ``tp_plan="hf"``) and ``GPT2LMHeadModel`` (HF ``Conv1D`` layers, a packed
qkv, tied embedding and head), and a model of the tests' own whose classes a
registry captured when they were defined and which is built through it, as
torchtitan's ``Config.build()`` does.
"""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import expand, load_module

pytest.importorskip("transformers")

SOURCE = textwrap.dedent(
    '''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import macrogen as mg
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    TP = mg.define(2)
    VOCAB = 128

    REGISTRY = {}


    def register(name):
        def keep(cls):
            REGISTRY[name] = cls  # the class object, captured at definition (torchtitan's build())
            return cls
        return keep


    @register("linear")
    class Linear(nn.Linear):
        """torchtitan's own Linear: a subclass of nn.Linear."""


    @register("mlp")
    class FeedForward(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.w1 = REGISTRY["linear"](dim, hidden, bias=False)
            self.w3 = REGISTRY["linear"](dim, hidden, bias=False)
            self.w2 = REGISTRY["linear"](hidden, dim, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))


    @register("model")
    class Tiny(nn.Module):
        def __init__(self, dim=32, layers=2):
            super().__init__()
            self.tok = nn.Embedding(VOCAB, dim)
            self.layers = nn.ModuleList(REGISTRY["mlp"](dim, 4 * dim) for _ in range(layers))
            self.norm = nn.LayerNorm(dim)
            self.out = nn.Linear(dim, VOCAB, bias=False)
            for layer in self.layers:  # the parent re-initializes its children after building them
                nn.init.normal_(layer.w2.weight, std=0.02 / (2 * layers) ** 0.5)

        def forward(self, input_ids, labels):
            x = self.tok(input_ids)
            for layer in self.layers:
                x = x + layer(x)
            logits = self.out(self.norm(x))
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
            return type("Out", (), {"loss": loss})()


    def llama():
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64)
        return LlamaForCausalLM(config)


    def gpt2():
        config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(config)


    def tiny():
        return REGISTRY["model"]()


    def parallel_llama(model, dp):
        if dp:
            return mg.parallelize(model, tp=TP, tp_plan="hf", dp="replicate")
        return mg.parallelize(model, tp=TP, tp_plan="hf", dp="none")


    def parallel_gpt2(model, dp):
        if dp:
            return mg.parallelize(model, tp=TP, dp="replicate", tp_plan={
                "transformer.h.*.attn.c_attn": ("colwise", 3),
                "transformer.h.*.attn.c_proj": "rowwise",
                "transformer.h.*.attn.split_size": "divide",
                "transformer.h.*.attn.num_heads": "divide",
                "transformer.h.*.mlp.c_fc": "colwise",
                "transformer.h.*.mlp.c_proj": "rowwise",
            })
        return mg.parallelize(model, tp=TP, dp="none", tp_plan={
            "transformer.h.*.attn.c_attn": ("colwise", 3),
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.attn.split_size": "divide",
            "transformer.h.*.attn.num_heads": "divide",
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
        })


    def parallel_tiny(model, dp):
        if dp:
            return mg.parallelize(model, tp=TP, dp="replicate", tp_plan={
                "tok": "vocab",
                "layers.*.w1": "colwise",
                "layers.*.w3": "colwise",
                "layers.*.w2": "rowwise",
                "out": "colwise_gather_output",
            })
        return mg.parallelize(model, tp=TP, dp="none", tp_plan={
            "tok": "vocab",
            "layers.*.w1": "colwise",
            "layers.*.w3": "colwise",
            "layers.*.w2": "rowwise",
            "out": "colwise_gather_output",
        })
    '''
)

BUILDERS = {"llama": "parallel_llama", "gpt2": "parallel_gpt2", "tiny": "parallel_tiny"}
STEPS, BATCH, SEQ = 3, 4, 16


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(module, model, rows: slice):
    """3 AdamW steps; (losses, grads after the first backward, norms) on this rank's rows."""
    # foreach: CUDA's default step (CPU's is the loop), which refuses a mix of DTensor and
    # plain parameters (torch TP's); ours keeps plain tensors, so it runs on a GPU as it is
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(1)
    losses, norms, first = [], [], None
    for _ in range(STEPS):
        ids = torch.randint(0, module.VOCAB, (BATCH, SEQ), generator=gen)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first is None:
            first = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first, norms


def _parity(rank, world, tmp, kind, dp):
    import torch.distributed as dist

    import macrogen as mg

    torch.set_default_dtype(torch.float64)
    unexpanded = load_module(SOURCE, f"serial_{kind}_{rank}", Path(tmp))
    module = load_module(expand(SOURCE), f"expanded_{kind}_{rank}", Path(tmp))
    build = getattr(module, kind)

    torch.manual_seed(0)
    serial = getattr(unexpanded, kind)()
    serial_count = sum(p.numel() for p in serial.parameters())
    initial = {k: v.clone() for k, v in serial.state_dict().items()}
    ref_losses, ref_grads, ref_norms = _train(unexpanded, serial, slice(None))

    # the second rank of each tensor group builds from another seed: its group's first rank's
    # model is the one cut (as torch's distribute_tensor takes rank 0's), not a shard of each
    # rank's own (data parallel then broadcasts rank 0's over the data ranks, as DDP does)
    torch.manual_seed(0 if rank % 2 == 0 else 1 + rank)
    model = getattr(module, BUILDERS[kind])(build(), dp)
    assert type(model).__module__ == module.__name__ or kind != "tiny"  # the user's class, kept
    count = sum(p.numel() for p in model.parameters())
    state = {k: _full(v) for k, v in model.state_dict().items()}
    for key, value in initial.items():  # the serial initialization, exactly
        assert torch.equal(state[key], value), key
    mesh = mg.mesh(model)  # the mesh it was parallelized on: the program's
    assert mesh is mg.mesh()
    assert mesh.tensor_size == 2 and mesh.data_size == world // 2
    share = BATCH // mesh.data_size
    rows = slice(mesh.data_rank * share, (mesh.data_rank + 1) * share)
    losses, grads, norms = _train(module, model, rows)
    if mesh.data_size == 1:  # one data rank: the same batch, the same loss
        torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-10)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=1e-10, msg=name)
    torch.testing.assert_close(norms, ref_norms, rtol=1e-10, atol=0)
    final = {k: _full(v) for k, v in model.state_dict().items()}
    for key, value in serial.state_dict().items():
        torch.testing.assert_close(final[key], value, rtol=0, atol=1e-10, msg=key)
    if hasattr(model, "save_pretrained"):  # every rank calls it; the shards are gathered
        folder = Path(tmp) / f"saved_{kind}"
        model.save_pretrained(folder, is_main_process=rank == 0)
        dist.barrier()
        loaded = type(serial).from_pretrained(folder, torch_dtype=torch.float64)
        for key, value in loaded.state_dict().items():
            torch.testing.assert_close(value, final[key], rtol=0, atol=0, msg=key)
        assert model.num_parameters() == serial.num_parameters()
    if mesh.data_size > 1:
        _gradients_leave_each_block_as_its_backward_ends(model, module)
    sharded = [n for n, p in model.named_parameters() if "Shard" in type(p.placements[0]).__name__]
    return count, serial_count, len(sharded), type(model).__name__


def _gradients_leave_each_block_as_its_backward_ends(model, module):
    """Under data parallel the last block's gradients reach the buckets before the first block's
    backward ends (one swap for the whole model handed every gradient over at the very end)."""
    from macrogen.runtime.blocks import repeated_layers

    blocks = [b for _, b in repeated_layers(model)]
    order = []
    last = next(p for p in blocks[-1].parameters() if p.requires_grad)
    handles = [last.register_post_accumulate_grad_hook(lambda _: order.append("last block"))]

    def first_input(_, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        if x.requires_grad:
            x.register_hook(lambda _: order.append("first block's input"))

    handles.append(blocks[0].register_forward_pre_hook(first_input, with_kwargs=True))
    ids = torch.randint(0, module.VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    for handle in handles:
        handle.remove()
    assert order == ["last block", "first block's input"], order


@pytest.mark.parametrize("kind", ["llama", "gpt2", "tiny"])
def test_tensor_parallel_on_two_ranks(tmp_path, kind):
    results = run_ranks(_parity, 2, args=(str(tmp_path), kind, False), timeout=300)
    count, serial_count, sharded, cls = results[0]
    assert count == serial_count  # numel sees the serial model
    assert sharded >= 4
    assert cls == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "tiny": "Tiny"}[kind]


@pytest.mark.parametrize("kind", ["llama", "tiny"])
def test_data_x_tensor_parallel_on_four_ranks(tmp_path, kind):
    run_ranks(_parity, 4, args=(str(tmp_path), kind, True), timeout=400)


def _against_torch_tp(rank, world, tmp):
    """fp32: our Llama against torch's parallelize_module (DTensor) on the same weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    module = load_module(expand(SOURCE), f"expanded_torch_{rank}", Path(tmp))
    torch.manual_seed(0)
    ours = module.parallel_llama(module.llama(), False)
    torch.manual_seed(0)
    theirs = module.llama()
    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(len(theirs.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):  # fmt: skip
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(theirs, mesh, plan)
    outs = []
    for model in (ours, theirs):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            ids = torch.randint(0, module.VOCAB, (2, SEQ), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        outs.append({k: _full(v) for k, v in model.state_dict().items()})
    for key, value in outs[1].items():
        torch.testing.assert_close(outs[0][key], value, rtol=0, atol=1e-5, msg=key)


def test_float32_matches_torch_parallelize_module(tmp_path):
    run_ranks(_against_torch_tp, 2, args=(str(tmp_path),), timeout=300)


def _errors(rank, world, tmp):
    import torch.nn as nn

    from macrogen.runtime import parallelize as P

    model = nn.Sequential(nn.Linear(6, 9), nn.Conv2d(1, 1, 1), nn.Linear(9, 6))
    mesh = P.device_mesh(tp=2, planned=True, where="t.py:1")
    with pytest.raises(P.PlanError) as e:  # every problem of the plan at once, each by path
        P.apply_tensor_parallel(
            model, mesh, {"0": "colwise", "1": "rowwise", "3": "colwise", "2": "colwsie"},
            where="t.py:1",
        )  # fmt: skip
    lines = str(e.value).splitlines()
    assert len(lines) == 4, lines
    assert lines[0] == "0: 9 out features are not divisible by tp=2"
    assert lines[1].startswith(
        "1: rowwise needs an nn.Linear (or a subclass) or an HF Conv1D, not Conv2d"
    )
    assert lines[2].startswith("3: matches nothing in Sequential")
    assert lines[3].startswith("2: unknown style 'colwsie'")
    # a plan with tp=1 in a job of two ranks: a warning naming the site
    from macrogen.runtime import mesh as meshes

    meshes.reset()  # (a program has one mesh: this check starts another program's)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        P.device_mesh(tp=1, planned=True, where="t.py:9")
    assert any("t.py:9: a tensor-parallel plan with tp=1" in str(w.message) for w in caught)
    # a degree that does not divide the world: an error before any group is made
    with pytest.raises(ValueError, match="tp=3 does not divide the world size 2"):
        P.device_mesh(tp=3, planned=True, where="t.py:5")
    return True


def _sharded_logits(rank, world, tmp):
    import torch.nn as nn

    from macrogen.runtime import parallelize as P

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16))  # the last one: an LM head
    mesh = P.device_mesh(tp=2, planned=True, where="t.py:2")
    P.apply_tensor_parallel(model, mesh, {"1": "colwise"}, where="t.py:2")
    with pytest.raises(P.PlanError, match=r"1 is colwise, and the model returns its output.*'colwise_gather_output'"):  # fmt: skip
        model(torch.randn(2, 8))
    return True


def test_a_colwise_output_the_model_returns_is_an_error(tmp_path):
    assert run_ranks(_sharded_logits, 2, args=(str(tmp_path),), timeout=120) == [True, True]


def test_plan_errors_all_at_once_and_degrees_checked(tmp_path):
    assert run_ranks(_errors, 2, args=(str(tmp_path),), timeout=120) == [True, True]


def _ranks_disagree(rank, world, tmp):
    import torch.nn as nn

    from macrogen.runtime import parallelize as P
    from macrogen.runtime.agreement import RankMismatchError

    class Attention(nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.n_head = heads
            self.qkv = nn.Linear(8, 24)

    model = Attention(4 if rank == 0 else 8)  # same shapes, different heads
    mesh = P.device_mesh(tp=2, planned=True, where="t.py:3")
    with pytest.raises(RankMismatchError, match="n_head"):
        P.apply_tensor_parallel(
            model, mesh, {"qkv": ("colwise", 3), "n_head": "divide"}, where="t.py:3"
        )
    return True


def test_ranks_planning_different_divided_attributes_fail(tmp_path):
    run_ranks(_ranks_disagree, 2, args=(str(tmp_path),), timeout=120)


def _data_parallel_only(rank, world, tmp):
    module = load_module(
        expand(
            """
            import torch
            import torch.nn as nn
            import macrogen as mg

            def build():
                return mg.parallelize(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))

            def build_zero():
                return mg.parallelize(
                    nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), dp="zero1"
                )

            def optimizer(model):
                return mg.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=0.1))
            """
        ),
        f"dp_only_{rank}",
        Path(tmp),
    )
    torch.manual_seed(0)
    model = module.build()
    torch.manual_seed(0)
    serial = module.nn.Sequential(
        module.nn.Linear(8, 16), module.nn.ReLU(), module.nn.Linear(16, 1)
    )
    torch.manual_seed(0)
    zero = module.build_zero()
    torch.manual_seed(0)
    serial_adam = module.nn.Sequential(
        module.nn.Linear(8, 16), module.nn.ReLU(), module.nn.Linear(16, 1)
    )
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(3))
    mine = slice(4 * rank, 4 * rank + 4)
    runs = (
        (serial, slice(None), torch.optim.SGD(serial.parameters(), lr=0.1)),
        (model, mine, torch.optim.SGD(model.parameters(), lr=0.1)),
        (serial_adam, slice(None), torch.optim.AdamW(serial_adam.parameters(), lr=0.1)),
        (zero, mine, module.optimizer(zero)),  # ZeRO-1: each rank steps its share
    )
    for m, rows, opt in runs:
        for _ in range(2):
            m(x[rows]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    for ours, reference in ((model, serial), (zero, serial_adam)):
        for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    return True


def test_data_parallel_of_a_built_model(tmp_path):
    run_ranks(_data_parallel_only, 2, args=(str(tmp_path),), timeout=120)
