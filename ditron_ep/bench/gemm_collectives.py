"""Registry entry "gemm_collectives": the tensor-parallel GEMM + collective ops against NCCL + cuBLAS
in sequence and cuBLAS alone, at the shapes of the GEMM + collective issue, on every rank.

Tokens = M, the rows of `a` per rank. The ops at each M (K, N from the issue's table; `--opt
kn=KxN` replaces them, every op):
    M=128:  GEMM+AR 8192×8192          M=1024: AG+GEMM 8192×8192, GEMM+RS 8192×8192
    M=4096: AG+GEMM 8192×8192          M=8192: AG+GEMM 8192×3584, GEMM+RS 3584×8192
Rows of one (op, K, N):
    ours <op>           ditron_ep.ops.all_gather_matmul / matmul_reduce_scatter / matmul_all_reduce
                        (their sequential schedule: agreement, collective, our GEMM; fp32 partials
                        added in rank order);
    ours overlap AG+GEMM  all_gather_matmul(schedule="overlap"): one persistent launch, copies and
                        GEMM tiles in one queue; checked bitwise against "ours";
    ours overlap GEMM+RS  matmul_reduce_scatter(schedule="overlap"): one persistent launch, partial
                        tiles written into their owner's buffer, reduced as they land; bitwise vs "ours";
    ours overlap GEMM+AR  matmul_all_reduce(schedule="overlap"): the same with tiles owned round-robin,
                        each owner's sum written to every rank; bitwise vs "ours";
    ours overlap, CUDA graph <op>  (GPUs) the overlapped call captured once and timed as graph
                        replays: no host path (agreement, launch, error read); bitwise vs "ours";
    NCCL+cuBLAS <op>    all_gather_into_tensor + torch.mm / torch.mm + reduce_scatter_tensor /
                        torch.mm + all_reduce (gloo on emulated ranks);
    torch symm_mem <op> (GPUs, AG+GEMM and GEMM+RS) PyTorch's overlapped ops on symmetric memory,
                        torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter;
    cuBLAS alone <op>   torch.mm of the op's GEMM on this rank (the time an overlapped kernel
                        would hide the communication behind).
Work: this rank's GEMM FLOPs, 2·rows·K·N (rows = W·M for AG+GEMM and GEMM+RS, M for GEMM+AR).
Check: ours against NCCL+cuBLAS's output within the dtype's rtol (the summation orders differ).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ditron_ep.bench.gemm_core import _parse_kn
from ditron_ep.bench.moe_layer import LAYER_DTYPES
from ditron_ep.bench.ranks import StageFailed, all_ranks, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, Shape, \
    tolerance_check
from ditron_ep.bench.timing import capture_graph
from ditron_ep.check.tolerances import TOLERANCES

OPS = {"ag": "AG+GEMM", "rs": "GEMM+RS", "ar": "GEMM+AR"}
GPU_CASES = {128: (("ar", 8192, 8192),), 1024: (("ag", 8192, 8192), ("rs", 8192, 8192)),
             4096: (("ag", 8192, 8192),), 8192: (("ag", 8192, 3584), ("rs", 3584, 8192))}
CPU_CASES = (("ag", 40, 24), ("rs", 24, 40), ("ar", 40, 24))
OVERLAPPED = ("ag", "rs", "ar")  # the ops with an overlapped schedule
SYMM_MEM_OPS = ("ag", "rs")       # the ops torch.ops.symm_mem fuses (GPUs)


def cases(tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[tuple[str, int, int], ...]:
    kn = options.get("kn")
    if kn:
        return tuple((op, k, n) for op in OPS for k, n in kn)
    if not on_gpu:
        return CPU_CASES
    return GPU_CASES.get(tokens, tuple((op, 8192, 8192) for op in OPS))


def name(kind: str, op: str, k: int, n: int) -> str:
    return f"{kind} {OPS[op]} K={k} N={n}"


def run_gemm_collectives(ctx: BenchContext, tokens: int) -> list[Measurement]:
    from ditron_ep.ops.tp import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    m, world, dev, dt, grp = tokens, ctx.world, ctx.device, ctx.dtype, ctx.group
    out: list[Measurement] = []
    g = torch.Generator(device=dev).manual_seed(ctx.seed * 1000 + 41 + ctx.rank)
    with torch.no_grad():
        for op, k, n in cases(tokens, ctx.options, ctx.on_cuda):
            rows = m if op in ("ag", "ar") else world * m
            a = torch.randn(rows, k, generator=g, device=dev).to(dt)
            b = (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(dt)
            gemm_rows = rows if op == "ar" else world * m
            work = 2.0 * gemm_rows * k * n
            if op == "ag":
                gathered = torch.empty(world * m, k, dtype=dt, device=dev)
                base: Callable[[], torch.Tensor] = lambda a=a, b=b, gathered=gathered: (
                    dist.all_gather_into_tensor(gathered, a, group=grp), torch.mm(gathered, b))[1]
                ours = lambda a=a, b=b: all_gather_matmul(a, b, group=grp)
                alone_a = torch.randn(world * m, k, generator=g, device=dev).to(dt)
            elif op == "rs":
                y = torch.empty(m, n, dtype=dt, device=dev)
                base = lambda a=a, b=b, y=y: (dist.reduce_scatter_tensor(y, torch.mm(a, b), group=grp), y)[1]
                ours = lambda a=a, b=b: matmul_reduce_scatter(a, b, group=grp)
                alone_a = a
            else:
                def base(a=a, b=b):
                    p = torch.mm(a, b)
                    dist.all_reduce(p, group=grp)
                    return p
                ours = lambda a=a, b=b: matmul_all_reduce(a, b, group=grp)
                alone_a = a
            details = {"m": m, "k": k, "n": n, "world": world}
            out.append(ctx.measure(name("cuBLAS alone", op, k, n), lambda x=alone_a, b=b: torch.mm(x, b), work,
                                   "reference", True, details=details))
            try:
                want = guarded(ctx, f"{name('NCCL+cuBLAS', op, k, n)} (check)", base)
                got = guarded(ctx, f"{name('ours', op, k, n)} (check)", ours)
            except StageFailed as exc:
                out.append(Measurement(name("ours", op, k, n), work=work, ok=False, error=str(exc)))
                out.append(Measurement(name("NCCL+cuBLAS", op, k, n), work=work, ok=False, error=str(exc)))
                continue
            rel = relative_errors(ctx, want, {"ours": got})["ours"]
            out.append(ctx.measure(name("ours", op, k, n), ours, work, *tolerance_check(rel, TOLERANCES[dt][0]),
                                   details=details))
            if op in OVERLAPPED:  # the overlapped schedule: bitwise the sequential one
                fn = {"ag": all_gather_matmul, "rs": matmul_reduce_scatter, "ar": matmul_all_reduce}[op]
                over = lambda a=a, b=b, fn=fn: fn(a, b, group=grp, schedule="overlap")
                try:
                    same = all_ranks(ctx, torch.equal(guarded(ctx, f"{name('ours overlap', op, k, n)} (check)", over),
                                                      got))
                    out.append(ctx.measure(name("ours overlap", op, k, n), over, work,
                                           "bitwise = ours" if same else "FAIL: differs from ours", same,
                                           details=details))
                except StageFailed as exc:
                    out.append(Measurement(name("ours overlap", op, k, n), work=work, ok=False, error=str(exc)))
                if ctx.on_cuda:
                    out.append(_measure_graph(ctx, name("ours overlap, CUDA graph", op, k, n), over, got, work,
                                              details))
            if ctx.on_cuda and op in SYMM_MEM_OPS:
                out.append(_measure_symm_mem(ctx, op, a, b, want, work, details))
            out.append(ctx.measure(name("NCCL+cuBLAS", op, k, n), base, work, "reference", True, details=details))
            del a, b, alone_a
    return out


def _measure_graph(ctx: BenchContext, impl: str, fn: Callable[[], torch.Tensor], want: torch.Tensor, work: float,
                   details: dict) -> Measurement:
    """`fn` (an overlapped op, already called eagerly: its heap exists) captured once in a CUDA
    graph and timed as replays — the op without its host path (agreement, launch, error read),
    as decode loops run it; checked bitwise against the sequential schedule's output."""
    try:
        graph, y = guarded(ctx, f"{impl} (capture)", lambda: capture_graph(fn))
        guarded(ctx, f"{impl} (check)", graph.replay)
    except StageFailed as exc:
        return Measurement(impl, work=work, ok=False, error=str(exc))
    same = all_ranks(ctx, torch.equal(y, want))
    return ctx.measure(impl, graph.replay, work, "bitwise = ours" if same else "FAIL: differs from ours", same,
                       details=details)


