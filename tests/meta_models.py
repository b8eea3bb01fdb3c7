"""Models built on the meta device and filled by ``init=``: the transformers models, their
checkpoint folders, the layouts (one expanded file) and the per-rank checks the meta tests run.

A case is (family, layout, init): the model is built under ``torch.device("meta")``, handed to
``mg.parallelize(..., init=...)``, and compared with the serial program: ``from_pretrained`` of
the same folder for ``mg.load``, the unexpanded ``mg.parallelize(model, init="model")`` (the
marker initializes the whole model serially) for ``"model"``. Then 3 AdamW steps, the same
batch on every rank, compared with the serial model's 3 steps: a pipelined layout (``pp2...``)
trains through ``mg.pipeline_step`` with a float64 loss, its parameters gathered from every
stage (``full_state_dict``), and reports what its rank allocated (``stage_share``).
"""

from __future__ import annotations

import functools
import importlib.util
import textwrap
import warnings
from pathlib import Path
from typing import Any

import torch

import macrogen as mg

VOCAB, BATCH, SEQ, STEPS = 64, 2, 8, 3

LAYOUTS = textwrap.dedent(
    """
    import macrogen as mg


    def tp2(model, init):
        return mg.parallelize(model, tp=2, tp_plan="hf", dp="none", init=init)


    def fsdp(model, init):
        return mg.parallelize(model, dp="fsdp", init=init)


    def tp2_fsdp(model, init):
        return mg.parallelize(model, tp=2, tp_plan="hf", dp="fsdp", init=init)


    def replicate(model, init):
        return mg.parallelize(model, init=init)


    def ep2(model, init):
        return mg.parallelize(model, ep=2, init=init)


    def ep2_fsdp(model, init):
        return mg.parallelize(model, ep=2, dp="fsdp", init=init)


    def ep4(model, init):
        return mg.parallelize(model, ep=4, init=init)


    def pp2(model, init):
        return mg.parallelize(model, pp=2, microbatches=2, init=init)


    def pp2_tp2(model, init):
        return mg.parallelize(model, pp=2, tp=2, tp_plan="hf", microbatches=2, init=init)


    def pp2_fsdp(model, init):
        return mg.parallelize(model, pp=2, dp="fsdp", microbatches=2, init=init)


    def pp2_zero1(model, init):
        return mg.parallelize(model, pp=2, dp="zero1", microbatches=2, init=init)


    def fsdp_built(model):
        return mg.parallelize(model, dp="fsdp")
    """
)


FAMILIES = ("llama", "qwen2", "qwen2_moe")


def config(family: str) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    if family == "llama":
        return LlamaConfig(intermediate_size=32, **common)
    if family == "qwen2":  # the embedding and the head tied: under pp, on the first and last stage
        return Qwen2Config(intermediate_size=32, tie_word_embeddings=True, **common)
    return Qwen2MoeConfig(
        intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, **common,
        experts_implementation="eager",  # (float64 on CPU: grouped_mm takes no doubles)
    )  # fmt: skip


def model_class(family: str) -> Any:
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM

    classes = dict(llama=LlamaForCausalLM, qwen2=Qwen2ForCausalLM, qwen2_moe=Qwen2MoeForCausalLM)
    return classes[family]


def save_folders(directory: Path) -> dict[str, str]:
    """Each family's serial model (float64, seed 0) saved with ``save_pretrained``, in shards of
    a few KB: the index file's path is the one read."""
    folders = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = model_class(family)(config(family)).double()
        folder = directory / family
        model.save_pretrained(folder, max_shard_size="20KB")
        folders[family] = str(folder)
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():  # (one process, no group: DCP says it assumes so)
            warnings.simplefilter("ignore")
            dcp.save(model.state_dict(), checkpoint_id=str(directory / f"{family}_dcp"))
        folders[f"{family}_dcp"] = str(directory / f"{family}_dcp")
    return folders


def expanded(directory: Path) -> str:
    from tests.helpers import expand

    path = directory / "meta_layouts.py"
    path.write_text(expand(LAYOUTS))
    return str(path)


