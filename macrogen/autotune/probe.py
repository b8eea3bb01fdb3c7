"""One serial run of the model that the layout models start from: ``python -m macrogen.autotune.probe JOB``.

The autotuner (and ``macrogen plan``) expands the file with its default layout,
builds the step through the entry on one process, and measures what
``memory.Profile`` and ``layouts.ModelShape`` hold: parameter bytes (all, in
the tensor-parallel plan's layers, in the repeated blocks), every size the plan
asks ``tp`` to divide, the batch's rows, one block's output, the step's and the blocks' time, and
the process's memory between steps and at a step's peak.

Memory is measured as ``macrogen.autotune.process_memory`` says.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from macrogen.autotune.layouts import ModelShape
from macrogen.autotune.memory import Profile
from macrogen.autotune.probe_experts import ExpertsProbe
from macrogen.autotune.process_memory import ForwardRise, TensorPeak, grad_bytes, warm_process
from macrogen.autotune.saved_tensors import SavedActivations

# what a stored probe measured: a probe of other measures is not reused (memory was the
# resident set before, and carried no optimizer or activation shares; a CUDA probe's times
# were the host's before 9)
# 12: the activations above the gradients, the forward's rise measured apart
MEASURES = "tensor-bytes-12"


class ProbeError(Exception):
    """The serial run failed: the message says where."""


# a line the probe writes to stderr for the parent to show (the probe takes a minute: a user
# is told what it is doing, not left with silence)
PROGRESS = "macrogen-probe: "


def _say(text: str) -> None:
    print(f"{PROGRESS}{text}", file=sys.stderr, flush=True)


# -- the probe itself ------------------------------------------------------------------------
def main(job_path: str, out_path: str) -> int:
    import torch

    from macrogen.autotune import worker

    job = json.loads(Path(job_path).read_text())
    # one thread, as each rank under torchrun (OMP_NUM_THREADS=1) and torch.utils.benchmark's
    # Timer on one process run: the serial step is then comparable to what autotune measures
    torch.set_num_threads(1)
    for entry in reversed(job["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        result = _probe(job, torch, worker)
    except ProbeError as e:
        result = {"error": str(e)}
    except BaseException as e:  # the user's code: report it, the parent decides
        result = {"error": f"the serial run raised {worker._describe(e)}"}
    Path(out_path).write_text(json.dumps(result))
    return 0


def _probe(job: dict[str, Any], torch: Any, worker: Any) -> dict[str, Any]:
    from macrogen.runtime.blocks import repeated_layers

    factory = worker._entry_factory(job)
    if isinstance(factory, str):
        raise ProbeError(factory)
    module = worker._import_file(job["file"], job["module"])
    if factory is None:
        factory = getattr(module, job["entry"].split(":", 1)[1], None)
        if not callable(factory):
            raise ProbeError(f"the tuned file defines no callable {job['entry']!r} (--entry)")
    _say("building the model through the entry (serially, one process)")
    warm_process()
    torch.manual_seed(0)
    cuda = job.get("target") == "cuda"
    built = TensorPeak(cuda=cuda)
    built.__enter__()  # closed after the warm-up steps: its end is the memory between steps
    from macrogen.runtime.materialize import MetaModelError

    try:
        made = factory(module) if worker._takes_an_argument(factory) else factory()
    except MetaModelError as e:  # the program's own error; the planner can plan its shapes
        raise ProbeError(
            f"{e}; or plan it from its shapes (macrogen plan --model MODULE:NAME, a function"
            " returning the meta model or its config)"
        ) from None
    parts = made if isinstance(made, tuple) else (made,)
    models = [p for p in parts if isinstance(p, torch.nn.Module)]
    steps = [p for p in parts if callable(p) and not isinstance(p, torch.nn.Module)]
    if len(models) != 1 or len(steps) != 1:
        raise ProbeError(
            "to tune a layout, the entry factory returns (model, step):"
            " the models it predicts need the model"
        )
    model, step = models[0], steps[0]
    params = {id(p): p for p in model.parameters()}
    if any(p.is_meta for p in params.values()):
        # a step on meta tensors allocates nothing and takes the time of dispatch alone: every
        # figure the probe measures would be wrong, silently
        raise ProbeError(
            "the entry's model is on the meta device, where a step allocates and times nothing:"
            " plan it from its shapes instead (macrogen plan --model MODULE:NAME, a function"
            " returning the meta model or its config)"
        )
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    blocks = repeated_layers(model)
    block_bytes = sum(
        p.numel() * p.element_size()
        for _, b in blocks
        for p in {id(q): q for q in b.parameters()}.values()
    )
    sharded, divisible, planned = _plan_sizes(model, job.get("plan"))
    message: list[int] = []
    # CUDA runs a step's kernels after the host has queued them: the clocks read CUDA events,
    # which time the kernels without stalling the queue (host clocks time the queueing, 2 ms
    # short of a 7.5 ms step on an H200; a sync in every hook, 3 ms over)
    event = torch.cuda.Event if cuda else None
    in_blocks = _Clock(event)  # the blocks' forward

    def after(module: Any, args: Any, output: Any) -> None:
        in_blocks.stop()
        out = output[0] if isinstance(output, (tuple, list)) else output
        if not message and isinstance(out, torch.Tensor):
            message.append(out.numel() * out.element_size())

    # the first block's arguments in a timed step (after the memory windows), for block_call_s
    inputs: list[tuple[Any, Any]] = []
    timing = [False]

    def keep(module: Any, args: Any, kwargs: Any) -> None:
        if timing[0] and not inputs:
            inputs.append((args, kwargs))

    hooks = [blocks[0][1].register_forward_pre_hook(keep, with_kwargs=True)] if blocks else []
    experts = ExpertsProbe(model, _Clock(event))  # a mixture's experts: what ep deals out
    hooks += experts.hooks()
    for _, b in blocks:
        hooks.append(b.register_forward_pre_hook(in_blocks.start))
        hooks.append(b.register_forward_hook(after))
    _say("2 warm-up steps, then one step's memory")
    for _ in range(2):  # warm-up: optimizer state, allocator
        step()
    built.__exit__()
    optimizers = _optimizers(model, torch)
    state = _optimizer_bytes(optimizers, torch)  # None: no optimizer found over the model
    hooks += _mark_steps(optimizers, torch)
    saved = SavedActivations(model, divisible, [b for _, b in blocks], planned)
    # one step, its forward a range of its own: the activations are what the forward adds
    # (the step's peak above the window's start is the activations less the gradients that
    # zero_grad freed, or, where the gradients outweigh them, backward's regrown gradients)
    before = grad_bytes(params.values())
    first_forward = ForwardRise(params.values(), cuda)
    forward_hooks = first_forward.hooks(model)
    with TensorPeak(cuda=cuda) as one_step, saved.hooks():
        step()
    for h in forward_hooks:
        h.remove()
    freed = max(0, before - first_forward.grads) if first_forward.grads is not None else 0
    grads_kept = first_forward.grads is not None and freed < before / 2
    # what the step rises above what it keeps: kept gradients stay below the start; freed ones
    # come back in backward, the peak's gradients at most
    rise = one_step.unmarked if grads_kept else one_step.unmarked + freed - param_bytes
    activations = max(0, rise, one_step.forward if not cuda else first_forward.cuda_rise)
    in_blocks.reset()  # from the timed steps on
    experts.reset()
    timing[0] = True
    stepping = _Clock(event)  # the optimizer steps' time: replicate repeats it on every rank
    for opt in optimizers:
        hooks.append(opt.register_step_pre_hook(stepping.start))
        hooks.append(opt.register_step_post_hook(stepping.stop))
    forward = _Clock(event)  # the model's forward: what the blocks' forward is a share of
    hooks.append(model.register_forward_pre_hook(forward.start))
    rows: list[int] = []  # the batch's rows: its first tensor's first dim

    def batch(module: Any, args: Any, kwargs: Any) -> None:
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if not rows and first is not None and first.dim() > 0:
            rows.append(int(first.shape[0]))

    hooks.append(model.register_forward_pre_hook(batch, with_kwargs=True))
    hooks.append(model.register_forward_hook(forward.stop))
    steps = [_Clock(event) for _ in range(job.get("steps", 3))]
    _say(f"timing {len(steps)} steps")
    for clock in steps:
        clock.start()
        step()
        clock.stop()
    times = [clock.seconds() for clock in steps]
    for h in hooks:
        h.remove()
    step_s = statistics.median(times)
    # torchrun gives each of several ranks one intra-op thread: the step at one thread is
    # what a rank's share of the batch is scaled from
    threads = torch.get_num_threads()
    one_thread = step_s
    if threads > 1 and not cuda:
        torch.set_num_threads(1)
        try:
            single = []
            for _ in range(job.get("steps", 3)):
                start = time.perf_counter()
                step()
                single.append(time.perf_counter() - start)
            one_thread = statistics.median(single)
        finally:
            torch.set_num_threads(threads)
    _say("timing one block alone, plain and recomputed, in turns")
    call_s, again_s = (
        _block_call_s(blocks[0][1], *inputs[-1], torch, cuda) if inputs else (0.0, None)
    )
    experts_call_s = 0.0
    if experts.layers:
        _say("timing the experts alone, on their tokens and on fewer")
        experts_call_s = experts.call_s(torch, cuda)
    optimizer_s = min(step_s, stepping.seconds() / len(times))
    # the blocks' backward is not hooked (full backward hooks change the graph): the step's
    # time outside the forward and the optimizer is backward's, shared as the forward's is
    backward = 2.0  # when the model's forward was not called as a module: backward ~ 2 forwards
    forward_s = forward.seconds() / len(times)
    if forward_s > 0:
        backward = max(0.0, step_s - optimizer_s - forward_s) / forward_s
    return {
        "profile": {
            "param_bytes": param_bytes,
            "sharded_bytes": sharded,
            "block_bytes": block_bytes,
            "blocks": len(blocks),
            # the optimizer's state: counted when the optimizer is found, else what the
            # process holds between steps above the parameters and their gradients
            "state_bytes": state if state is not None else max(0, built.end - 2 * param_bytes),
            # what the entry holds beside the model between steps (its batch): every rank
            # builds it whole, whatever the layout
            "data_bytes": max(0, built.end - 2 * param_bytes - (state or 0)),
            # gradients and activations: the activations are the most a step's tensors rise
            # outside the optimizer above the parameters, the state and the gradients (the
            # larger of its forward's rise and the step's); the gradients, which the model
            # counts on their own, are the parameters
            "transient_bytes": activations + param_bytes,
            # the step keeps its gradients through the forward (zero_grad(set_to_none=False))
            "grads_kept": grads_kept,
            # the optimizer step's own temporaries (foreach buffers), above the gradients
            "optimizer_bytes": one_step.marked,
            "activation_sharded": saved.sharded_fraction(),
            "block_activations": saved.block_fraction(),
            "step_s": step_s,
            "step_one_thread_s": one_thread,
            "block_s": min(step_s, (1 + backward) * in_blocks.seconds() / len(times)),
            "block_call_s": call_s,
            "recompute_call_s": again_s,
            "optimizer_s": optimizer_s,
            "message_bytes": message[0] if message else 0,
            # a mixture of experts: the experts' parameters, their share of the step, their
            # fixed cost per step (what ep divides), the bytes routed one way per step
            "expert_bytes": experts.param_bytes,
            "expert_layers": experts.layers,
            "expert_s": min(step_s, (1 + backward) * experts.clock.seconds() / len(times)),
            "expert_call_s": experts_call_s,
            "routed_bytes": round(experts.routed / len(times)),
        },
        "shape": {
            "blocks": len(blocks),
            "divisible": divisible,
            "rows": rows[0] if rows else 0,
            "experts": experts.experts,
            "experts_listed": bool(experts.lists),
        },
    }


class _Clock:
    """Seconds between ``start`` and ``stop`` calls (hooks: any arguments), summed: on the
    host's clock, or, given CUDA's ``Event`` class, between events recorded on the stream
    (the device's time for the kernels queued between them; read once the device is done)."""

    def __init__(self, event: Callable[..., Any] | None = None) -> None:
        self.event = event
        self.reset()

    def reset(self) -> None:
        self.host = 0.0
        self.marks: list[Any] = []  # CUDA events, start and stop in turn

    def start(self, *_: Any) -> None:
        self._mark(-1.0)

    def stop(self, *_: Any) -> None:
        self._mark(1.0)

    def _mark(self, sign: float) -> None:
        if self.event is None:
            self.host += sign * time.perf_counter()
        else:
            mark = self.event(enable_timing=True)
            mark.record()
            self.marks.append(mark)

    def seconds(self) -> float:
        if self.event is None:
            return self.host
        if self.marks:
            self.marks[-1].synchronize()  # the last: the stream's events before it are done
        pairs = zip(self.marks[::2], self.marks[1::2])
        return float(sum(a.elapsed_time(b) for a, b in pairs)) / 1000.0  # (ms)


# the block's fixed cost per call is taken this many times, in turns with its recomputed cost
ROUNDS = 3


def _block_call_s(
    block: Any, args: Any, kwargs: Any, torch: Any, cuda: bool
) -> tuple[float, float | None]:
    """A block's forward + backward cost that does not shrink with its batch (Python, dispatch,
    kernel launches): each micro-batch pays it again; and what recomputing it adds to that
    (torch's non-reentrant checkpoint, as ``mg.parallelize(recompute=...)`` runs it: saving
    the RNG state, the forward again). The block is timed alone at its whole batch and at one
    row, t(rows) = fixed + rows x per row, plain and checkpointed, in ROUNDS rounds; each is
    the median of its rounds; (0, None) when the batch
    can't be cut (its first argument no tensor of 2 or more rows) or the block fails alone."""
    from torch.utils.checkpoint import checkpoint

    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] < 2:
        return 0.0, None
    rows = first.shape[0]

    def cut(v: Any, n: int) -> Any:
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows:
            v = v[:n].detach()
            return v.requires_grad_() if v.is_floating_point() else v
        return v

    def timed(n: int, again: bool = False, calls: int = 5) -> float:
        a = [cut(v, n) for v in args]
        k = {key: cut(v, n) for key, v in kwargs.items()}
        times = []
        for i in range(calls + 1):  # 1 warm-up call
            start = time.perf_counter()
            out = checkpoint(block, *a, use_reentrant=False, **k) if again else block(*a, **k)
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().sum().backward()
            if cuda:
                torch.cuda.synchronize()
            if i >= 1:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def fixed(whole: float, one: float) -> float:
        return float(max(0.0, min(one, (rows * one - whole) / (rows - 1))))

    grads = [(p, p.grad) for p in block.parameters()]
    for p, _ in grads:  # backward would add to the step's gradients in place
        p.grad = None
    plains: list[float] = []
    agains: list[float] = []
    try:
        # ROUNDS rounds in turns (plain, then checkpointed), each figure the median of its
        # rounds: load that comes and goes while one is timed does not fix it for the search
        for _ in range(ROUNDS):
            try:
                plain = fixed(timed(rows), timed(1))
            except Exception:  # a block that needs its model around it: no estimate, no harm
                return 0.0, None
            plains.append(plain)
            try:
                agains.append(max(0.0, fixed(timed(rows, True), timed(1, True)) - plain))
            except Exception:  # one that checkpoint can't run: the cost model's estimate stands
                break
    finally:
        for p, g in grads:  # the timing's gradients are not the step's
            p.grad = g
    again = statistics.median(agains) if len(agains) == len(plains) else None
    return statistics.median(plains), again