def _measure_symm_mem(ctx: BenchContext, op: str, a: torch.Tensor, b: torch.Tensor, want: torch.Tensor, work: float,
                      details: dict) -> Measurement:
    """PyTorch's own overlapped op (torch.ops.symm_mem, async TP on symmetric memory) as a baseline,
    checked against NCCL+cuBLAS's output within the dtype's rtol."""
    impl = name("torch symm_mem", op, details["k"], details["n"])

    def enable() -> None:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # absent on some builds

        enable_symm_mem_for_group(group_name)

    group_name = (ctx.group if ctx.group is not None else dist.group.WORLD).group_name
    try:
        guarded(ctx, f"{impl} (enable)", enable)
        if op == "ag":
            fn = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group_name)[1][0]  # noqa: E731
        else:
            fn = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)  # noqa: E731
        got = guarded(ctx, f"{impl} (check)", fn)
    except StageFailed as exc:
        return Measurement(impl, work=work, ok=False, error=str(exc))
    rel = relative_errors(ctx, want, {"g": got})["g"]
    return ctx.measure(impl, fn, work, *tolerance_check(rel, TOLERANCES[ctx.dtype][0]), details=details)


def plan_gemm_collectives(req: BenchRequest, tokens: int, options: Mapping[str, Any],
                          on_gpu: bool) -> tuple[Impl, ...]:
    ours, base = [], []
    for op, k, n in cases(tokens, options, on_gpu):
        theirs = (name("NCCL+cuBLAS", op, k, n), *((name("torch symm_mem", op, k, n),) if on_gpu and op in SYMM_MEM_OPS
                                                  else ()))
        ours.append(Impl(name("ours", op, k, n), against=(*theirs, name("cuBLAS alone", op, k, n))))
        if op in OVERLAPPED:
            ours.append(Impl(name("ours overlap", op, k, n), against=(*theirs, name("cuBLAS alone", op, k, n))))
            if on_gpu:
                ours.append(Impl(name("ours overlap, CUDA graph", op, k, n),
                                 against=(*theirs, name("cuBLAS alone", op, k, n))))
        base += [*(Impl(t, "baseline") for t in theirs), Impl(name("cuBLAS alone", op, k, n), "reference")]
    return (*ours, *base)


