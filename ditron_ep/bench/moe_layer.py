"""Registry entry "moe": the EP MoE layer forward (`ditron_ep.ops.moe`) against a torch-native
pipeline, its own grouped GEMM alone, cuBLAS's GEMMs alone and the floor they imply.

Weights per rank (`ep_inputs.make_weights`): w1 [E_local, H, 2I] (gate ‖ up), w2 [E_local, I, H].
Per token count T (per rank), tokens and a routing from `ep_inputs.make_inputs`; the EP buffer and
fused layers of `moe` sized for T (caches cleared first); everything under torch.no_grad. Rows:
  moe <schedule>      `moe(x, topk_idx, topk_weights, w1, w2, schedule=S)` for every S in SCHEDULES;
                      from a shape's second call the fused schedules replay CUDA graphs of their
                      launches (FusedMoE graph_cache);
  moe overlap, CUDA graph   (GPUs) `moe(..., schedule="overlap", sync=False)` captured once and
                      replayed: no host work per call, as an inference engine runs it;
  FusedMoE, graph cache off (GPUs) an overlap layer built with graph_cache=0: every call's
                      launches issued from the host (what the replay saves);
  FusedMoE sized for T=N    (T below N: the largest --tokens, or --opt layer_tokens=N) one overlap
                      layer of capacity N serving T: what a layer serving prefill and decode pays;
  torch-native        `torch_moe.torch_native_moe`, all of it timed: (token, k) pairs sorted by
                      expert, per-expert counts over all_to_all_single and one host read, the rows
                      over NCCL all_to_all_single, expert-major permute, torch._grouped_mm gate-up,
                      silu * up, torch._grouped_mm down, permute back, the reverse exchange,
                      index_select + bmm combine; with the faster weight layout per GEMM of the
                      references below (a per-expert matmul loop where torch._grouped_mm is
                      unsupported);
  DeepEP + grouped_mm (GPUs, bf16, where deep_ep imports: bench/deepep.py) `deepep.DeepEPMoE`:
                      DeepEP's layout + dispatch, a permutation to expert-major rows, the same
                      torch._grouped_mm experts as torch-native, the weighted rows added per
                      received token, DeepEP's combine — the layer a DeepEP user builds;
  grouped GEMM alone  `grouped_mlp` on this rank's real received rows (one untimed dispatch
                      beforehand): the expert work inside the layer, no communication;
  grouped_mm experts alone (with the DeepEP rows) the torch experts on the same rows: gate-up
                      torch._grouped_mm, silu * up, down torch._grouped_mm, each weight in the
                      faster layout of the references below;
  DeepEP + grouped_mm, glue-free sum  DeepEP's layout + dispatch and its combine (each timed
                      alone, `(layer)` rows) + grouped_mm experts alone: the bound any permutation
                      glue around DeepEP and torch._grouped_mm stays above;
  references (--opt refs=1, the default): gate-up (rows @ W1, no activation) and down (h @ W2)
                      alone on the same rows, with torch._grouped_mm and W row-major or
                      column-major, and one dense torch.matmul of all rows against one expert's W
                      (same FLOPs); a device-to-device memory copy (bandwidth = read + write bytes
                      / time); and the floor = max(compute, memory): compute = fastest gate-up +
                      fastest down, memory = (weights + the busiest rank's rows in and out) / the
                      copy's bandwidth. Communication is not part of the floor.
Checks, once per T before timing: every schedule's output against torch-native's, the grouped GEMM
against `torch_experts` on the same rows, max |diff| / max |ref| over every rank within the dtype's
rtol (check/tolerances); the CUDA graph and the other layers against the eager overlap call, bit
for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from ditron_ep.bench.deepep import SM_BUDGETS, DeepEPMoE
from ditron_ep.bench.ep_inputs import Inputs, Weights, make_inputs, make_weights
from ditron_ep.bench.ranks import Fatal, RankContext, StageFailed, all_ranks, guarded, relative_errors
from ditron_ep.bench.spec import (BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, Shape,
                                  bitwise_check, boolean, failed, measure_bandwidth, median_us, positive_int,
                                  tolerance_check)
from ditron_ep.bench.timing import capture_graph
from ditron_ep.bench.torch_moe import torch_experts, torch_native_moe
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.ops import clear_cache, clear_layers, dispatch, grouped_mlp, moe
from ditron_ep.ops.moe_layer.fused import FusedMoE
from ditron_ep.ops.moe_layer.functional import SCHEDULES

FLOP_RULE = ("FLOPs = 2*rows*H*2I (gate-up) + 2*rows*I*H (down) with rows = the (token, k) rows of the busiest "
             "rank (most received rows); TFLOP/s = those FLOPs / median of the slowest rank's per-iteration "
             "time, per GPU (SwiGLU, permutes and communication are not counted); a reference GEMM: its own "
             "FLOPs.")
TORCH_NATIVE = "torch-native"
GEMM_ALONE = "grouped GEMM alone"
GRAPH = "moe overlap, CUDA graph"
NO_GRAPH_CACHE = "FusedMoE, graph cache off"
NVSHMEM_LAYER = "FusedMoE, nvshmem heap"  # --opt nvshmem=true: the overlap layer on the nvshmem backend
NVSHMEM_PUT_LAYER = "FusedMoE, nvshmem heap, put transport"  # ... and with NVSHMEM puts to every peer
COPY = "memory copy"
FLOOR = "floor: max(compute, memory)"
GEMMS = ("gate-up", "down")
DEEPEP_LAYER = "DeepEP + grouped_mm"
# the DeepEP layer's parts timed alone; their sum with GROUPED_MM_ALONE is the glue-free bound any
# permutation glue around DeepEP and torch._grouped_mm stays above
DEEPEP_STAGES = ("DeepEP layout+dispatch (layer)", "DeepEP combine (layer)")
GROUPED_MM_ALONE = "grouped_mm experts alone"
DEEPEP_SUM = "DeepEP + grouped_mm, glue-free sum"
AGAINST = (TORCH_NATIVE, GEMM_ALONE)


def sized(tokens: int) -> str:
    return f"FusedMoE sized for T={tokens}"


def ref_names(gemm: str) -> tuple[str, str, str]:
    """The reference rows of one GEMM: torch._grouped_mm W row-major, W column-major, dense."""
    return f"{gemm}: torch W row-major", f"{gemm}: torch W col-major", f"{gemm}: dense, one expert's W"


LAYER_SHAPES = {"emulated": Shape(hidden=64, experts=8, topk=2, inter=32),
                "torch": Shape(hidden=7168, experts=64, topk=8, inter=2048)}
# The Triton interpreter computes bf16 tl.dot wrongly; fp32 on the GPU would be TF32.
LAYER_DTYPES = {"emulated": ("fp32",), "torch": ("bf16", "fp16")}
LAYER_ROUTINGS = ("uniform", "zipf")   # no dropped slots (torch-native assumes none)


def gemm_flops(rows: int, hidden: int, inter: int) -> tuple[float, float]:
    """(gate-up, down) FLOPs of `rows` expert rows."""
    return 2.0 * rows * hidden * 2 * inter, 2.0 * rows * inter * hidden


@dataclass
class LayerCase:
    inp: Inputs
    wts: Weights
    rows_max: int      # (token, k) rows the busiest rank receives
    flops: float       # of the busiest rank's expert rows (FLOP_RULE)


def layer_case(ctx: BenchContext, tokens: int) -> LayerCase:
    """This rank's tokens, routing and experts' weights for a layer config (collective)."""
    s = ctx.shape
    inp = guarded(ctx, "inputs", lambda: make_inputs(ctx, tokens, s.experts, s.topk, s.hidden, ctx.request.routing))
    wts = guarded(ctx, "weights", lambda: make_weights(ctx, s.experts // ctx.world, s.hidden, s.inter))
    rows_max = max(inp.rows_received(r) for r in range(ctx.world))
    return LayerCase(inp, wts, rows_max, sum(gemm_flops(rows_max, s.hidden, s.inter)))


def probe_grouped_mm(ctx: RankContext, recv_x: torch.Tensor, offs: torch.Tensor, wts: Weights) -> str | None:
    """None if torch._grouped_mm runs on this data on every rank, else why not (agreed by all ranks)."""
    def run() -> None:
        torch_experts(recv_x, offs, wts.w1, wts.w2, None)
        if ctx.on_cuda:
            torch.cuda.synchronize(ctx.device)

    try:
        guarded(ctx, "torch._grouped_mm probe", run)
        return None
    except StageFailed as exc:
        return str(exc)


# ============================================================================ training entries' floor
DENSE = ("gate-up: dense, one expert's W", "down: dense, one expert's W")
TRAINING_FLOOR = "floor: 3 x forward GEMMs"


def training_floor(ctx: BenchContext, rows: int, width: int) -> list[Measurement]:
    """The training entries' references: one torch.matmul of `rows` rows against one expert's
    first weight [H, width] and second [I, H] (random values: cuBLAS's dense rate), and the floor
    of a forward + backward, 3 x their sum (the backward's GEMMs are twice the forward's)."""
    s = ctx.shape
    try:
        a, h, w1, w2 = guarded(ctx, "dense inputs", lambda: tuple(
            torch.randn(*shape, device=ctx.device).to(ctx.dtype)
            for shape in ((rows, s.hidden), (rows, s.inter), (s.hidden, width), (s.inter, s.hidden))))
    except StageFailed as exc:
        return failed((*DENSE, TRAINING_FLOOR), str(exc))
    gu_flops, dn_flops = 2.0 * rows * s.hidden * width, 2.0 * rows * s.inter * s.hidden
    gu = ctx.measure(DENSE[0], lambda: torch.matmul(a, w1), gu_flops, "reference", True)
    dn = ctx.measure(DENSE[1], lambda: torch.matmul(h, w2), dn_flops, "reference", True)
    meds = [median_us(m) for m in (gu, dn)]
    if None in meds:
        return [gu, dn, Measurement(TRAINING_FLOOR, ok=False, error="not derived: a dense reference failed")]
    return [gu, dn, Measurement(TRAINING_FLOOR, work=3 * (gu_flops + dn_flops), value_us=3 * sum(meds),
                                check=f"3 x ({meds[0]:,.1f} + {meds[1]:,.1f}) µs")]


# ============================================================================ references and floor
def measure_refs(ctx: BenchContext, recv_x: torch.Tensor, offs: torch.Tensor, host_off: list[int], wts: Weights,
                 grouped: bool, rows_max: int) -> tuple[list[Measurement], dict[str, bool]]:
    """Gate-up and down alone on this rank's rows, the memory copy and the floor; also, per weight,
    whether the column-major layout was the faster torch._grouped_mm one."""
    s = ctx.shape
    inter = s.inter
    flops = dict(zip(GEMMS, gemm_flops(rows_max, s.hidden, inter)))
    names = [n for g in GEMMS for n in ref_names(g)]

    def make_h() -> torch.Tensor:
        g = recv_x @ wts.w1[0]   # values only feed the down GEMM's timing
        return F.silu(g[:, :inter]) * g[:, inter:]

    try:
        h = guarded(ctx, "references: h", make_h)
        guarded(ctx, "column-major weight copies", lambda: (wts.layout("w1", True), wts.layout("w2", True)))
    except StageFailed as exc:
        return [*failed(names, str(exc)), *failed((COPY, FLOOR), str(exc))], {"w1": False, "w2": False}

    def grouped_fn(a: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
        if grouped:
            return lambda: torch._grouped_mm(a, w, offs=offs)

        def loop() -> None:   # where torch._grouped_mm is unsupported
            for e in range(w.shape[0]):
                if host_off[e + 1] > host_off[e]:
                    a[host_off[e]:host_off[e + 1]] @ w[e]
        return loop

    note = "reference" if grouped else "reference (per-expert matmul loop: no torch._grouped_mm here)"
    out: list[Measurement] = []
    best: dict[str, float] = {}
    col: dict[str, bool] = {}
    for gemm, key, a in (("gate-up", "w1", recv_x), ("down", "w2", h)):
        row_name, col_name, dense_name = ref_names(gemm)
        times: dict[bool, float] = {}
        for is_col, name in ((False, row_name), (True, col_name)):
            m = ctx.measure(name, grouped_fn(a, wts.layout(key, is_col)), flops[gemm], note, True)
            out.append(m)
            if median_us(m) is not None:
                times[is_col] = median_us(m)
        w0 = getattr(wts, key)[0]
        out.append(ctx.measure(dense_name, lambda a_=a, w_=w0: torch.matmul(a_, w_), flops[gemm], "reference", True))
        col[key] = bool(times) and min(times, key=times.get)
        medians = [v for v in (*times.values(), median_us(out[-1])) if v is not None]
        if medians:
            best[gemm] = min(medians)
    del h
    copy, bandwidth = measure_copy(ctx)
    out += [copy, floor(ctx, best, bandwidth, rows_max, sum(flops.values()))]
    return out, col


def measure_copy(ctx: BenchContext) -> tuple[Measurement, float | None]:
    """A device-to-device copy of `copy_mib` MiB; (its row, bandwidth in bytes/s of read + write)."""
    mib = ctx.options.get("copy_mib") or (1024 if ctx.on_cuda else 4)
    n = mib * 2**20
    def buffers() -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.ones(n, dtype=torch.uint8, device=ctx.device)
        return src, torch.empty_like(src)

    try:
        src, dst = guarded(ctx, "copy buffers", buffers)
    except StageFailed as exc:
        return Measurement(COPY, ok=False, error=str(exc)), None
    return measure_bandwidth(ctx, COPY, lambda: dst.copy_(src), 2 * n, f"{mib} MiB read + written")


def floor(ctx: BenchContext, best: dict[str, float], bandwidth: float | None, rows_max: int,
          flops: float) -> Measurement:
    """The derived floor row: max(compute, memory) in µs."""
    if set(best) != set(GEMMS):
        return Measurement(FLOOR, ok=False, error="not derived: a GEMM reference failed")
    s, elt = ctx.shape, ctx.elt
    compute_us = best["gate-up"] + best["down"]
    weight_bytes = ctx.shape.experts // ctx.world * (s.hidden * 2 * s.inter + s.inter * s.hidden) * elt
    act_bytes = 2 * rows_max * s.hidden * elt
    memory_us = (weight_bytes + act_bytes) / bandwidth * 1e6 if bandwidth else None
    value = max(compute_us, memory_us or 0.0)
    mem = f"{memory_us:,.1f}" if memory_us is not None else "n/a"
    return Measurement(FLOOR, work=flops, value_us=value, check=f"compute {compute_us:,.1f}, memory {mem} µs",
                       details={"compute_us": compute_us, "memory_us": memory_us, "weight_bytes": weight_bytes,
                                "activation_bytes": act_bytes, "bytes_per_s": bandwidth, "rows_max": rows_max})


# ============================================================================ layers beside moe()
def measure_layer(ctx: BenchContext, impl: str, inp: Inputs, wts: Weights, flops: float, want: torch.Tensor,
                  max_tokens: int, **layer_kwargs: Any) -> Measurement:
    """One overlap FusedMoE built differently from what `moe()` caches (capacity `max_tokens`,
    `layer_kwargs`), timed on the config's inputs and checked bit for bit against the eager
    overlap call `want`: neither the graph cache nor the capacity may change a result bit."""
    s = ctx.shape
    layer: list[FusedMoE] = []
    try:
        guarded(ctx, impl, lambda: layer.append(FusedMoE(ctx.group, s.experts, s.hidden, s.inter, max_tokens,
                                                         s.topk, ctx.dtype, **layer_kwargs)))

        def call() -> torch.Tensor:
            return layer[0](inp.x, inp.idx, inp.w, wts.w1, wts.w2)

        same = all_ranks(ctx, guarded(ctx, f"{impl} (check)", lambda: torch.equal(call(), want)))
        return ctx.measure(impl, call, flops, *bitwise_check(same, "moe overlap"))
    except StageFailed as exc:
        return Measurement(impl, work=flops, ok=False, error=str(exc))
    finally:
        for lay in layer:
            lay.free()


# ============================================================================ the entry
def on_fresh_caches(run: Callable[[], list[Measurement]]) -> list[Measurement]:
    """`run()` with ditron_ep's cached buffers and layers cleared before and after: a buffer and
    fused layers sized for this T, as a layer of this T would have (not after a Fatal: the ranks
    can no longer agree on the collective free)."""
    clear_cache()
    clear_layers()
    group_ok = True
    try:
        return run()
    except Fatal:
        group_ok = False
        raise
    finally:
        if group_ok:
            clear_cache()
            clear_layers()


def run_moe(ctx: BenchContext, tokens: int) -> list[Measurement]:
    case = layer_case(ctx, tokens)

    def run() -> list[Measurement]:
        with torch.no_grad():
            return _run_moe(ctx, tokens, case.inp, case.wts, case.rows_max, case.flops, TOLERANCES[ctx.dtype][0])
    return on_fresh_caches(run)


def _run_moe(ctx: BenchContext, tokens: int, inp: Inputs, wts: Weights, rows_max: int, flops: float,
             rtol: float) -> list[Measurement]:
    E = ctx.shape.experts

    def first_dispatch() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        recv, handle = dispatch(inp.x, inp.idx, num_experts=E, group=ctx.group)
        return recv, handle.expert_offsets, [int(v) for v in handle.expert_offsets.tolist()]

    recv_x, off, host_off = guarded(ctx, "dispatch (untimed)", first_dispatch)
    grouped = probe_grouped_mm(ctx, recv_x, off[1:], wts) is None

    def layer(schedule: str) -> Callable[[], torch.Tensor]:
        return lambda: moe(inp.x, inp.idx, inp.w, wts.w1, wts.w2, group=ctx.group, schedule=schedule)

    def alone() -> torch.Tensor:
        return grouped_mlp(recv_x, off, wts.w1, wts.w2, check=False)

    # ---- checks: every schedule against torch-native, the GEMM alone against torch_experts
    ours = {f"moe {S}": layer(S) for S in SCHEDULES}
    ref = guarded(ctx, f"{TORCH_NATIVE} (check)",
                  lambda: torch_native_moe(inp.x, inp.idx, inp.w, wts.w1, wts.w2, grouped, ctx.group))
    outs, errors = {}, {}
    for impl, fn in ours.items():
        try:
            outs[impl] = guarded(ctx, f"{impl} (check)", fn)
        except StageFailed as exc:
            errors[impl] = str(exc)
    rel = relative_errors(ctx, ref, outs)
    experts_ref = guarded(ctx, "torch_experts (check)", lambda: torch_experts(
        recv_x, off[1:], wts.w1, wts.w2, None if grouped else host_off))
    rel_alone = relative_errors(ctx, experts_ref, {GEMM_ALONE: guarded(ctx, f"{GEMM_ALONE} (check)", alone)})
    overlap = outs.get("moe overlap")
    del outs, experts_ref

    out = [Measurement(i, work=flops, ok=False, error=errors[i]) if i in errors else
           ctx.measure(i, fn, flops, *tolerance_check(rel[i], rtol)) for i, fn in ours.items()]
    # ---- the overlap layer otherwise called: replayed from a CUDA graph, no graph cache, larger
    extra: dict[str, tuple[int, dict[str, Any]]] = {}
    if ctx.on_cuda:
        out.append(measure_graph(ctx, inp, wts, flops, overlap))
        extra[NO_GRAPH_CACHE] = (tokens, {"graph_cache": 0})
        if ctx.options.get("nvshmem"):
            extra[NVSHMEM_LAYER] = (tokens, {"backend": "nvshmem"})
            extra[NVSHMEM_PUT_LAYER] = (tokens, {"backend": "nvshmem", "transport": "put"})
    cap = layer_tokens(ctx.request, ctx.options)
    if tokens < cap:
        extra[sized(cap)] = (cap, {})
    for impl, (cap, kwargs) in extra.items():
        out.append(Measurement(impl, work=flops, ok=False, error="the eager overlap call failed") if overlap is None
                   else measure_layer(ctx, impl, inp, wts, flops, overlap, cap, **kwargs))
    del overlap
    out.append(ctx.measure(GEMM_ALONE, alone, flops, *tolerance_check(rel_alone[GEMM_ALONE], rtol)))
    # ---- references and floor; torch-native with the faster weight layout per GEMM
    col = {"w1": False, "w2": False}
    if ctx.options.get("refs", True):
        refs, col = measure_refs(ctx, recv_x, off[1:], host_off, wts, grouped, rows_max)
        out += refs
    w1, w2 = wts.layout("w1", col["w1"] and grouped), wts.layout("w2", col["w2"] and grouped)
    layout = f"W1 {'col' if w1 is not wts.w1 else 'row'}-major, W2 {'col' if w2 is not wts.w2 else 'row'}-major"
    note = f"reference [{layout}]" if grouped else "reference (per-expert matmul loop: no torch._grouped_mm here)"
    out.append(ctx.measure(TORCH_NATIVE, lambda: torch_native_moe(inp.x, inp.idx, inp.w, w1, w2, grouped, ctx.group),
                           flops, note, True, details={"grouped_mm": grouped, "weight_layout": layout}))
    if deepep_layer_wanted(ctx):
        experts = measure_grouped_mm_experts(ctx, recv_x, off[1:], wts, w1, w2, grouped, layout, flops, rtol)
        out.append(experts)
        out += measure_deepep_layer(ctx, inp, w1, w2, layout, flops, ref, rtol, grouped, experts)
    return out


def measure_grouped_mm_experts(ctx: BenchContext, recv_x: torch.Tensor, offs: torch.Tensor, wts: Weights,
                               w1: torch.Tensor, w2: torch.Tensor, grouped: bool, layout: str, flops: float,
                               rtol: float) -> Measurement:
    """GROUPED_MM_ALONE: torch_experts (torch._grouped_mm gate-up, silu * up, torch._grouped_mm
    down) on this rank's received rows with the faster weight layouts (w1, w2), checked against
    the same experts with row-major weights within rtol."""
    if not grouped:
        return Measurement(GROUPED_MM_ALONE, work=flops, ok=False, error="torch._grouped_mm does not run here")
    fn = lambda: torch_experts(recv_x, offs, w1, w2, None)  # noqa: E731
    try:
        want = guarded(ctx, f"{GROUPED_MM_ALONE} (row-major check)",
                       lambda: torch_experts(recv_x, offs, wts.w1, wts.w2, None))
        rel = relative_errors(ctx, want, {GROUPED_MM_ALONE: guarded(ctx, f"{GROUPED_MM_ALONE} (check)", fn)})
    except StageFailed as exc:
        return Measurement(GROUPED_MM_ALONE, work=flops, ok=False, error=str(exc))
    ok_text, ok = tolerance_check(rel[GROUPED_MM_ALONE], rtol)
    return ctx.measure(GROUPED_MM_ALONE, fn, flops, f"{ok_text} [{layout}]", ok, details={"weight_layout": layout})


def deepep_layer_wanted(ctx: BenchContext) -> bool:
    """The DeepEP layer row is planned where DeepEP could run: GPUs, bf16."""
    return ctx.on_cuda and ctx.dtype == torch.bfloat16


def measure_deepep_layer(ctx: BenchContext, inp: Inputs, w1: torch.Tensor, w2: torch.Tensor, layout: str,
                         flops: float, ref: torch.Tensor | None,
                         rtol: float, grouped: bool, alone: Measurement) -> list[Measurement]:
    """The "DeepEP + grouped_mm" row (its output against torch-native's, then timed), its layout +
    dispatch and its combine timed alone, and the glue-free sum of those two and the experts
    alone (`alone`: GROUPED_MM_ALONE, torch._grouped_mm's experts on the same rows) with the
    pipeline's glue."""
    names = (DEEPEP_LAYER, *DEEPEP_STAGES, DEEPEP_SUM)
    if not grouped:
        return failed(names, "torch._grouped_mm does not run here", flops)
    layer = None
    try:
        layer = DeepEPMoE(ctx, ctx.shape.experts, ctx.shape.hidden)
        call = lambda: layer(inp.x, inp.idx, inp.w, w1, w2)  # noqa: E731
        got = guarded(ctx, f"{DEEPEP_LAYER} (check)", call)
        rel = relative_errors(ctx, ref, {DEEPEP_LAYER: got})[DEEPEP_LAYER] if ref is not None else float("inf")
        del got
        ok_text, ok = tolerance_check(rel, rtol)
        rows = [ctx.measure(DEEPEP_LAYER, call, flops, f"{ok_text} [{layout}]", ok,
                            details={"num_sms": max(SM_BUDGETS), "weight_layout": layout})]
        stages = guarded(ctx, "DeepEP stages (layer)", lambda: layer.stage_calls(inp.x, inp.idx, inp.w))
        rows += [ctx.measure(name, fn, None, "reference", True, details={"num_sms": max(SM_BUDGETS)})
                 for name, fn in zip(DEEPEP_STAGES, stages)]
    except StageFailed as exc:
        return failed(names, str(exc), flops)
    finally:
        if layer is not None:
            layer.close()
    return [*rows, glue_free_sum(rows[0], rows[1], alone, rows[2], flops)]


def glue_free_sum(layer: Measurement, dispatch: Measurement, experts: Measurement, combine: Measurement,
                  flops: float) -> Measurement:
    """DEEPEP_SUM: the medians of DeepEP's layout + dispatch, the experts and DeepEP's combine, each
    timed alone, added; its check names the parts and the pipeline's glue (the layer's median
    minus the sum)."""
    parts = [median_us(m) for m in (dispatch, experts, combine)]
    if None in parts:
        return Measurement(DEEPEP_SUM, work=flops, ok=False, error="not derived: a part was not timed")
    total, e2e = sum(parts), median_us(layer)
    glue = f"; the pipeline's glue {e2e - total:,.0f} µs" if e2e is not None else ""
    return Measurement(DEEPEP_SUM, work=flops, value_us=total, ok=True, details={"parts_us": parts},
                       check=f"dispatch {parts[0]:,.0f} + experts {parts[1]:,.0f} + combine {parts[2]:,.0f} µs{glue}")


def measure_graph(ctx: BenchContext, inp: Inputs, wts: Weights, flops: float,
                  overlap: torch.Tensor | None) -> Measurement:
    """`moe(..., schedule="overlap", sync=False)` captured once in a CUDA graph, replayed."""
    if overlap is None:
        return Measurement(GRAPH, work=flops, ok=False, error="the eager overlap call failed")
    try:
        graph, graph_out = guarded(ctx, f"{GRAPH} (capture)", lambda: capture_graph(
            lambda: moe(inp.x, inp.idx, inp.w, wts.w1, wts.w2, group=ctx.group, schedule="overlap", sync=False),
            warmup=2))
        guarded(ctx, f"{GRAPH} (check)", graph.replay)
    except StageFailed as exc:
        return Measurement(GRAPH, work=flops, ok=False, error=str(exc))
    same = all_ranks(ctx, torch.equal(graph_out, overlap))
    return ctx.measure(GRAPH, graph.replay, flops, *bitwise_check(same, "eager overlap"))


def layer_tokens(req: BenchRequest, options: Mapping[str, Any]) -> int:
    """Capacity of the layer that serves every smaller T (`sized`)."""
    return options.get("layer_tokens") or max(req.tokens)


def plan_moe(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    ours = [f"moe {S}" for S in SCHEDULES] + ([GRAPH, NO_GRAPH_CACHE] if on_gpu else []) + (
        [NVSHMEM_LAYER, NVSHMEM_PUT_LAYER] if on_gpu and options.get("nvshmem") else [])
    if tokens < layer_tokens(req, options):
        ours.append(sized(layer_tokens(req, options)))
    refs = [Impl(n, "reference") for g in GEMMS for n in ref_names(g)] + [
        Impl(COPY, "reference"), Impl(FLOOR, "reference", timed=False)] if options.get("refs", True) else []
    deepep = (Impl(DEEPEP_LAYER, "baseline"), *(Impl(n, "reference") for n in DEEPEP_STAGES),
              Impl(GROUPED_MM_ALONE, "reference"), Impl(DEEPEP_SUM, "baseline", timed=False)) \
        if on_gpu and req.dtype == "bf16" else ()
    against = AGAINST + ((DEEPEP_LAYER, DEEPEP_SUM) if deepep else ())
    return (*(Impl(n, against=against) for n in ours), Impl(TORCH_NATIVE, "baseline"), *deepep,
            Impl(GEMM_ALONE, "baseline"),
            *refs)


MOE = Benchmark(
    name="moe",
    description="EP MoE layer forward: dispatch, grouped SwiGLU experts, combine (ditron_ep.ops.moe), with "
                "cuBLAS's GEMMs alone and the floor",
    metric="TFLOP/s", work_rule=FLOP_RULE,
    check_rule=f"output vs {TORCH_NATIVE}'s ({GEMM_ALONE}: vs torch_experts on the same rows): max |diff| / "
               f"max |ref| over every rank within the dtype's rtol; the CUDA graph and the other layers vs the "
               f"eager overlap call, bit for bit",
    shapes=LAYER_SHAPES, tokens={"emulated": (8, 32), "torch": (128, 4096)},
    plan=plan_moe, run=run_moe,
    options=(Option("refs", "time the GEMM references, the memory copy and the floor", boolean, True),
             Option("copy_mib", "MiB of the memory copy (default 1024 on GPUs, 4 on CPU)", positive_int),
             Option("nvshmem", "also time the overlap layer on the nvshmem heap backend, with pointer stores and "
                               "with the put transport (GPUs; nvshmem4py)", boolean, False),
             Option("layer_tokens", "capacity of the overlap layer that also serves every smaller T (default: the "
                                    "largest --tokens)", positive_int)),
    dtypes=LAYER_DTYPES, routings=LAYER_ROUTINGS)
