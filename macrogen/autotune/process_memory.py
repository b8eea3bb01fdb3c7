"""Peak memory of a process's tensors, measured the same way by the probe and by each layout.

On CUDA it is ``torch.cuda.max_memory_allocated`` above the bytes allocated at
the start. On CPU torch keeps no allocator statistics, and the resident set
is not what the models predict: glibc keeps freed blocks (FSDP's gathered
units, fragmented, grew a 2-rank process from 36 to 50 MB over 12 steps of the
same live tensors), and gloo's own buffers are not tensors. So ``TensorPeak``
records torch's CPU allocator through the profiler (``profile_memory``: every
allocation and free, with its size) and sums them in time order: the peak of
that sum is the most tensor bytes live at once, above those live at the start
(a tensor made before the window and freed in it does not count down).

``warm_process`` runs a small model first, so that torch's one-time buffers
(first backward, first optimizer step, the imports a layout needs) come
before any window.
"""

from __future__ import annotations

from typing import Any


def warm_process(distributed: bool = False) -> None:
    """A few steps of a small model: torch's one-time buffers are made before any window."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(64, 64)).square().mean().backward()
        opt.step()
    # what mg.parallelize's layouts import on first use, so that no layout pays for it
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.utils.benchmark  # noqa: F401  (one process's timer)

    import macrogen.runtime.data_parallel  # noqa: F401
    import macrogen.runtime.fully_sharded  # noqa: F401
    import macrogen.runtime.parallelize  # noqa: F401

    if distributed:
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1024))
        dist.barrier()


class TensorPeak:
    """The most tensor bytes live at once while the window is open, above those at its start.

    with TensorPeak() as window:
        build(); step(); step()
    window.peak
    """

    def __init__(self, cuda: bool | None = None) -> None:
        self.cuda = cuda  # None: CUDA's allocator when CUDA is present (a CPU run on a GPU host
        # passes False: its tensors are torch's CPU allocator's)
        self.peak = 0
        self.end = 0  # tensor bytes live at the end, above the start
        self.marked = 0  # on CPU: the most bytes above a marked range's start, within it
        self.unmarked = 0  # the peak outside the marked ranges (CUDA: the whole peak)
        self.forward = 0  # on CPU: the most a FORWARD range adds above its start
        self._profiler: Any = None
        self._start = 0

    def __enter__(self) -> TensorPeak:
        import torch

        if self.cuda is None:
            self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = int(torch.cuda.memory_allocated())
            return self
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = max(0, int(torch.cuda.max_memory_allocated()) - self._start)
            self.end = int(torch.cuda.memory_allocated()) - self._start
            # CUDA's counters have no time line: the phases are not told apart, and the whole
            # peak stands for forward and backward's (the optimizer's is inside it)
            self.unmarked = self.peak
            return
        self._profiler.__exit__(None, None, None)
        results = self._profiler.profiler.kineto_results
        recorded = results.events()
        self._profiler = None
        events = seen_frees(_allocations(results))
        ranges = [(e.start_ns(), e.end_ns()) for e in recorded if e.name() == MARK]
        self.peak = running_peak(events)
        self.end = sum(nbytes for _, nbytes in events)
        self.unmarked, self.marked = phase_peaks(events, ranges)
        forwards = [(e.start_ns(), e.end_ns()) for e in recorded if e.name() == FORWARD]
        self.forward = ranges_peak(events, forwards)


def _allocations(results: Any) -> list[tuple[int, int, int]]:
    """(time, signed bytes, address) of each CPU allocation and free the profiler saw."""
    found = []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack += node.children
        f = node.extra_fields
        if type(f).__name__ == "_ExtraFields_Allocation" and str(f.device) == "cpu":
            found.append((node.start_time_ns, f.alloc_size, f.ptr))
    return found


def seen_frees(allocations: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """(time, signed bytes) in time order, with the frees the profiler missed put back.

    The profiler records a free only on a thread it profiles: a tensor made on the
    main thread and dropped on gloo's or FSDP's (an async collective's buffers) is
    never freed in its record (3 MB a step of an FSDP pipeline stage). An address
    allocated again while its last allocation is still live was freed unseen: that
    free is counted just before the new allocation."""
    live: dict[int, int] = {}
    out = []
    for t, nbytes, ptr in sorted(allocations, key=lambda a: a[0]):
        if nbytes > 0:
            unseen = live.pop(ptr, 0)
            if unseen:
                out.append((t, -unseen))
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
        out.append((t, nbytes))
    return out


MARK = "macrogen.memory_mark"  # a record_function range whose own peak TensorPeak reports
FORWARD = "macrogen.memory_forward"  # a model's forward: its rise is reported apart (CPU only)


def phase_peaks(events: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> tuple[int, int]:
    """The peak outside the marked ranges, and the most any range adds above its start."""

    def inside(t: int) -> bool:
        return any(start <= t <= end for start, end in ranges)

    live = outside = 0
    for t, nbytes in sorted(events, key=lambda e: e[0]):
        live += nbytes
        if not inside(t):
            outside = max(outside, live)
    return outside, ranges_peak(events, ranges)


def ranges_peak(events: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> int:
    """The most any of ``ranges`` adds above its own start."""
    return max(
        (running_peak([(t, n) for t, n in events if start <= t <= end]) for start, end in ranges),
        default=0,
    )


def running_peak(events: list[tuple[int, int]]) -> int:
    """The highest running sum of (time, signed bytes) events in time order (0 at the start)."""
    live = top = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):
        live += nbytes
        top = max(top, live)
    return top


class ForwardRise:
    """The model's first forward in a step: the gradient bytes live as it starts, and the
    forward as a profiler range (``TensorPeak.forward`` on CPU; on CUDA, the bytes allocated at
    its end above its start)."""

    def __init__(self, params: Any, cuda: bool):
        import torch

        self.params, self.torch, self.cuda = list(params), torch, cuda
        self.grads: int | None = None  # None: the forward never ran as the model's
        self.cuda_rise = 0
        self._range: Any = None
        self._start = 0

    def hooks(self, model: Any) -> list[Any]:
        return [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, *_: Any) -> None:
        if self.grads is not None:
            return
        self.grads = grad_bytes(self.params)
        if self.cuda:
            self._start = int(self.torch.cuda.memory_allocated())
        self._range = self.torch.autograd.profiler.record_function(FORWARD)
        self._range.__enter__()

    def _leave(self, *_: Any) -> None:
        if self._range is None:
            return
        self._range.__exit__(None, None, None)
        self._range = None
        if self.cuda:
            self.cuda_rise = max(0, int(self.torch.cuda.memory_allocated()) - self._start)


def grad_bytes(params: Any) -> int:
    """The bytes of the gradients ``params`` hold."""
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
