"""Functions that run on every emulated rank (imported by name in the rank processes)."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from ditron_ep.runtime import DitronConfigError, DitronTimeoutError, SymmetricHeap


def _expected_tile(src: int, call: int, R: int, C: int, dtype: torch.dtype) -> torch.Tensor:
    # Values exact in every tested dtype (small integers), different per source and per call.
    base = torch.arange(R * C, dtype=torch.int64).reshape(R, C) % 97
    return (base + 100 * src + 3 * call).to(dtype)


def heap_visibility(shapes_dtypes: list) -> list:
    """Allocate several buffers; every rank fills its own, then reads every peer's copy."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with SymmetricHeap(size_bytes=1 << 20) as heap:
        views = []
        for i, (shape, dtype) in enumerate(shapes_dtypes):
            v = heap.alloc(f"buf{i}", shape, dtype)
            v.copy_(torch.full(shape, rank * 10 + i).to(dtype))
            views.append(v)
        offsets = [heap.offset_of(f"buf{i}") for i in range(len(views))]
        heap.barrier()
        seen = {}
        for peer in range(world):
            for i, (shape, dtype) in enumerate(shapes_dtypes):
                got = heap.peer_view(f"buf{i}", peer)
                seen[(peer, i)] = bool(torch.equal(got, torch.full(shape, peer * 10 + i).to(dtype)))
        heap.barrier()
        return [offsets, seen, heap.ptr_table.tolist()]


def exchange(R: int, C: int, dtype: torch.dtype, n_calls: int = 1, programs: int | None = None,
             start_call: int | None = None, check_every: int = 1) -> dict:
    """Run `n_calls` tile exchanges back to back; verify every received tile element-exact."""
    from ditron_ep.check.kernels import exchange_tiles

    rank, world = dist.get_rank(), dist.get_world_size()
    heap = SymmetricHeap(size_bytes=2 << 20, wait_budget=50_000)
    if start_call is not None:
        heap.reset(start_call)
    mismatches = []
    t0 = time.time()
    for call in range(n_calls):
        out = exchange_tiles(heap, _expected_tile(rank, call, R, C, dtype), num_programs=programs,
                             check=(call % check_every == check_every - 1) or call == n_calls - 1)
        if out.shape != (world, R, C):
            mismatches.append((call, "shape", tuple(out.shape)))
            continue
        for src in range(world):
            if not torch.equal(out[src], _expected_tile(src, call, R, C, dtype)):
                mismatches.append((call, src))
    elapsed = time.time() - t0
    heap_calls = heap.call_number
    heap.free()
    return {"mismatches": mismatches, "calls": heap_calls, "seconds": elapsed}


def timeout_then_recover(budget: int) -> dict:
    """Rank 0 launches an exchange that rank 1.. do not join in time: its call barrier must time
    out. Rank 1 then makes that call late: it raises DitronOutOfStepError (rank 0 gave up on
    it). With no reset, the next exchange of every rank is exact."""
    from ditron_ep.runtime.errors import DitronOutOfStepError
    from ditron_ep.check.kernels import exchange_tiles

    rank = dist.get_rank()
    heap = SymmetricHeap(size_bytes=1 << 20, wait_budget=budget)
    exchange_tiles(heap, torch.ones(4, 8))  # together once: the buffers exist on every rank
    result: dict = {}
    if rank == 0:
        t0 = time.time()
        try:
            exchange_tiles(heap, torch.ones(4, 8))
            result["raised"] = None
        except DitronTimeoutError as err:
            result.update(raised=str(err), rank=err.rank, stage=err.stage, signal=err.signal,
                          expected=err.expected)
        result["seconds"] = time.time() - t0
    dist.barrier()
    if rank == 1:
        try:
            exchange_tiles(heap, torch.ones(4, 8))
            result["late"] = None
        except DitronOutOfStepError as err:
            result["late"] = str(err)
    out = exchange_tiles(heap, torch.full((4, 8), float(rank)))
    result["recovers"] = all(torch.equal(out[s], torch.full((4, 8), float(s)))
                                   for s in range(dist.get_world_size()))
    heap.free()
    return result


def kill_during_collective() -> None:
    heap = SymmetricHeap(size_bytes=1 << 20)
    heap.alloc("x", (16,), torch.float32)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    heap.barrier()  # the survivors block here until the launcher kills them


def asymmetric_alloc() -> str:
    heap = SymmetricHeap(size_bytes=1 << 20)
    try:
        heap.alloc("x", (8 + dist.get_rank(),), torch.float32)
        return "no error"
    except DitronConfigError as err:
        return str(err)
    finally:
        heap.free()


def bad_inputs() -> dict:
    """Every misuse must raise DitronConfigError with a message naming the fix."""
    from ditron_ep.check.kernels import exchange_tiles

    world = dist.get_world_size()
    msgs = {}

    def catch(key, fn):
        try:
            fn()
            msgs[key] = "no error"
        except DitronConfigError as err:
            msgs[key] = str(err)

    catch("world_size", lambda: SymmetricHeap(expected_world_size=world + 1))
    catch("backend", lambda: SymmetricHeap(backend="nccl-magic"))
    catch("torch_on_cpu", lambda: SymmetricHeap(backend="torch"))
    # a bad argument on one rank only: every rank raises (none is left in the set-up collectives)
    catch("one_rank_bad", lambda: SymmetricHeap(size_bytes=1 << 20, wait_budget=0 if dist.get_rank() == 1 else 1000))
    heap = SymmetricHeap(size_bytes=1 << 20)
    catch("non_contiguous", lambda: exchange_tiles(heap, torch.ones(8, 4).t()))
    catch("dtype", lambda: exchange_tiles(heap, torch.ones(4, 4, dtype=torch.float64)))
    catch("device", lambda: exchange_tiles(heap, torch.ones(4, 4, device="meta")))
    catch("ndim", lambda: exchange_tiles(heap, torch.ones(4)))
    catch("heap_full", lambda: heap.alloc("huge", (1 << 20,), torch.float32))
    heap.free()
    catch("after_free", lambda: heap.alloc("x", (1,), torch.float32))
    return msgs


def timing_with_skew(align: bool, skew_s: float) -> list:
    """time_fn of a one-element all_reduce while rank 1 leaves every barrier skew_s late (the
    host skew the timing rule may or may not count); returns the slowest rank's times (µs)."""
    from ditron_ep.bench import timing

    rank = dist.get_rank()
    real_barrier = dist.barrier

    def late_barrier(*args, **kwargs):
        real_barrier(*args, **kwargs)
        if rank == 1:
            time.sleep(skew_s)

    t = torch.zeros(1)
    dist.barrier = late_barrier
    try:
        return timing.time_fn(lambda: dist.all_reduce(t), iters=3, warmup=1, align=align)
    finally:
        dist.barrier = real_barrier


def timing_error_on_one_rank(align: bool) -> str:
    """time_fn where rank 1's third call raises: every rank returns or raises, none hangs."""
    from ditron_ep.bench import timing

    rank, calls = dist.get_rank(), []

    def fn():
        calls.append(1)
        if rank == 1 and len(calls) == 3:
            raise ValueError("boom on rank 1")

    try:
        times = timing.time_fn(fn, iters=4, warmup=1, align=align)
    except ValueError as err:
        return f"raised: {err}"
    return f"returned {len(times)} times"
