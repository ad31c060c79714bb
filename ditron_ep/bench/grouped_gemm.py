"""Registry entry "grouped_gemm": the grouped SwiGLU expert FFN (`grouped_mlp`) against
torch._grouped_mm, on each rank's own GPU (no communication; the time is the slowest rank's).

Rows of one config (T tokens per rank): the per-rank rows of an EP layer of `--opt ranks=R` ranks
(default 4) whose E experts in all are spread E/R per rank: R*T tokens routed top-K (the request's
routing) and the rows of the first E/R experts kept, expert-major, then by token. Ours reads them
through `row_index` from the R*T tokens, as the layer does (`--opt rows=contiguous`: rows
pre-gathered); torch's always gets them pre-gathered. Weights as the MoE layer's
(`ep_inputs.make_weights`). Rows of the table:
  gate-up+SwiGLU, down, FFN   ours with the default tile configs on the persistent grid (one
                      program per SM): h = silu(x_r @ gate) * (x_r @ up) (`launch_grouped_up`),
                      y = h @ W2 (`launch_grouped_down`), both (`grouped_mlp`);
  torch ..., W row-major / col-major   torch._grouped_mm with W [E, K, N] row-major or as a
                      column-major view of [E, N, K] storage (gate-up: + silu(g) * u elementwise);
  with --opt sweep=1 also every tile config of the sweep (GATE_UP_CONFIGS / DOWN_CONFIGS, smaller
                      ones under the interpreter) on the persistent grid and on a one-tile-per-program
                      grid, and the FFN with the best gate-up and down configs of the sweep.
Checks, once per row before timing: its output against torch's (down: on the same h) within the
dtype's rtol, max |diff| / max |ref| over every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ditron_ep.bench.ep_inputs import Weights, make_weights
from ditron_ep.bench.moe_layer import LAYER_DTYPES, LAYER_ROUTINGS, LAYER_SHAPES, gemm_flops
from ditron_ep.bench.ranks import StageFailed, guarded, relative_errors
from ditron_ep.bench.spec import (BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, Shape, boolean,
                                  one_of, positive_int, tolerance_check)
from ditron_ep.bench.timing import summarize
from ditron_ep.bench.torch_moe import torch_down, torch_gate_up
from ditron_ep.check import make_routing
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs
from ditron_ep.ops.moe_layer.grouped import grouped_mlp, launch_grouped_down, launch_grouped_up
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map

FLOP_RULE = ("FLOPs = 2*rows*H*2I (gate-up) + 2*rows*I*H (down), rows = this rank's routed rows (the slowest "
             "rank's time); the SwiGLU elementwise op is not counted (fused in ours, separate kernels in torch's).")
STAGES = ("gate-up+SwiGLU", "down", "FFN")
LAYOUTS = ("row", "col")
C = GemmTileConfig
GATE_UP_CONFIGS = (C(128, 128, 64, 8, 4), C(128, 128, 64, 8, 3), C(128, 64, 64, 4, 4), C(256, 64, 64, 8, 3),
                   # small row tiles for decode (~64 rows per expert): more weight bytes in flight per row
                   C(64, 128, 64, 4, 4), C(64, 64, 128, 4, 4), C(64, 128, 128, 4, 3), C(64, 64, 64, 4, 6))
DOWN_CONFIGS = (C(128, 256, 64, 8, 4), C(128, 256, 64, 8, 3), C(128, 128, 64, 4, 4), C(256, 128, 64, 8, 3),
                C(64, 256, 64, 8, 4), C(64, 128, 128, 4, 4), C(64, 128, 64, 4, 6), C(64, 64, 128, 4, 4))
INTERPRETER_CONFIGS = ((C(16, 16, 32, 4, 1), C(32, 16, 16, 4, 1)), (C(16, 32, 16, 4, 1), C(32, 64, 32, 4, 1)))
ONE_TILE = 2**31 - 1  # num_programs that gives every tile its own program (the launcher clamps the grid)
GRIDS = ("persistent", "one-tile")
BEST_FFN = "FFN, best swept pair"


def torch_name(stage: str, layout: str) -> str:
    return f"torch {stage}, W {layout}-major"


def swept_name(stage: str, cfg: GemmTileConfig, grid: str) -> str:
    return f"{stage} {cfg} {grid}"


def sweep_configs(on_gpu: bool) -> dict[str, tuple[GemmTileConfig, ...]]:
    gate_up, down = (GATE_UP_CONFIGS, DOWN_CONFIGS) if on_gpu else INTERPRETER_CONFIGS
    return {"gate-up+SwiGLU": gate_up, "down": down}


@dataclass
class Case:
    x: torch.Tensor                    # [N, H] tokens (N = ranks * T), or the rows themselves (contiguous)
    row_index: torch.Tensor | None     # int32 [rows]: row r reads x[row_index[r]]; None: rows = x
    x_rows: torch.Tensor               # [rows, H] pre-gathered (torch's input)
    offsets: torch.Tensor              # int32 [E_local + 1]
    wts: Weights
    sizes: list[int]                   # rows per expert


def make_case(ctx: BenchContext, tokens: int) -> Case:
    """This rank's rows of a layer of `ranks` ranks at `tokens` per rank (its routing drawn from
    seed * 1000 + 900 + rank, its tokens from the generator of ep_inputs' tokens)."""
    s, o = ctx.shape, ctx.options
    ranks = o.get("ranks", 4)
    e_local, n = s.experts // ranks, ranks * tokens
    gen = torch.Generator().manual_seed(ctx.seed * 1000 + 900 + ctx.rank)
    idx, _ = make_routing(n, s.experts, s.topk, ctx.request.routing, generator=gen, num_ranks=ranks)
    token, slot = torch.nonzero((idx >= 0) & (idx < e_local), as_tuple=True)
    order = torch.argsort(idx[token, slot] * n + token)     # expert-major, then token
    sizes = torch.bincount(idx[token, slot], minlength=e_local).tolist()
    offsets = torch.tensor([0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    gx = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1000 + 500 + ctx.rank)
    x = torch.randn(n, s.hidden, generator=gx, device=ctx.device).to(ctx.dtype)
    row_index = token[order].to(torch.int32).to(ctx.device)
    x_rows = x[row_index.long()]
    if o.get("rows", "gathered") == "contiguous":
        x, row_index = x_rows, None
    return Case(x, row_index, x_rows, offsets.to(ctx.device), make_weights(ctx, e_local, s.hidden, s.inter), sizes)


def run_grouped_gemm(ctx: BenchContext, tokens: int) -> list[Measurement]:
    s = ctx.shape
    inter, rtol = s.inter, TOLERANCES[ctx.dtype][0]
    case = guarded(ctx, "inputs", lambda: make_case(ctx, tokens))
    x, idx, off, wts = case.x, case.row_index, case.offsets, case.wts
    offs = off[1:]   # torch._grouped_mm: cumulative row ends
    routed = sum(case.sizes)
    fl_gu, fl_dn = gemm_flops(routed, s.hidden, inter)
    work = {"gate-up+SwiGLU": fl_gu, "down": fl_dn, "FFN": fl_gu + fl_dn}
    details = {"rows": routed, "rows_per_expert": case.sizes}
    precision = "tf32" if ctx.on_cuda else "ieee"
    with torch.no_grad():
        # ---- torch, both weight layouts; the row-major outputs are what ours must match
        h_ref = guarded(ctx, "torch gate-up (check)", lambda: torch_gate_up(case.x_rows, wts.w1, offs))
        y_ref = guarded(ctx, "torch down (check)", lambda: torch_down(h_ref, wts.w2, offs))
        want = {"gate-up+SwiGLU": h_ref, "down": y_ref, "FFN": y_ref}
        out: list[Measurement] = []
        for layout in LAYOUTS:
            w1, w2 = wts.layout("w1", layout == "col"), wts.layout("w2", layout == "col")
            fns: dict[str, Callable[[], object]] = {
                "gate-up+SwiGLU": lambda w1=w1: torch_gate_up(case.x_rows, w1, offs),
                "down": lambda w2=w2: torch_down(h_ref, w2, offs),
                "FFN": lambda w1=w1, w2=w2: torch_down(torch_gate_up(case.x_rows, w1, offs), w2, offs)}
            out += [ctx.measure(torch_name(st, layout), fn, work[st], "reference", True, details=details)
                    for st, fn in fns.items()]

        # ---- ours: one stage with one tile config on one grid
        h = torch.empty(routed, inter, dtype=ctx.dtype, device=ctx.device)
        y = torch.empty(routed, s.hidden, dtype=ctx.dtype, device=ctx.device)

        def stage_fn(stage: str, cfg: GemmTileConfig, programs: int) -> tuple[Callable[[], object], torch.Tensor]:
            tiles = build_tile_map(off, cfg.block_m)
            if stage == "gate-up+SwiGLU":
                return (lambda: launch_grouped_up(x, idx, wts.w1, h, off, tiles, cfg, programs, precision, 1)), h
            return (lambda: launch_grouped_down(h_ref, wts.w2, y, off, tiles, cfg, programs, precision, 1)), y

        def checked(impl: str, stage: str, fn: Callable[[], object], result: Callable[[], torch.Tensor],
                    extra: dict[str, Any]) -> Measurement:
            try:
                got = guarded(ctx, f"{impl} (check)", lambda: (fn(), result())[1])
            except StageFailed as exc:
                return Measurement(impl, work=work[stage], ok=False, error=str(exc))
            rel = relative_errors(ctx, want[stage], {impl: got})[impl]
            return ctx.measure(impl, fn, work[stage], *tolerance_check(rel, rtol), details={**details, **extra})

        sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count if ctx.on_cuda else 1
        grids = {"persistent": sms, "one-tile": ONE_TILE}
        defaults = dict(zip(("gate-up+SwiGLU", "down"),
                            default_gemm_configs(ctx.dtype, "cuda" if ctx.on_cuda else "cpu")))
        for stage, cfg in defaults.items():
            fn, result = stage_fn(stage, cfg, sms)
            out.append(checked(stage, stage, fn, lambda r=result: r, {"config": str(cfg), "num_programs": sms}))

        def ffn(pair: tuple[GemmTileConfig, GemmTileConfig], programs: int | None) -> torch.Tensor:
            return grouped_mlp(x, off, wts.w1, wts.w2, row_index=idx, config=pair, num_programs=programs,
                                      input_precision=precision, check=False)

        pair = (defaults["gate-up+SwiGLU"], defaults["down"])
        out.append(checked("FFN", "FFN", lambda: ffn(pair, None), lambda: ffn(pair, None),
                           {"config": [str(c) for c in pair]}))

        # ---- the sweep: every config on both grids, then the FFN with the best pair
        if ctx.options.get("sweep", False):
            best: dict[str, tuple[float, GemmTileConfig, int]] = {}
            for stage, cfgs in sweep_configs(ctx.on_cuda).items():
                for cfg in cfgs:
                    for grid, programs in grids.items():
                        fn, result = stage_fn(stage, cfg, programs)
                        m = checked(swept_name(stage, cfg, grid), stage, fn, lambda r=result: r,
                                    {"config": str(cfg), "grid": grid})
                        out.append(m)
                        us = summarize(m.times_us)["median"] if (m.ok and m.times_us) else float("inf")
                        if us < best.get(stage, (float("inf"),))[0]:
                            best[stage] = (us, cfg, programs)
            if set(best) == {"gate-up+SwiGLU", "down"}:
                pair, programs = (best["gate-up+SwiGLU"][1], best["down"][1]), best["down"][2]
                out.append(checked(BEST_FFN, "FFN", lambda: ffn(pair, programs), lambda: ffn(pair, programs),
                                   {"config": [str(c) for c in pair], "num_programs": programs}))
            else:
                out.append(Measurement(BEST_FFN, work=work["FFN"], ok=False, error="no config of a GEMM ran"))
    return out


def plan_grouped_gemm(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    against = {st: tuple(torch_name(st, lay) for lay in LAYOUTS) for st in STAGES}
    ours = [Impl(st, against=against[st]) for st in STAGES]
    if options.get("sweep", False):
        ours += [Impl(swept_name(st, cfg, grid), against=against[st])
                 for st, cfgs in sweep_configs(on_gpu).items() for cfg in cfgs for grid in GRIDS]
        ours.append(Impl(BEST_FFN, against=against["FFN"]))
    return (*ours, *(Impl(torch_name(st, lay), "baseline") for lay in LAYOUTS for st in STAGES))


def validate(req: BenchRequest, options: Mapping[str, Any], world_size: int) -> str | None:
    ranks = options.get("ranks", 4)
    if req.shape.experts % ranks:
        return f"--experts {req.shape.experts} is not a multiple of --opt ranks={ranks}"
    return None


GROUPED_GEMM = Benchmark(
    name="grouped_gemm",
    description="grouped SwiGLU expert FFN (grouped_mlp) vs torch._grouped_mm, on each rank's own GPU, "
                "at a layer's per-rank rows",
    metric="TFLOP/s", work_rule=FLOP_RULE,
    check_rule="output vs torch's (row-major W; down on torch's h) within the dtype's rtol, max |diff| / max |ref| "
               "over every rank",
    shapes={"emulated": Shape(hidden=48, experts=8, topk=2, inter=24), "torch": LAYER_SHAPES["torch"]},
    tokens={"emulated": (8,), "torch": (128, 4096)},
    plan=plan_grouped_gemm, run=run_grouped_gemm, default=False, ep=False, validate=validate,
    options=(Option("sweep", "also time every tile config of the sweep on a persistent and a one-tile grid, "
                             "then the FFN with the best pair", boolean, False),
             Option("ranks", "EP ranks of the layer whose per-rank rows are timed (E/ranks local experts)",
                    positive_int, 4),
             Option("rows", "gathered: ours reads the rows through row_index, as the layer does; contiguous: "
                            "pre-gathered", one_of("gathered", "contiguous"), "gathered")),
    dtypes=LAYER_DTYPES, routings=LAYER_ROUTINGS)
