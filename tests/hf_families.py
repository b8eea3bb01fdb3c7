"""Every transformers causal LM that ships a tensor-parallel plan, shrunk to a few thousand
parameters, trained serially and through ``mg.parallelize(tp=2, tp_plan="hf")`` side by side.

    python -m tests.hf_families [--write-table] [--only llama mixtral ...]

runs the sweep on 2 gloo ranks (one spawn, every family in turn) and prints one line per
family: ``ok`` (losses, the first gradients and the final parameters within 1e-9 of the
serial copy, float64), ``refused: <why>`` (the engine's one-line refusal), ``wrong: <what>``
(a silent difference: the worst bug) or ``crash: <exception>``. ``--write-table`` rewrites
the table in docs/parallelize.md between its markers (the test checks it is current).

A family is in the sweep when its ``*ForCausalLM`` is in transformers' causal-LM auto
mapping and its config class ships ``base_model_tp_plan``; it counts when it builds from the
shrunk config (``shrunk_config``) and trains serially on CPU in float64.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "parallelize.md"
TABLE_START = "<!-- families: start (python -m tests.hf_families --write-table) -->"
TABLE_END = "<!-- families: end -->"

STEPS, BATCH, SEQ, VOCAB = 2, 2, 16, 64
TOLERANCE = 1e-9  # float64: losses, first gradients and final parameters, relative to their scale
# A model that computes parts in float32 on purpose (a router's softmax, experts accumulated in
# float32) sums them in another order across the shards: float32's rounding, not float64's
FLOAT32_TOLERANCE = 1e-5

# Every size a config may name, as small as still exercises the plan: 4 heads over 2 kv heads
# (2 of each per rank at tp=2), 4 experts choosing 2, 2 layers (one of each kind).
SIZES: dict[str, int | float] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "n_embd": 32,
    "intermediate_size": 64,
    "ffn_hidden_size": 64,
    "dense_intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "zero_expert_num": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "qk_head_dim": 16,
    "first_k_dense_replace": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_head_dim": 8,
    "linear_num_heads": 4,
    "mamba_n_heads": 4,
    "mamba_d_head": 8,
    "mamba_d_state": 8,
    "mamba_n_groups": 1,
    "mamba_chunk_size": 16,
    "mamba_head_dim": 8,
    "mamba_num_heads": 4,
    "ssm_state_size": 8,
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk": 8,
    "swa_head_dim": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    "unpadded_vocab_size": VOCAB,
    "rotary_dim": 4,
    "router_jitter_noise": 0.0,
    "input_jitter_noise": 0.0,
    # sub-configs (a multimodal model's encoders)
    "num_blocks": 1,
    "ext_pw_out_channel": 32,
    "depthwise_separable_out_channel": 32,
    "nemo_conv_channels": 32,
}


@dataclass(frozen=True)
class Family:
    model_type: str
    class_name: str
    config_class: Any


def families() -> list[Family]:
    """Every ``*ForCausalLM`` of the causal-LM auto mapping whose config ships a TP plan."""
    import os

    import transformers
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,
        model_type_to_module_name,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = os.path.dirname(transformers.__file__)
    found = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if not class_name.endswith("ForCausalLM"):
            continue
        module = model_type_to_module_name(model_type)
        source = os.path.join(root, "models", module, f"configuration_{module}.py")
        if os.path.exists(source):  # (a config file that never names a plan: not imported)
            with open(source) as f:
                if "base_model_tp_plan" not in f.read():
                    continue
        config_class = CONFIG_MAPPING[model_type]
        if getattr(config_class, "base_model_tp_plan", None):
            found.append(Family(model_type, class_name, config_class))
    return found


def _shrink_dict(values: dict[str, Any]) -> dict[str, Any]:
    """SIZES applied to a nested config dict (a per-layer override, a sub-config)."""
    out = {}
    for key, value in values.items():
        if key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = SIZES[key]
        elif key.endswith("_config") and isinstance(value, dict) and "model_type" in value:
            out[key] = _shrink_dict(value)
        else:
            out[key] = value
    if "kv_lora_rank" in out and "num_key_value_heads" in out:  # MLA: one kv head per head
        out["num_key_value_heads"] = out.get("num_attention_heads", SIZES["num_attention_heads"])
    return out


def shrunk_config(family: Family) -> Any:
    """The family's config with every size from SIZES, no dropout, eager experts (float64 on
    CPU: grouped_mm takes no doubles), and one layer of each kind its layer_types name."""
    defaults = family.config_class().to_dict()
    kw: dict[str, Any] = {k: v for k, v in SIZES.items() if k in defaults}
    for key, value in defaults.items():
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            kw[key] = 0.0
        elif key.endswith("_config") and isinstance(value, dict) and "model_type" in value:
            kw[key] = _shrink_dict(value)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = defaults.get(key)
        if isinstance(value, list) or (isinstance(value, int) and value >= VOCAB):
            kw[key] = None if key == "pad_token_id" else 0
    if "kv_lora_rank" in defaults:
        kw["num_key_value_heads"] = SIZES["num_attention_heads"]
    kw["experts_implementation"] = "eager"
    attempts = [kw]
    layer_types = defaults.get("layer_types")
    if isinstance(layer_types, list):
        kinds = list(dict.fromkeys(layer_types))  # one layer of each kind, in order
        if len(kinds) > 1:
            layers = {k: len(kinds) for k in ("num_hidden_layers", "n_layer", "num_layers")}
            attempts.insert(0, {**kw, **{k: v for k, v in layers.items() if k in kw},
                                "layer_types": kinds})  # fmt: skip
        attempts.append({**kw, "layer_types": layer_types[: kw.get("num_hidden_layers", 2)]})
    error: Exception | None = None
    for attempt in attempts:
        try:
            config = family.config_class(**attempt)
            per_layer = config.to_dict().get("per_layer_config")
            if per_layer:  # per-layer overrides, where the shrunk config puts them
                config = family.config_class(
                    **attempt,
                    per_layer_config={int(i): _shrink_dict(o) for i, o in per_layer.items()},
                )
            return config
        except Exception as e:  # the next attempt; the last error if none builds
            error = e
    assert error is not None
    raise error


def build(family: Family, config: Any) -> torch.nn.Module:
    import transformers

    return getattr(transformers, family.class_name)(config)


PARALLELIZE = textwrap.dedent(
    """
    import macrogen as mg


    def parallel(model):
        return mg.parallelize(model, tp=2, tp_plan="hf", dp="none")
    """
)


def expanded(directory: str) -> str:
    """PARALLELIZE expanded into ``directory``: its path."""
    from tests.helpers import expand

    path = Path(directory) / "families_parallel.py"
    path.write_text(expand(PARALLELIZE))
    return str(path)


# -- one family, on every rank -----------------------------------------------------------------


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _train(model: torch.nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS SGD steps: the losses and the gradients of the first backward (whole). (SGD:
    AdamW's per-element normalization magnifies rounding in near-zero gradients, and its
    dozen ops per parameter send every new shape through DTensor's sharding propagation.)"""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, first = [], {}
    for i, ids in enumerate(_batches()):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if i == 0:
            first = {n: _full(p.grad).clone() for n, p in model.named_parameters()
                     if p.grad is not None}  # fmt: skip
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, first


