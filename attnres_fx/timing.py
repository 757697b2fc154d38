"""The one way attnres_fx times code (the CLI's demo, the three-way export report, the benchmarks):
round-robin over the candidates, so that a shared, noisy machine slows them alike, and medians."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch


def interleaved(fns: dict[str, Callable[[], object]], runs: int, warmup: int = 1,
                device: torch.device | None = None,
                clock: Callable[[], float] | None = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each function, after ``warmup`` calls each, timed round-robin with the order
    reversed every other round. On a CUDA ``device`` each call is synchronised (kernels run
    asynchronously: the timer would stop before they finish). ``clock``: wall time by default;
    ``time.thread_time`` counts only the CPU time of the calling thread, which other work on a shared
    machine does not inflate (meaningful when torch runs on that one thread); ``time.process_time``
    the CPU time of every thread of the process; None: each call returns the seconds it took (a function
    that times only part of its work)."""
    if device is not None and device.type == "cuda":
        fns = {name: _synchronised(fn, device) for name, fn in fns.items()}
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(runs):
        for name in names if round_ % 2 == 0 else names[::-1]:
            if clock is None:
                times[name].append(fns[name]())
                continue
            start = clock()
            fns[name]()
            times[name].append(clock() - start)
    return times


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """torch's intra-op work on the calling thread alone, for timing with ``clock=time.thread_time``;
    the thread count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pooled(times: dict[str, list[float]], copies: dict[str, list[str]]) -> dict[str, list[float]]:
    """Per candidate, the times of its copies averaged round by round (``copies``: a candidate's name -> the
    names its copies were timed under in ``times``, as many rounds each). Copies of one model, identical
    but for where their weights lie in memory, take different times (caches are indexed by physical
    address): a decoding step up to some 6% apart from one copy to the next. Timing several copies of
    each candidate measures the candidate rather than one placement of it."""
    return {name: [statistics.fmean(rounds) for rounds in zip(*(times[member] for member in members), strict=True)]
            for name, members in copies.items()}


def paired_ratios(times: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Per entry, the median over rounds of its time divided by ``reference``'s in the same round: on a
    shared machine the load drifts between rounds more than between neighbouring calls."""
    return {name: statistics.median(t / r for t, r in zip(ts, times[reference])) for name, ts in times.items()}


def median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _synchronised(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    def run():
        torch.cuda.synchronize(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result
    return run
