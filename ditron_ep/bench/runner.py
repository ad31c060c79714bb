"""Run benchmark requests on the ranks of the default process group; measurements become rows.

`run_requests` is the rank function: every rank calls it with the same requests (directly under
torchrun, through `EmulatedCluster.run` on emulated ranks) and gets the same rows back, because
every time is the slowest rank's and every check is agreed by all ranks. A config (one benchmark
at one token count) that fails on any rank fails on all of them and the run goes on; if the
process group itself breaks, the configs left are recorded as not run, and so are the configs
not started within the time budget (the ranks agree on the time spent).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ditron_ep.bench.progress import ProgressFn
from ditron_ep.bench.ranks import Fatal, RankContext, StageFailed
from ditron_ep.bench.registry import BENCHMARKS
from ditron_ep.bench.spec import DTYPES, BenchContext, Benchmark, BenchRequest, Impl, Measurement, Row, failed
from ditron_ep.bench.timing import gbps, summarize, tflops

RowsFn = Callable[[Sequence[Row]], None]


def iterations(requests: Sequence[BenchRequest], on_gpu: bool) -> int:
    """Calls of timed functions the requests make in all, warm-up included (the progress total)."""
    total = 0
    for r in requests:
        bench = BENCHMARKS[r.bench]
        options = bench.parse_options(r.options)
        timed = sum(i.timed for t in r.tokens for i in bench.plan(r, t, options, on_gpu))
        total += timed * (r.warmup + r.iters)
    return total


class _Counter:
    """Counts the iterations reported, and forwards them to the sink (rank 0's, else none)."""

    def __init__(self, sink: ProgressFn | None) -> None:
        self.sink, self.done = sink, 0

    def __call__(self, description: str, done: int) -> None:
        self.done += done
        if self.sink is not None:
            self.sink(description, done)


def _elapsed_on_every_rank(ctx: RankContext, start: float) -> float:
    """Collective: the longest time any rank has spent since its `start`."""
    try:
        t = ctx.coll_tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    except Exception as exc:  # the group itself is broken
        raise Fatal(f"collective failed while agreeing on the time spent: {type(exc).__name__}: {exc}") from exc
    return float(t.item())


def run_requests(requests: Sequence[BenchRequest], backend: str, progress: ProgressFn | None = None,
                 on_config: RowsFn | None = None, time_budget_s: float | None = None) -> list[Row]:
    """Run every request on this rank (collective); `progress` and `on_config` (called with the
    rows so far after every config) are used on rank 0 only. Configs not started within
    `time_budget_s` seconds are recorded as not run.

    backend: "torch" (this rank's current CUDA device) or "emulated" (CPU).
    """
    start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "torch" else torch.device("cpu")
    counter = _Counter(progress if rank == 0 else None)
    rows: list[Row] = []
    broken: str | None = None
    for req in requests:
        bench = BENCHMARKS[req.bench]
        options = bench.parse_options(req.options)
        ctx = BenchContext(rank=rank, world=world, device=device, dtype=DTYPES[req.dtype], seed=req.seed,
                           request=req, options=options, progress=counter)
        for tokens in req.tokens:
            impls = bench.plan(req, tokens, options, ctx.on_cuda)
            ctx.label = f"{bench.name} T={tokens}"
            end = counter.done + sum(i.timed for i in impls) * (req.warmup + req.iters)
            counter(f"{ctx.label} · setup and result check", 0)
            if broken is None and time_budget_s is not None:
                try:
                    spent = _elapsed_on_every_rank(ctx, start)
                except Fatal as exc:
                    broken = f"the process group broke earlier ({exc})"
                else:
                    if spent > time_budget_s:
                        broken = f"the time budget of {time_budget_s:g} s was spent"
            if broken is not None:
                measured = failed([i.name for i in impls], f"not run: {broken}")
            else:
                try:
                    measured = bench.run(ctx, tokens)
                except StageFailed as exc:
                    measured = failed([i.name for i in impls], str(exc))
                except Fatal as exc:
                    broken = f"the process group broke earlier ({exc})"
                    measured = failed([i.name for i in impls], str(exc))
            counter(f"{ctx.label} · done", end - counter.done)   # failed stages skip their iterations
            rows.extend(build_rows(bench, req, tokens, world, measured, impls))
            if on_config is not None and rank == 0:
                on_config(rows)
    return rows


def build_rows(bench: Benchmark, req: BenchRequest, tokens: int, world: int,
               measured: Sequence[Measurement], impls: Sequence[Impl]) -> list[Row]:
    """One Row per planned impl, in plan order: summary, metric, and the speedup of each of ours
    over each baseline of its `against` (baseline median / ours median). A planned impl that
    `measured` lacks fails ("returned no result"); a measurement of no planned impl is dropped."""
    by_impl = {m.impl: m for m in measured}
    stats = {m.impl: summarize(m.times_us) for m in measured if m.times_us and m.error is None}
    medians = {i: s["median"] for i, s in stats.items()}
    medians.update({m.impl: m.value_us for m in measured if m.times_us is None and m.value_us and m.error is None})
    named = {b for i in impls for b in i.against}   # a reference row (a floor, cuBLAS alone) named by an `against`
    base = {i.name: medians[i.name] for i in impls
            if (i.kind == "baseline" or i.name in named) and i.name in medians and by_impl[i.name].ok}
    rate = gbps if bench.metric == "GB/s" else tflops
    s = req.shape
    rows = []
    for impl in impls:
        m = by_impl.get(impl.name) or Measurement(impl.name, ok=False,
                                                  error=f"{bench.name} returned no result for {impl.name}")
        st = stats.get(impl.name)
        median = medians.get(impl.name)
        ours = impl.kind == "ours"
        speedups = {b: base[b] / median for b in impl.against if b in base} if (ours and median) else {}
        first = impl.against[0] if (ours and impl.against) else None
        rows.append(Row(
            bench=bench.name, impl=impl.name, kind=impl.kind, tokens=tokens, hidden=s.hidden,
            experts=s.experts, topk=s.topk, inter=s.inter, dtype=req.dtype, routing=req.routing,
            world_size=world, iters=req.iters, median_us=median, p20_us=st["p20"] if st else None,
            p80_us=st["p80"] if st else None, metric=bench.metric, metric_value=rate(m.work, median),
            baseline=first, speedup=speedups.get(first) if first else None, speedups=speedups, check=m.check,
            ok=bool(m.ok and m.error is None and median is not None), error=m.error, details=dict(m.details)))
    return rows
