"""Run benchmark requests on the ranks of the default process group; measurements become rows.

`run_requests` is the rank function: every rank calls it with the same requests (directly under
torchrun, through `EmulatedCluster.run` on emulated ranks) and gets the same rows back, because
every time is the slowest rank's and every check is agreed by all ranks. A config (one benchmark
at one token count) that fails on any rank fails on all of them and the run goes on; if the
process group itself breaks, the configs left are recorded as not run.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ditron_ep.bench.progress import ProgressFn
from ditron_ep.bench.ranks import Fatal, StageFailed
from ditron_ep.bench.registry import BENCHMARKS
from ditron_ep.bench.spec import DTYPES, BenchContext, Benchmark, BenchRequest, Measurement, Row
from ditron_ep.bench.timing import gbps, summarize, tflops


def iterations(requests: Sequence[BenchRequest]) -> int:
    """Calls of timed functions the requests make in all, warm-up included (the progress total)."""
    return sum(len(BENCHMARKS[r.bench].impls) * len(r.tokens) * (r.warmup + r.iters) for r in requests)


class _Counter:
    """Counts the iterations reported, and forwards them to the sink (rank 0's, else none)."""

    def __init__(self, sink: ProgressFn | None) -> None:
        self.sink, self.done = sink, 0

    def __call__(self, description: str, done: int) -> None:
        self.done += done
        if self.sink is not None:
            self.sink(description, done)


def run_requests(requests: Sequence[BenchRequest], backend: str, progress: ProgressFn | None = None) -> list[Row]:
    """Run every request on this rank (collective); `progress` is used on rank 0 only.

    backend: "torch" (this rank's current CUDA device) or "emulated" (CPU).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "torch" else torch.device("cpu")
    counter = _Counter(progress if rank == 0 else None)
    rows: list[Row] = []
    broken: str | None = None
    for req in requests:
        bench = BENCHMARKS[req.bench]
        ctx = BenchContext(rank=rank, world=world, device=device, dtype=DTYPES[req.dtype], seed=req.seed,
                           request=req, progress=counter)
        for tokens in req.tokens:
            ctx.label = f"{bench.name} T={tokens}"
            end = counter.done + len(bench.impls_for(ctx.on_cuda)) * (req.warmup + req.iters)
            counter(f"{ctx.label} · setup and result check", 0)
            if broken is not None:
                measured = _failed(bench, f"not run: {broken}")
            else:
                try:
                    measured = bench.run(ctx, tokens)
                except StageFailed as exc:
                    measured = _failed(bench, str(exc))
                except Fatal as exc:
                    broken = f"the process group broke earlier ({exc})"
                    measured = _failed(bench, str(exc))
            measured = [m for m in measured if m.impl in bench.impls_for(ctx.on_cuda)]
            counter(f"{ctx.label} · done", end - counter.done)   # failed stages skip their iterations
            rows.extend(build_rows(bench, req, tokens, world, measured, on_gpu=ctx.on_cuda))
    return rows


def _failed(bench: Benchmark, error: str) -> list[Measurement]:
    return [Measurement(impl, ok=False, error=error) for impl in bench.impls]


def build_rows(bench: Benchmark, req: BenchRequest, tokens: int, world: int,
               measured: Sequence[Measurement], *, on_gpu: bool = False) -> list[Row]:
    """One Row per implementation of `bench` measured on this kind of device (in `bench.impls`
    order): summary, metric, and the speedup of each of ours over each baseline (baseline
    median / ours median)."""
    by_impl = {m.impl: m for m in measured}
    stats = {m.impl: summarize(m.times_us) for m in measured if m.times_us and m.error is None}
    base = {b: stats[b]["median"] for b in bench.baselines if b in stats and by_impl[b].ok}
    rate = gbps if bench.metric == "GB/s" else tflops
    s = req.shape
    rows = []
    for impl in bench.impls_for(on_gpu):
        m = by_impl.get(impl) or Measurement(impl, ok=False, error=f"{bench.name} returned no result for {impl}")
        st = stats.get(impl)
        median = st["median"] if st else None
        ours = bench.kind_of(impl) == "ours"
        speedups = {b: v / median for b, v in base.items()} if (ours and median) else {}
        rows.append(Row(
            bench=bench.name, impl=impl, kind=bench.kind_of(impl), tokens=tokens, hidden=s.hidden,
            experts=s.experts, topk=s.topk, inter=s.inter, dtype=req.dtype, routing=req.routing,
            world_size=world, iters=req.iters, median_us=median, p20_us=st["p20"] if st else None,
            p80_us=st["p80"] if st else None, metric=bench.metric, metric_value=rate(m.work, median),
            baseline=bench.baselines[0] if ours else None,
            speedup=speedups.get(bench.baselines[0]), speedups=speedups, check=m.check,
            ok=bool(m.ok and m.error is None and median is not None), error=m.error))
    return rows
