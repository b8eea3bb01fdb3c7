"""A ``ModelSpec`` from shapes alone: a transformers config, or a model built on the meta device.

    spec_from_config("llama3_8b.json", seq=8192)      # config.json, or a config object
    spec_from_model(meta_model, seq=8192)             # with torch.device("meta"): build(...)

Nothing is allocated and nothing runs on a device: the model (for a config, one
block of it) is built on the meta device, and a forward and backward of one
sequence run on meta tensors under torch's ``FlopCounterMode``, with autograd's
saved-tensor hooks counting what backward keeps. ``scaled_dot_product_attention``
is counted as FlashAttention runs it on a GPU (torch's own flash kernel's meta
function: it saves the inputs, the output and the log-sum-exp, not the
sequence x sequence scores the CPU's math path keeps). Identical blocks are measured
once (for a config, the model is built with one block; the others are its copies).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from macrogen.autotune import database
from macrogen.autotune.model_spec import ModelSpec, looks_like_spec


class ShapeError(Exception):
    """The model or config can't be measured from its shapes (one line, for the user)."""


def spec_from_config(config: Any, seq: int, *, dtype: str = "bf16") -> ModelSpec:
    """The spec of the causal LM a transformers config (an object, a config.json, or a folder
    holding one) describes, trained on sequences of ``seq`` tokens."""
    transformers = _transformers()
    source = ""
    if isinstance(config, (str, Path)):
        source = str(config)
        config = load_config(Path(config))
    if not isinstance(config, transformers.PretrainedConfig):
        raise ShapeError(f"not a transformers config: {type(config).__name__}")
    layers = _layers(config)
    two = copy.deepcopy(config)
    two.num_hidden_layers = 2  # the blocks are copies of one another: build two, measure one
    if isinstance(getattr(two, "layer_types", None), list):
        two.layer_types = two.layer_types[:2]
    import torch

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                two, dtype=_dtype(dtype), attn_implementation="sdpa"
            )
    except (ValueError, KeyError, TypeError, ImportError, AttributeError) as e:
        name = getattr(config, "model_type", "?")
        raise ShapeError(f"transformers can't build a causal LM of type {name!r}: {e}") from None
    return _one_block(model, seq, layers, source or type(config).__name__)


def spec_from_model(model: Any, seq: int) -> ModelSpec:
    """The spec of a model built on the meta device (a transformers causal LM, or any model
    whose forward takes ``input_ids`` and ``labels`` and returns a loss)."""

    devices = {p.device.type for p in model.parameters()}
    if devices != {"meta"}:
        raise ShapeError(
            f"the model's parameters are on {', '.join(sorted(devices)) or 'no device'}, not the"
            " meta device: build it under `with torch.device('meta'):` to plan it from its shapes"
        )
    return _one_block(model, seq, None, f"{type(model).__name__} on the meta device")


def load_config(path: Path) -> Any:
    """A transformers config from a config.json (or a folder holding one)."""
    transformers = _transformers()
    file = path / "config.json" if path.is_dir() else path
    try:
        data = database.read_json(file)
    except ValueError as e:
        raise ShapeError(f"can't read a config: {e}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ShapeError(f'{file}: a transformers config.json names its "model_type"')
    if looks_like_spec(data):
        raise ShapeError(f"{file}: a stored model spec, not a config")
    model_type = data.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError, TypeError) as e:
        raise ShapeError(f"{file}: transformers has no config {model_type!r}: {e}") from None


# -- the measurement ------------------------------------------------------------------------
def _one_block(model: Any, seq: int, layers: int | None, source: str) -> ModelSpec:
    """Measure the model with its repeated blocks cut to the first (``layers`` of them, None:
    as many as it has), the others being copies of it."""
    from macrogen.runtime.blocks import repeated_layers

    blocks = repeated_layers(model)
    if not blocks:
        raise ShapeError("the model has no repeated blocks (a ModuleList of layers) to plan")
    name, block = blocks[0]
    container = model.get_submodule(name.rpartition(".")[0])
    kept = list(container)
    if any(_signature(b) != _signature(block) for b in kept[1:]):
        raise ShapeError("the model's blocks differ in their parameters: not planned yet")
    container._modules = {"0": block}  # the forward runs one block: a loop over the list
    logging = _transformers().logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its notes on the config's defaults are not the user's
    try:
        return _measure(model, name, block, seq, layers or len(kept), source)
    finally:
        container._modules = {str(i): b for i, b in enumerate(kept)}
        logging.set_verbosity(verbosity)


