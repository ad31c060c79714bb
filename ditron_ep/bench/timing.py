"""Timing rule of every ditron_ep benchmark, and the summaries and rates derived from it.

Before every iteration all ranks meet (`dist.barrier`) and drain their device
(`torch.cuda.synchronize`); the iteration is timed with CUDA events on the GPU, or with
`time.perf_counter` on the CPU (emulated ranks: interpreter timings, not performance). The figure
of an iteration is the slowest rank's (all_reduce MAX); benchmarks report the median and the
20th / 80th percentiles of those figures. The ranks leave the barrier at different times (host
wake-up), and that skew counts. `time_fn(..., align=True)` also meets on the device right
before the start event (an all_reduce queued on the stream), so that every rank's clock starts
when the last rank has arrived: the skew of leaving the barrier drops out. What stays is the
host time the last-arriving rank needs to issue the call (an early rank issues it while its
device waits in the all_reduce). A diagnostic rule; the benchmarks' figures use the first.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


def time_fn(fn: Callable[[], object], iters: int, warmup: int, group: dist.ProcessGroup | None = None,
            device: torch.device | str | None = None,
            on_iteration: Callable[[int], None] | None = None, align: bool = False) -> list[float]:
    """Time `fn` `iters` times after `warmup` untimed calls; return the slowest rank's µs per iteration.

    Every rank of `group` must call this with the same `iters` and `warmup` (it is collective:
    one barrier per call of `fn` and one all_reduce at the end). Without torch.distributed
    initialised it times this process alone. On a CUDA `device` each call is bracketed by CUDA
    events on the current stream; otherwise by `time.perf_counter` (fn must be synchronous).
    `on_iteration(i)` runs after call i (warm-up calls first, i = 0 .. warmup + iters - 1).
    If `fn` raises on some rank, that rank stops calling it but keeps joining the barriers and
    the all_reduce, then re-raises: the ranks' collectives stay matched.
    align=True (with torch.distributed initialised): before each start, an all_reduce of one
    element on the current stream (synchronous on a CPU group), so the ranks start together.
    The collectives stay matched across Python exceptions; a device fault (a sticky CUDA error)
    breaks them, as it breaks every collective after it.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    on_cuda = device.type == "cuda"
    distributed = dist.is_available() and dist.is_initialized()
    if on_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    local: list[float] = []
    error: BaseException | None = None
    meet = torch.zeros(1, device=device) if align and distributed else None
    for i in range(warmup + iters):
        if distributed:
            dist.barrier(group=group)
        if error is None and on_cuda:
            try:
                torch.cuda.synchronize(device)
            except Exception as exc:  # noqa: BLE001 - re-raised after the collectives below
                error = exc
        if meet is not None:
            dist.all_reduce(meet, group=group)  # every rank, every iteration: the collectives stay matched
        if error is not None:
            continue
        try:
            j = i - warmup
            if j < 0:
                fn()
            elif on_cuda:
                starts[j].record()
                fn()
                ends[j].record()
            else:
                t0 = time.perf_counter()
                fn()
                local.append((time.perf_counter() - t0) * 1e6)
            if on_iteration is not None:
                on_iteration(i)
        except Exception as exc:  # noqa: BLE001 - re-raised after the collectives below
            error = exc
    if error is None and on_cuda:
        try:
            torch.cuda.synchronize(device)
            local = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]  # ms -> µs
        except Exception as exc:  # noqa: BLE001
            error = exc
    if error is not None:
        local = [float("nan")] * iters
    if distributed:
        t = torch.tensor(local, dtype=torch.float64, device=device if on_cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        local = t.tolist()
    if error is not None:
        raise error
    return local


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending, non-empty sequence."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times: Sequence[float]) -> dict[str, float]:
    """{median, p20, p80, min, n} of per-iteration times (same unit as given)."""
    if not times:
        raise ValueError("summarize needs at least one time")
    xs = sorted(float(t) for t in times)
    return {"median": _quantile(xs, 0.5), "p20": _quantile(xs, 0.2), "p80": _quantile(xs, 0.8),
            "min": xs[0], "n": len(xs)}


def gbps(num_bytes: float | None, micros: float | None) -> float | None:
    """Bytes over microseconds in GB/s (1e9 bytes per second); None when either is missing or zero."""
    if not num_bytes or not micros:
        return None
    return num_bytes / (micros * 1e-6) / 1e9


def tflops(flops: float | None, micros: float | None) -> float | None:
    """FLOPs over microseconds in TFLOP/s (1e12 per second); None when either is missing or zero."""
    if not flops or not micros:
        return None
    return flops / (micros * 1e-6) / 1e12


def capture_graph(fn: Callable[[], Any], warmup: int = 0) -> tuple["torch.cuda.CUDAGraph", Any]:
    """Capture `fn` in a CUDA graph; returns (graph, fn's output, rewritten by every replay).

    `warmup` calls run first on a side stream (as torch recommends before a capture). No
    garbage collection during capture: freeing a symmetric arena there would synchronise the
    device and invalidate the capture.
    """
    if warmup:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with torch.no_grad(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = fn()
    finally:
        gc.enable()
    return graph, out