def _optimizers(model: Any, torch: Any) -> list[Any]:
    """The optimizers over ``model``'s parameters (found among live objects)."""
    import gc

    mine = {id(p) for p in model.parameters()}
    return [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, torch.optim.Optimizer)
        and any(id(p) in mine for g in obj.param_groups for p in g["params"])
    ]


def _optimizer_bytes(optimizers: list[Any], torch: Any) -> int | None:
    """The optimizers' state; None without an optimizer."""
    total = 0
    for opt in optimizers:
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    total += t.numel() * t.element_size()
    return total if optimizers else None


def _mark_steps(optimizers: list[Any], torch: Any) -> list[Any]:
    """Each optimizer step as a profiler range (its temporaries are measured on their own)."""
    from macrogen.autotune.process_memory import MARK

    ranges: list[Any] = []

    def pre(*_: Any) -> None:
        ranges.append(torch.autograd.profiler.record_function(MARK))
        ranges[-1].__enter__()

    def post(*_: Any) -> None:
        if ranges:
            ranges.pop().__exit__(None, None, None)

    hooks = []
    for opt in optimizers:
        hooks.append(opt.register_step_pre_hook(pre))
        hooks.append(opt.register_step_post_hook(post))
    return hooks


def _plan_sizes(model: Any, plan: Any) -> tuple[int, dict[str, int], dict[str, list[Any]]]:
    """The bytes of the planned (sharded) layers, each size tp must divide (first of each
    path), and the planned layers by how they split ("colwise": out features, "rowwise":
    in features)."""
    import torch

    from macrogen.runtime import parallelize

    layers: dict[str, list[Any]] = {"colwise": [], "rowwise": []}
    if plan is None:
        return 0, {}, layers
    if plan == "hf":
        plan = parallelize.hf_plan(model)
    plan = {k: tuple(v) if isinstance(v, list) else v for k, v in plan.items()}
    sharded, divisible, seen = 0, {}, set()
    for path, value in plan.items():
        style = parallelize.Style.parse(value, path)
        for name, owner, attr in parallelize._matches(model, path):
            target = getattr(owner, attr)
            what, size = _size(name, target, style)
            if what is None:
                continue
            if isinstance(target, torch.nn.Module):
                sharded += sum(p.numel() * p.element_size() for p in target.parameters())
                if what.endswith(" out features"):
                    layers["colwise"].append(target)
                elif what.endswith(" in features"):
                    layers["rowwise"].append(target)
            if path not in seen:
                seen.add(path)
                divisible[what] = size
    return sharded, divisible, layers