def _measure(
    model: Any, block_name: str, block: Any, seq: int, layers: int, source: str
) -> ModelSpec:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    config = getattr(model, "config", None)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if not hidden or not vocab:
        raise ShapeError("the model's config names no hidden_size and vocab_size")
    saved = _Saved(model, block)
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    with _flash_attention(), saved.hooks():
        with FlopCounterMode(display=False) as forward:
            out = model(input_ids=ids, labels=ids)
        loss = getattr(out, "loss", None)
        if loss is None:
            raise ShapeError("the model's forward returned no loss for input_ids and labels")
        with FlopCounterMode(display=False) as backward:
            loss.backward()
    fwd = forward.get_flop_counts()
    mine: Any = next((ops for name, ops in fwd.items() if name.endswith("." + block_name)), {})
    total_fwd, total_bwd = (
        _split(fwd.get("Global", {})),
        _split(backward.get_flop_counts()["Global"]),
    )
    block_fwd = _split(mine)
    # backward is not counted per module: each kind of op's backward/forward ratio, globally
    ratio = [b / f if f else 2.0 for f, b in zip(total_fwd, total_bwd)]
    block_bwd = [f * r for f, r in zip(block_fwd, ratio)]
    rest_fwd = sum(total_fwd) - sum(block_fwd)
    rest_bwd = sum(total_bwd) - sum(block_bwd)
    params = {id(p): p for p in model.parameters()}
    block_params = {id(p): p for p in block.parameters()}
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed_n = embed.weight.numel() if embed is not None else 0
    tied = head is not None and embed is not None and head.weight is embed.weight
    head_n = 0 if head is None or tied else head.weight.numel()
    per_block = sum(p.numel() for p in block_params.values())
    rest = sum(p.numel() for p in params.values()) - per_block
    sharded, divisible = _plan_sizes(model, block)
    experts, expert_params = _experts(block)
    return ModelSpec(
        name=str(getattr(config, "name_or_path", "") or getattr(config, "model_type", "model")),
        layers=layers,
        hidden=hidden,
        seq=seq,
        params=rest + layers * per_block,
        block_params=per_block,
        block_sharded_params=sharded,
        embed_params=embed_n,
        head_params=head_n,
        block_forward_flops=sum(block_fwd) / seq,
        rest_forward_flops=rest_fwd / seq,
        block_backward_flops=sum(block_bwd) / seq,
        rest_backward_flops=rest_bwd / seq,
        block_attention_flops=(block_fwd[1] + block_bwd[1]) / seq,
        block_activation_bytes=saved.in_block / seq,
        rest_activation_bytes=saved.outside / seq,
        block_input_bytes=saved.block_input / seq,
        divisible=divisible,
        param_bytes=next(iter(params.values())).element_size(),
        source=source,
        experts=experts,
        block_expert_params=expert_params,
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
    )


def _experts(block: Any) -> tuple[int, int]:
    """A mixture of experts' experts per block (what ep divides) and their parameters: the
    modules ``mg.parallelize(ep=)`` deals out (stacked ``(experts, ...)`` parameters)."""
    from macrogen.runtime.expert_parallel import experts_modules

    found = experts_modules(block)
    counts = {m.__dict__["num_experts"] for _, m in found}
    if len(counts) != 1:
        return 0, 0
    return counts.pop(), sum(p.numel() for _, m in found for p in m.parameters())


def _split(ops: Any) -> list[float]:
    """A FlopCounterMode module's counts as [everything but attention, attention]."""
    attention = sum(v for op, v in ops.items() if "attention" in str(op))
    return [float(sum(ops.values()) - attention), float(attention)]