def _worst(ours: dict[str, torch.Tensor], serial: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference relative to the serial tensor's scale, and where."""
    worst, where = 0.0, ""
    for name, want in serial.items():
        got = ours.get(name)
        if got is None:
            return float("inf"), f"{name} missing"
        if got.shape != want.shape:
            return float("inf"), f"{name} shaped {tuple(got.shape)}, serial {tuple(want.shape)}"
        diff = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        if diff > worst:
            worst, where = diff, name
    return worst, where


def run_family(family: Family, parallel: Any) -> tuple[str, str]:
    """("ok" | "refused" | "wrong" | "crash" | "unbuilt", detail) on this rank."""
    from macrogen.runtime.parallelize import PlanError

    torch.manual_seed(0)
    try:
        serial = build(family, shrunk_config(family))
        reference = copy.deepcopy(serial)
        ref_losses, ref_grads = _train(reference)
    except Exception as e:  # not in the sweep: it does not build or train serially
        return "unbuilt", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    final_serial = {n: p.detach() for n, p in reference.named_parameters()}
    tolerance = TOLERANCE
    try:
        model = parallel(serial)
        losses, grads = _train(model)
    except PlanError as e:
        return "refused", " ".join(str(e).split())
    except Exception as e:
        return "crash", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    loss_gap = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
    grad_gap, grad_at = _worst(grads, ref_grads)
    final = {n: _full(p.detach()) for n, p in model.named_parameters()}
    param_gap, param_at = _worst(final, final_serial)
    worst = max(loss_gap, grad_gap, param_gap)
    inside = worst > TOLERANCE and computes_in_float32(family)
    if inside:
        tolerance = FLOAT32_TOLERANCE
    if loss_gap > tolerance:
        return "wrong", f"losses off by {loss_gap:.2g}"
    if grad_gap > tolerance:
        return "wrong", f"gradient of {grad_at} off by {grad_gap:.2g}"
    if param_gap > tolerance:
        return "wrong", f"{param_at} off by {param_gap:.2g} after {STEPS} steps"
    if inside:
        return "ok", f"{worst:.0e}: the model computes parts in float32"
    return "ok", f"{worst:.0e}"


def computes_in_float32(family: Family) -> bool:
    """The float64 model's forward and backward run some operation in a lower precision (a
    cast to float32 in its code)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    low = (torch.float32, torch.bfloat16, torch.float16)

    class Watch(TorchDispatchMode):
        seen = False

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            if not self.seen:
                self.seen = any(isinstance(t, torch.Tensor) and t.dtype in low
                                for t in tree_leaves(out))  # fmt: skip
            return out

    torch.manual_seed(0)
    model = build(family, shrunk_config(family))
    ids = _batches()[0]
    with Watch() as watch:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return watch.seen


def sweep(rank: int, world: int, code: str, only: list[str] | None) -> list[tuple[str, str, str]]:
    """Every family on this rank: (model_type, status, detail), the ranks' outcomes agreed.
    ``code``: the expanded file (``expanded``: the caller expands it once, for both ranks)."""
    import importlib.util
    import warnings

    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_default_dtype(torch.float64)
    spec = importlib.util.spec_from_file_location(f"families_{rank}", code)
    assert spec is not None and spec.loader is not None
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    parallel = generated.parallel
    results = []
    for family in families():
        if only and family.model_type not in only:
            continue
        began = time.perf_counter()
        try:
            status, detail = run_family(family, parallel)
        except Exception:
            status, detail = "crash", traceback.format_exc().splitlines()[-1]
        outcomes: list[Any] = [None] * world
        dist.all_gather_object(outcomes, (status, detail))
        if len({o[0] for o in outcomes}) > 1:  # the ranks disagree: a crash, both sides named
            status = "crash"
            detail = "; ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(outcomes))
        if rank == 0:
            print(f"{family.model_type:24s} {status:8s} {time.perf_counter() - began:5.1f}s {detail}",
                  flush=True)  # fmt: skip
        results.append((family.model_type, status, detail))
    return results


# -- the table ---------------------------------------------------------------------------------


def table(results: list[tuple[str, str, str]]) -> str:
    built = [r for r in results if r[1] != "unbuilt"]
    counts = {s: sum(1 for r in built if r[1] == s) for s in ("ok", "refused", "wrong", "crash")}
    lines = [
        TABLE_START,
        "",
        f"{len(built)} families build from a shrunk config: {counts['ok']} ok, {counts['refused']}"
        f" refused, {counts['wrong']} silently wrong, {counts['crash']} crashed"
        f" ({len(results) - len(built)} more ship a plan but do not build shrunk on CPU).",
        "",
        "| family | result |",
        "|---|---|",
    ]
    for model_type, status, detail in built:
        if status == "ok":  # (whether it needed FLOAT32_TOLERANCE: only in the printed lines)
            text = "ok"
        else:
            text = f"{status}: {_cell(detail)}"
        lines.append(f"| `{model_type}` | {text} |")
    unbuilt = [f"`{r[0]}` ({_cell(r[2])})" for r in results if r[1] == "unbuilt"]
    lines += ["", f"Not built shrunk on CPU: {'; '.join(unbuilt)}.", "", TABLE_END]
    return "\n".join(lines)


def _cell(detail: str) -> str:
    detail = re.sub(r"^mg\.parallelize at [^:]+:\d+: ", "", detail)  # (the sweep's own file)
    return re.sub(r"\s+", " ", detail).replace("|", "\\|")


def docs_table() -> str | None:
    text = DOCS.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    return None if start < 0 or end < 0 else text[start : end + len(TABLE_END)]


def write_table(rendered: str) -> None:
    text = DOCS.read_text()
    current = docs_table()
    if current is None:
        raise SystemExit(f"{DOCS}: no {TABLE_START!r} ... {TABLE_END!r} markers")
    DOCS.write_text(text.replace(current, rendered))


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from tests.distributed import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write-table", action="store_true", help="rewrite docs/parallelize.md's table"
    )
    parser.add_argument("--only", nargs="*", help="these model types only")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(sweep, 2, args=(expanded(tmp), args.only), timeout=3600)[0]
    print(f"{len(results)} families in {time.perf_counter() - began:.0f} s")
    rendered = table(results)
    print(rendered)
    if args.write_table:
        write_table(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