def _size(name: str, target: Any, style: Any) -> tuple[str | None, int]:
    from macrogen.runtime import parallelize

    if style.kind == "replicate":
        return None, 0
    if style.kind == "divide":
        return (name, target) if isinstance(target, int) else (None, 0)
    if style.kind == "vocab":
        return f"{name} rows", target.num_embeddings
    kind = parallelize._kind(target)
    if kind not in ("linear", "conv1d"):
        return None, 0
    out_features, in_features = (
        target.weight.shape if kind == "linear" else target.weight.shape[::-1]
    )
    if style.kind == "rowwise":
        return f"{name} in features", int(in_features)
    return f"{name} out features", int(out_features) // style.blocks


# -- the parent's side -----------------------------------------------------------------------
def run(
    code: str,
    name: str,
    entry: str,
    entry_in_source: bool,
    sys_path: list[str],
    plan: Any,
    *,
    target: str = "cpu",
    timeout: float = 300.0,
    progress: Callable[[str], None] | None = None,
) -> tuple[Profile, ModelShape]:
    """Probe the expanded ``code`` (the file's default layout) in a process of its own;
    ``progress`` is told each phase the probe starts."""
    with tempfile.TemporaryDirectory(prefix="macrogen-probe-") as tmp:
        work = Path(tmp)
        file = work / name
        file.write_text(code, encoding="utf-8")
        job = {
            "file": str(file),
            "module": f"{file.stem}_mg_probe",
            "entry": entry,
            "entry_in_source": entry_in_source,
            "sys_path": sys_path,
            "plan": _jsonable(plan),
            "target": target,
        }
        (work / "job.json").write_text(json.dumps(job))
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
        env.setdefault("KINETO_LOG_LEVEL", "5")  # the memory window's profiler: no start/stop lines
        proc = subprocess.Popen(
            [sys.executable, "-m", "macrogen.autotune.probe", "job.json", "out.json"],
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        tail: list[str] = []
        reader = threading.Thread(target=_relay, args=(proc, tail, progress), daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise ProbeError(f"the serial run took over {timeout:g} s") from None
        finally:
            reader.join(timeout=5)
        out = work / "out.json"
        if not out.exists():
            last = " | ".join(tail[-4:]) or "no output"
            raise ProbeError(f"the serial run exited with status {returncode}: {last}")
        result = json.loads(out.read_text())
    if "error" in result:
        raise ProbeError(result["error"])
    shape = result["shape"]
    return Profile(**result["profile"]), ModelShape(**shape)


def _relay(proc: Any, tail: list[str], progress: Callable[[str], None] | None) -> None:
    """The probe's stderr: its progress lines to ``progress``, the rest kept for an error."""
    for line in proc.stderr:
        line = line.rstrip("\n")
        if line.startswith(PROGRESS):
            if progress is not None:
                progress(f"probe: {line[len(PROGRESS) :]}")
        elif line.strip():
            tail.append(line)
            del tail[:-20]


def _jsonable(plan: Any) -> Any:
    if isinstance(plan, Mapping):
        return {k: list(v) if isinstance(v, tuple) else v for k, v in plan.items()}
    return plan


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