class _Saved:
    """Bytes autograd saves for backward, inside the block and outside it (parameters, and
    views of them, are not activations), and the block's input."""

    def __init__(self, model: Any, block: Any):
        self.params = {p.untyped_storage()._cdata for p in model.parameters()}
        self.block = block
        self.depth = 0
        self.in_block = 0
        self.outside = 0
        self.block_input = 0
        self.seen: set[tuple[Any, ...]] = set()

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        import torch

        def enter(module: Any, args: Any, kwargs: Any) -> None:
            self.depth += 1
            first = args[0] if args else kwargs.get("hidden_states")
            if isinstance(first, torch.Tensor) and not self.block_input:
                self.block_input = first.numel() * first.element_size()

        def leave(*_: Any) -> None:
            self.depth -= 1

        def pack(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            storage = t.untyped_storage()._cdata
            key = (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if storage not in self.params and key not in self.seen:
                self.seen.add(key)
                n = t.numel() * t.element_size()
                if self.depth:
                    self.in_block += n
                else:
                    self.outside += n
            return t

        handles = [
            self.block.register_forward_pre_hook(enter, with_kwargs=True),
            self.block.register_forward_hook(leave),
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()


@contextlib.contextmanager
def _flash_attention() -> Iterator[None]:
    """``F.scaled_dot_product_attention`` on meta tensors as the GPU's flash kernel runs it."""
    import torch
    import torch.nn.functional as F

    plain = F.scaled_dot_product_attention

    def flash(q: Any, k: Any, v: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> Any:  # fmt: skip
        if q.device.type != "meta" or attn_mask is not None:
            return plain(
                q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        op = torch.ops.aten._scaled_dot_product_flash_attention
        return op(q, k, v, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = flash  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def _plan_sizes(model: Any, block: Any) -> tuple[int, dict[str, int]]:
    """The block's parameters in transformers' tensor-parallel plan for it (``_tp_plan``: what
    ``tp_plan="hf"`` shards), and the sizes tp must divide: the heads, the MLP's width, the
    vocabulary."""
    config = model.config
    divisible = {}
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            divisible[name] = value
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    planned = {
        path.rsplit(".", 1)[-1] for path in plan if ".*." in path or path.startswith("layers")
    }
    sharded = 0
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if weight is not None and name.rsplit(".", 1)[-1] in planned and weight.dim() == 2:
            sharded += sum(p.numel() for p in module.parameters(recurse=False))
    if not planned:  # no plan shipped: the block's matrices (Megatron's split of every Linear)
        sharded = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    return sharded, divisible


def _signature(block: Any) -> tuple[Any, ...]:
    return (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))


def _layers(config: Any) -> int:
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ShapeError("the config names no num_hidden_layers")
    return layers


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ShapeError(
            "planning from a config needs transformers (pip install transformers)"
        ) from None
    return transformers


def load_spec(source: str, seq: int, *, search_path: tuple[str, ...] = ()) -> ModelSpec:
    """``macrogen plan --model SOURCE``: a config.json (or a folder holding one), a stored
    model spec (.json), or ``module:name`` naming a config object, a model built on the meta
    device, or a function returning either."""
    path = Path(source)
    if path.exists():
        file = path / "config.json" if path.is_dir() else path
        try:
            data = database.read_json(file)
        except ValueError as e:
            raise ShapeError(f"can't read it: {e}") from None
        if isinstance(data, dict) and looks_like_spec(data):
            try:
                spec = ModelSpec.from_json(json.dumps(data))
            except (TypeError, ValueError) as e:
                raise ShapeError(f"{file}: not a model spec ({e})") from None
            if spec.seq != seq:
                raise ShapeError(
                    f"{file}: a spec measured at {spec.seq} tokens per sequence, not {seq}"
                    " (attention's FLOPs depend on it): plan its config at that length instead"
                )
            return spec
        return spec_from_config(path, seq)
    module_name, colon, attr = source.partition(":")
    if not colon or not attr.isidentifier():
        raise ShapeError(
            f"--model {source!r}: no such file; expected a config.json, a folder holding one,"
            " or module:name"
        )
    import importlib
    import sys

    saved = list(sys.path)
    sys.path[:0] = [p for p in search_path if p not in sys.path]
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ShapeError(f"--model {source!r}: {type(e).__name__}: {e}") from None
    finally:
        sys.path[:] = saved
    return _spec_of_object(found, seq, source)


def _spec_of_object(found: Any, seq: int, source: str, called: bool = False) -> ModelSpec:
    import torch

    transformers = _transformers()
    if isinstance(found, ModelSpec):
        return found
    if isinstance(found, transformers.PretrainedConfig):
        return spec_from_config(found, seq)
    if isinstance(found, torch.nn.Module):
        return spec_from_model(found, seq)
    if callable(found) and not called:
        return _spec_of_object(found(), seq, source, called=True)
    raise ShapeError(
        f"--model {source!r} is a {type(found).__name__}: expected a transformers config, a model"
        " built on the meta device, or a function returning one"
    )