def validate(req: BenchRequest, options: Mapping[str, Any], world_size: int) -> str | None:
    if world_size < 2:
        return "gemm_collectives needs at least 2 ranks (--world-size, or torchrun --nproc-per-node)"
    return None


GEMM_COLLECTIVES = Benchmark(
    name="gemm_collectives",
    description="tensor-parallel GEMM + collective ops (AG+GEMM, GEMM+RS, GEMM+AR; sequential and overlapped schedules) vs "
                "NCCL + cuBLAS in sequence and cuBLAS alone",
    metric="TFLOP/s", work_rule="FLOPs = this rank's GEMM, 2*rows*K*N (rows = W*M for AG+GEMM / GEMM+RS, M for GEMM+AR)",
    check_rule="ours vs NCCL+cuBLAS's output within the dtype's rtol",
    shapes={"emulated": Shape(hidden=0, experts=1, topk=1), "torch": Shape(hidden=0, experts=1, topk=1)},
    tokens={"emulated": (4,), "torch": (128, 1024, 4096, 8192)},
    plan=plan_gemm_collectives, run=run_gemm_collectives, default=False, ep=False, validate=validate,
    options=(Option("kn", "a (K, N) pair KxN for every op (repeatable; default the issue's shapes per M)",
                    _parse_kn, None, repeat=True),),
    dtypes=LAYER_DTYPES, routings=("uniform",))