def _module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("meta_layouts", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def meta_model(family: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_class(family)(config(family))
    return model.to(torch.float64)


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.dtensor_whole import full_tensor

    out = {}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        value = full_tensor(p) if isinstance(p, DTensor) else p
        out[name] = value.detach().clone()
    return out


def train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """float64 cross entropy (HF's own loss is float32): a pipeline's micro-batch means add up
    to the serial batch's mean within float64 rounding."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def train_pipeline(model: torch.nn.Module, serial: bool) -> list[float]:
    """``train`` through ``mg.pipeline_step`` (the serial model: the same loss on the whole
    batch), the same batch on every rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        if serial:
            loss = _loss(model(input_ids=ids, use_cache=False).logits, ids)
            loss.backward()
        else:
            loss = mg.pipeline_step(model, ids, ids, _loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def stage_share(model: torch.nn.Module, serial: torch.nn.Module) -> tuple[float, bool]:
    """What this rank of a pipelined model allocated, as a fraction of the serial parameters'
    bytes (its storages, each once), and whether every parameter it holds has storage."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}
    total = sum(p.numel() * p.element_size() for p in serial.parameters())
    return sum(storages.values()) / total, all(not t.is_meta for t in local)


def serial_reference(family: str, init: str, folder: str) -> torch.nn.Module:
    if init in ("load", "dcp"):
        return model_class(family).from_pretrained(folder, config=config(family),
                                                   dtype=torch.float64)  # fmt: skip
    torch.manual_seed(7)
    return mg.parallelize(meta_model(family), init="model")  # the unexpanded marker: serial


def gap(ours: dict[str, torch.Tensor], serial: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference, and where (inf: a parameter missing or misshapen)."""
    worst, where = 0.0, ""
    for name, want in serial.items():
        got = ours.get(name)
        if got is None or got.shape != want.shape:
            return float("inf"), name
        diff = float((got - want).abs().max())
        if diff > worst:
            worst, where = diff, name
    return worst, where


def experts_read(model: torch.nn.Module) -> tuple[float, float]:
    """What this rank of an ``ep`` model holds and read of the experts, as fractions of the
    serial experts' bytes: (its experts' storage, the experts' keys it read from the folder)."""
    from torch.distributed.tensor import DTensor

    from macrogen.runtime.materialize import LOADED

    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    total = sum(p.numel() * p.element_size() for p in experts)
    held = sum(p.to_local().numel() * p.element_size() for p in experts if isinstance(p, DTensor))
    read = sum(b for key, b in model.__dict__.get(LOADED, {}).items() if ".experts." in key)
    return held / total, read / total


def _parameters(model: torch.nn.Module, pipelined: bool) -> dict[str, torch.Tensor]:
    return model.full_state_dict() if pipelined else whole(model)  # (every stage's)


def run_cases(
    rank: int, world: int, code: str, folders: dict[str, str], cases: list[tuple[str, str, str]]
) -> list[tuple[str, float, float, float]]:
    """Each case on every rank: (case, initial gap, loss gap, final parameters' gap); an ``ep``
    case adds its ``experts_read`` fractions to its name."""
    from macrogen.runtime import mesh

    layouts = _module(code)
    results = []
    for family, layout, init in cases:
        mesh.reset()  # (one mesh per program: each case is a program of its own)
        reference = serial_reference(family, init, folders[family])
        start = whole(reference)
        torch.manual_seed(7)
        folder = folders[family] if init == "load" else folders[f"{family}_dcp"]
        given = "model" if init == "model" else mg.load(folder)
        model = getattr(layouts, layout)(meta_model(family), given)
        pipelined = layout.startswith("pp")
        params = functools.partial(_parameters, model, pipelined)
        initial, _ = gap(params(), start)
        name = f"{family} {layout} {init}"
        if layout.startswith("ep"):
            name += " held {:.3f} read {:.3f}".format(*experts_read(model))
        if pipelined:  # this rank's stage only, each parameter on its device
            name += " stage {:.3f} real {}".format(*stage_share(model, reference))
            ours, theirs = train_pipeline(model, False), train_pipeline(reference, True)
        else:
            ours, theirs = train(model), train(reference)
        losses = max(abs(a - b) for a, b in zip(ours, theirs))
        final, _ = gap(params(), whole(reference))
        results.append((name, initial, losses, final))
    return results


# -- peak memory of build-and-load ---------------------------------------------------------------


def memory_config(scale: int) -> Any:
    """A Llama of ``scale`` x 9 M fp32 parameters (8 layers at scale 4: ~36 M, 144 MB)."""
    from transformers import LlamaConfig

    width = 128 * scale
    return LlamaConfig(vocab_size=2048 * scale, hidden_size=width, intermediate_size=3 * width,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                       max_position_embeddings=64)  # fmt: skip


def save_memory_folder(directory: Path, scale: int) -> str:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    folder = directory / f"memory{scale}"
    LlamaForCausalLM(memory_config(scale)).save_pretrained(folder, max_shard_size="20MB")
    return str(folder)


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure_memory(
    rank: int, world: int, code: str, folder: str, scale: int, how: str
) -> dict[str, int]:
    """Peak RSS over the build and load of the memory model, beyond this rank's RSS before it
    (the imports done, the high-water mark reset): ``how`` is "meta" (built on meta,
    ``init=mg.load``, FSDP), "meta_pp" (the same cut into 2 pipeline stages first, FSDP over
    the rest) or "built" (built with values on every rank, then FSDP: today)."""
    import gc

    import safetensors.torch  # noqa: F401  (everything the build imports, imported before)
    import torch._subclasses.fake_tensor  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import transformers.conversion_mapping  # noqa: F401
    import transformers.initialization  # noqa: F401
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama  # noqa: F401

    import macrogen.runtime.fully_sharded  # noqa: F401
    import macrogen.runtime.materialize  # noqa: F401
    import macrogen.runtime.parallelize_pipeline  # noqa: F401

    layouts = _module(code)
    config = memory_config(scale)
    with torch.device("meta"):  # the serial model's sizes
        serial = LlamaForCausalLM(config)
    sizes = [sum(p.numel() * 4 for p in m.parameters()) for m in serial.model.layers]
    largest = max([*sizes, config.vocab_size * config.hidden_size * 4])
    total = sum(p.numel() * 4 for p in serial.parameters())
    del serial
    gc.collect()
    baseline = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again here
    if how.startswith("meta"):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        layout = layouts.pp2_fsdp if how == "meta_pp" else layouts.fsdp
        model = layout(model, mg.load(folder))
    else:
        torch.manual_seed(0)
        model = layouts.fsdp_built(LlamaForCausalLM(config))
    gc.collect()
    peak = _status("VmHWM") - baseline
    return {"peak": peak, "share": total // world, "largest": largest, "total": total}
