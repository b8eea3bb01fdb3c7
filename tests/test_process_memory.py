"""The tensor-bytes peak the layout autotuner measures on CPU (torch's allocator, through the profiler)."""

from __future__ import annotations

import torch

from macrogen.autotune import process_memory
from macrogen.autotune.process_memory import MARK, TensorPeak, running_peak

MB = 1 << 20


def test_the_peak_is_the_most_tensor_bytes_live_at_once():
    with TensorPeak() as window:
        a = torch.empty(4 * MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del a  # 6 MiB at once, then 2 left
        c = torch.empty(MB, dtype=torch.uint8)
    assert window.peak == 6 * MB
    assert window.end == 3 * MB
    del b, c


def test_tensors_made_before_the_window_do_not_count_down_when_freed():
    old = torch.empty(8 * MB, dtype=torch.uint8)
    with TensorPeak() as window:
        del old
        new = torch.empty(MB, dtype=torch.uint8)
    # torch records no free of a block allocated before profiling started, unless its size
    # table still holds the address from an earlier window of the process (seen once in a
    # full test run): then the free counts, as a free of a tensor an earlier window made does
    # in the autotuner's probe, whose memory figures are fitted with it
    counted = (window.peak, window.end) == (0, MB - 8 * MB)
    assert (window.peak, window.end) == (MB, MB) or counted, (window.peak, window.end)
    del new


def test_a_marked_range_reports_its_own_peak_apart():
    with TensorPeak() as window:
        grads = torch.empty(2 * MB, dtype=torch.uint8)
        with torch.autograd.profiler.record_function(MARK):
            temporary = torch.empty(MB, dtype=torch.uint8)
            del temporary
    assert window.unmarked == 2 * MB  # outside the mark
    assert window.marked == MB  # above the mark's start
    assert window.peak == 3 * MB
    del grads


def test_running_peak_sorts_by_time():
    assert running_peak([(3, -5), (1, 5), (2, 4)]) == 9
    assert running_peak([]) == 0


def test_the_process_is_warmed_before_a_window():
    process_memory.warm_process()  # one small model's steps, and the imports a layout needs
    import sys

    assert "macrogen.runtime.fully_sharded" in sys.modules


def test_phase_peaks_split_at_the_marked_ranges():
    events = [(1, 4), (2, 2), (3, -2), (5, 3), (6, -3), (7, -4)]  # a range marks 4..6
    assert process_memory.phase_peaks(events, [(4, 6)]) == (6, 3)
    assert process_memory.phase_peaks(events, []) == (7, 0)  # nothing marked: the whole peak


def test_on_cuda_the_whole_peak_stands_for_forward_and_backward(monkeypatch):
    # a CUDA host's decision, without a GPU: the allocator's counters, read through torch.cuda
    allocated = iter([100, 150])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: next(allocated))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 400)
    with TensorPeak(cuda=True) as window:
        pass
    assert (window.peak, window.end, window.unmarked, window.marked) == (300, 50, 300, 0)


def test_a_free_made_on_another_thread_is_put_back_when_its_address_returns():
    # the profiler sees allocations and frees on the thread it profiles only: a tensor
    # made here and dropped on another thread (an async collective's) is never freed
    # in the record, but its address, allocated again while "live", tells it was
    events = [(1, 100, 0xA), (2, 50, 0xB), (3, 100, 0xA), (4, -50, 0xB), (5, -100, 0xA)]
    assert process_memory.seen_frees(events) == [
        (1, 100),
        (2, 50),
        (3, -100),
        (3, 100),
        (4, -50),
        (5, -100),
    ]
    assert running_peak(process_memory.seen_frees(events)) == 150  # not 250


def test_a_tensor_freed_on_another_thread_does_not_stay_in_the_window():
    import queue
    import threading

    handed, dropped = queue.Queue(), queue.Queue()

    def worker():  # a long-lived thread, as gloo's: it drops the tensors it is handed
        while (t := handed.get()) is not None:
            del t
            dropped.put(True)

    thread = threading.Thread(target=worker)
    thread.start()
    with TensorPeak(cuda=False) as window:
        for _ in range(16):
            handed.put(torch.ones(1 << 18))  # 1 MiB each, made here, freed there
            dropped.get()
    handed.put(None)
    thread.join()
    # not 16 MiB: the frees are put back as their addresses come again (the allocator
    # need not hand the same address back every time: 2 to 8 MiB stay, run to run)
    assert window.peak <= 12 * (1 << 20), window.peak


class _Grow(torch.nn.Module):
    def forward(self, x):
        self.kept = torch.empty(3 * MB, dtype=torch.uint8)  # what the forward leaves live
        return x


def test_the_forward_rise_is_what_the_model_forward_adds_apart_from_the_step():
    model = _Grow()
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    rise = process_memory.ForwardRise([param], cuda=False)
    hooks = rise.hooks(model)
    with TensorPeak() as window:
        before = torch.empty(5 * MB, dtype=torch.uint8)  # the step's, outside the forward
        model(torch.ones(1))
        model(torch.ones(1))  # only the first forward is the range
    for h in hooks:
        h.remove()
    assert window.forward == 3 * MB and window.peak >= 8 * MB
    assert rise.grads == 16  # the gradient bytes as the forward started
    del before


def test_on_cuda_the_forward_rise_reads_the_allocator_at_its_ends(monkeypatch):
    allocated = iter([100, 100 + 7 * MB])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: next(allocated))
    rise = process_memory.ForwardRise([], cuda=True)
    model = torch.nn.Identity()
    rise.hooks(model)
    model(torch.ones(1))
    assert rise.cuda_rise == 7 * MB and rise.grads == 0
