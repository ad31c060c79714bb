"""Registry entry "moe_timeline": where the fused MoE kernel's time goes, per plan variant.

For every T: one `FusedMoE` layer per row (`ep_inputs` tokens, routing and weights), built with the
plan's defaults or with a variant (`--opt variant=FIELD=VALUE[,...]`, repeatable: Device-level plan
overrides such as `comm_programs=0,recv_lag=1024`, or Core-level tile configs such as
`gate_up_config=BM128-BN128-BK64-w8-s3`), then called once with `trace=True` (on GPUs after an
untimed call and an untimed traced call, which compile both kernels: a rank would otherwise wait
out the other's compile inside its traced call), then timed. Rows: "overlap" (the plan's
defaults) and "overlap <variant>" against "sequential" (the same megakernel run stage by stage).
Per row and rank the JSON details keep `overlap_report()` (GEMM tiles started before the last
remote dispatch chunk was placed, from the logical clock), the plan's fields and, on GPUs,
`timeline()` (per stage: when its first task started and its last ended, µs after program 0
entered the kernel, busy time per program, task-duration percentiles); all are printed after
the table. Check: every output equals the sequential schedule's bit for bit (a tile config may
change the fp32 summation of the dot products: such a variant is checked within the dtype's
rtol instead).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from rich import box
from rich.table import Table

from ditron_ep.bench.ep_inputs import Inputs, Weights
from ditron_ep.bench.moe_layer import FLOP_RULE, LAYER_DTYPES, LAYER_ROUTINGS, LAYER_SHAPES, layer_case
from ditron_ep.bench.ranks import StageFailed, all_ranks, gather, guarded, relative_errors
from ditron_ep.bench.spec import (BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, bitwise_check,
                                  tolerance_check)
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.compiler.core_config import GemmTileConfig
from ditron_ep.ops.moe_layer.fused import FusedMoE

BASELINE = "sequential"


def parse_variant(text: str) -> tuple[tuple[str, Any], ...]:
    """'comm_programs=0,recv_lag=8' -> (('comm_programs', 0), ('recv_lag', 8)): ints where they
    parse, gate_up_config / down_config as GEMM tile configs (e.g. down_config=BM128-BN128-BK64-w8-s3)."""
    out: list[tuple[str, Any]] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected FIELD=VALUE[,FIELD=VALUE...], got {item!r}")
        if key.endswith("_config"):
            out.append((key, GemmTileConfig.parse(value)))
        else:
            out.append((key, int(value) if value.lstrip("-").isdigit() else value))
    if not out:
        raise ValueError("empty variant: the plan's defaults are always the row 'overlap'")
    return tuple(out)


def variant_name(variant: tuple[tuple[str, Any], ...]) -> str:
    return "overlap " + ",".join(f"{k}={v}" for k, v in variant)


def describe(layer: FusedMoE) -> dict[str, Any]:
    d, core = layer.plan.device, layer.plan.core
    return {"schedule": d.schedule, "comm_programs": d.comm_programs, "recv_lag": d.recv_lag,
            "chunk_rows": layer.plan.routing.chunk_rows, "block_t": d.block_t, "gemm_tile_order": d.gemm_tile_order,
            "gemm_group_rows": d.gemm_group_rows, "gate_up_config": str(core.gate_up), "down_config": str(core.down)}


def traced_layer(ctx: BenchContext, impl: str, inp: Inputs, wts: Weights, flops: float, schedule: str,
                 overrides: Mapping[str, Any], want: torch.Tensor | None) -> tuple[Measurement, torch.Tensor | None]:
    """Build, trace, check against `want` (None: the baseline) and time one layer; (row, traced output)."""
    s = ctx.shape
    layer: list[FusedMoE] = []

    def call(trace: bool = False) -> torch.Tensor:
        return layer[0](inp.x, inp.idx, inp.w, wts.w1, wts.w2, trace=trace)

    def warm_up() -> None:
        layer.append(FusedMoE(ctx.group, s.experts, s.hidden, s.inter, inp.x.shape[0], s.topk, ctx.dtype,
                              schedule=schedule, **overrides))
        if ctx.on_cuda:
            call()
            call(trace=True)
            torch.cuda.synchronize(ctx.device)

    def traced() -> tuple[torch.Tensor, dict[str, Any]]:
        out = call(trace=True)
        rep = {"plan": describe(layer[0]), "overlap": layer[0].overlap_report()}
        if ctx.on_cuda:
            rep["timeline"] = layer[0].timeline()
        return out, rep

    try:
        guarded(ctx, f"{impl} (build, warm-up)", warm_up)
        dist.barrier(group=ctx.group)   # the traced call starts together on every rank
        out, rep = guarded(ctx, f"{impl} (trace)", traced)
        reps = gather(ctx, rep)
        details = {"plan": reps[0]["plan"], "overlap": [r["overlap"] for r in reps]}
        if ctx.on_cuda:
            details["timeline"] = [r["timeline"] for r in reps]
        if want is None:
            check: tuple[str, bool] = ("reference", True)
        elif any(k.endswith("_config") for k in overrides):
            check = tolerance_check(relative_errors(ctx, want, {impl: out})[impl], TOLERANCES[ctx.dtype][0])
        else:
            check = bitwise_check(all_ranks(ctx, torch.equal(out, want)), BASELINE)
        return ctx.measure(impl, call, flops, *check, details=details), out
    except StageFailed as exc:
        return Measurement(impl, work=flops, ok=False, error=str(exc)), None
    finally:
        for lay in layer:
            lay.free()


def run_timeline(ctx: BenchContext, tokens: int) -> list[Measurement]:
    case = layer_case(ctx, tokens)
    inp, wts, flops = case.inp, case.wts, case.flops
    with torch.no_grad():
        base, want = traced_layer(ctx, BASELINE, inp, wts, flops, "sequential", {}, None)
        out = []
        for impl, overrides in (("overlap", ()), *((variant_name(v), v) for v in ctx.options["variant"])):
            if want is None:
                out.append(Measurement(impl, work=flops, ok=False, error="not checked: the sequential layer failed"))
                continue
            out.append(traced_layer(ctx, impl, inp, wts, flops, "overlap", dict(overrides), want)[0])
    return [*out, base]


def plan_timeline(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    names = ["overlap", *(variant_name(v) for v in options["variant"])]
    return (*(Impl(n, against=(BASELINE,)) for n in names), Impl(BASELINE, "baseline"))


def view(bench: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Per row: the overlap report and plan of every rank; on GPUs one timeline table per row."""
    parts: list[Any] = []
    report = Table(title="moe_timeline — overlap report per rank (logical clock) and plan", title_justify="left",
                   box=box.SIMPLE_HEAD)
    for col in ("T", "impl", "rank", "gate-up tiles", "started before last remote chunk", "plan"):
        report.add_column(col, justify="right" if col in ("T", "rank", "gate-up tiles") else "left",
                          overflow="fold")
    for r in rows:
        plan = r["details"].get("plan", {})
        text = " ".join(f"{k}={v}" for k, v in plan.items() if k != "schedule")
        for rank, rep in enumerate(r["details"].get("overlap", [])):
            report.add_row(str(r["tokens"]), r["impl"], str(rank), str(rep["gate_up_tiles"]),
                           str(rep["started_before_last_remote_chunk"]), text if rank == 0 else "",
                           end_section=rank + 1 == len(r["details"]["overlap"]))
    parts.append(report)
    for r in rows:
        per_rank = r["details"].get("timeline")
        if not per_rank:
            continue
        table = Table(title=f"moe_timeline T={r['tokens']} {r['impl']} — device timer, µs after program 0 "
                            f"entered the kernel", title_justify="left", box=box.SIMPLE_HEAD)
        for col in ("rank", "stage", "tasks", "first start", "last end", "busy/program", "task p50", "task p90"):
            table.add_column(col, justify="left" if col == "stage" else "right")
        for rank, stages in enumerate(per_rank):
            for i, st in enumerate(stages):
                table.add_row(str(rank), st["stage"], str(st["tasks"]), f"{st['first_start_us']:,.1f}",
                              f"{st['last_end_us']:,.1f}", f"{st['busy_us_per_program']:,.1f}",
                              *(f"{st[k]:,.1f}" if k in st else "—" for k in ("task_p50_us", "task_p90_us")),
                              end_section=i + 1 == len(stages))
        parts.append(table)
    return parts


MOE_TIMELINE = Benchmark(
    name="moe_timeline",
    description="the fused MoE kernel per plan variant: one traced launch (overlap report; per-stage timeline "
                "on GPUs), then timed, against the sequential schedule",
    metric="TFLOP/s", work_rule=FLOP_RULE,
    check_rule="output == the sequential schedule's, bit for bit (a variant with a tile config: within the "
               "dtype's rtol)",
    shapes=LAYER_SHAPES, tokens={"emulated": (8,), "torch": (128, 4096)},
    plan=plan_timeline, run=run_timeline, default=False, view=view,
    options=(Option("variant", "one more overlap layer with these plan fields, e.g. comm_programs=0,recv_lag=1024 "
                               "or gate_up_config=BM128-BN128-BK64-w8-s3 (repeatable)", parse_variant, repeat=True),),
    dtypes=LAYER_DTYPES, routings=LAYER_ROUTINGS)
