"""Registry entry "moe": the EP MoE layer forward (`ditron_ep.ops.moe_layer.functional`) against a torch-native
pipeline and against its own grouped GEMM run alone.

Weights per rank: w1 [E_local, H, 2I] (gate ‖ up), w2 [E_local, I, H], random, scaled by H^-1/2
and I^-1/2 (so h and y are O(1)). Per token count T (per rank), tokens and a uniform routing from
`ep_inputs.make_inputs`, the EP buffer and fused layers sized for T (caches cleared first);
everything under torch.no_grad. Implementations:
  moe <schedule>      `moe(x, topk_idx, topk_weights, w1, w2, schedule=S)` for every S in
                      `ditron_ep.ops.moe_layer.functional.SCHEDULES`;
  torch-native        `torch_moe.torch_native_moe`, all of it timed (row-major weights; a
                      per-expert torch.matmul loop where torch._grouped_mm is unsupported);
  moe overlap, CUDA graph   (GPUs only) `moe(..., schedule="overlap", sync=False)` captured
                      once in a CUDA graph and replayed: no host work or host synchronisation
                      per call, as an inference engine runs it; checked bit for bit against the
                      eager overlap call.
  grouped GEMM alone  `grouped_swiglu_ffn` on this rank's real received rows (one untimed
                      dispatch beforehand): the expert work inside the layer, no communication.
Check, once per T before timing: every schedule's output against torch-native's, and the grouped
GEMM against `torch_experts` on the same rows; max |diff| / max |ref| over every rank within the
dtype's rtol (check/tolerances).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ditron_ep.bench.ep_inputs import make_inputs
from ditron_ep.bench.ranks import Fatal, RankContext, StageFailed, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, Measurement, Shape, tolerance_check
from ditron_ep.bench.timing import capture_graph
from ditron_ep.bench.torch_moe import torch_experts, torch_native_moe
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.ops import clear_cache, clear_layers, dispatch, grouped_swiglu_ffn, moe
from ditron_ep.ops.moe_layer.functional import SCHEDULES

FLOP_RULE = ("FLOPs = 2*rows*H*2I (gate-up) + 2*rows*I*H (down) with rows = the (token, k) rows of the busiest "
             "rank (most received rows); TFLOP/s = those FLOPs / median of the slowest rank's per-iteration "
             "time, per GPU (SwiGLU, permutes and communication are not counted).")
TORCH_NATIVE = "torch-native"
GEMM_ALONE = "grouped GEMM alone"
GRAPH = "moe overlap, CUDA graph"


@dataclass
class Weights:
    w1: torch.Tensor           # [E_local, H, 2I] row-major
    w2: torch.Tensor           # [E_local, I, H] row-major
    col_major: dict[str, torch.Tensor] = field(default_factory=dict)  # same values, column-major views

    def layout(self, name: str, col: bool) -> torch.Tensor:
        """`name` ("w1" or "w2") row-major, or column-major (a transposed view of [E, N, K] storage)."""
        w = getattr(self, name)
        if not col:
            return w
        if name not in self.col_major:
            self.col_major[name] = w.transpose(1, 2).contiguous().transpose(1, 2)
        return self.col_major[name]


def make_weights(ctx: RankContext, experts: int, hidden: int, inter: int) -> Weights:
    """This rank's experts' weights, drawn on its device from seed * 1000 + 700 + rank."""
    e_local = experts // ctx.world
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1000 + 700 + ctx.rank)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=ctx.device) * scale).to(ctx.dtype)

    return Weights(w1=randn(e_local, hidden, 2 * inter, scale=hidden**-0.5),
                   w2=randn(e_local, inter, hidden, scale=inter**-0.5))


def gemm_flops(rows: int, hidden: int, inter: int) -> tuple[float, float]:
    """(gate-up, down) FLOPs of `rows` expert rows."""
    return 2.0 * rows * hidden * 2 * inter, 2.0 * rows * inter * hidden


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


def run_moe(ctx: BenchContext, tokens: int) -> list[Measurement]:
    s = ctx.shape
    E, H, I, K = s.experts, s.hidden, s.inter, s.topk
    inp = guarded(ctx, "inputs", lambda: make_inputs(ctx, tokens, E, K, H, ctx.request.routing))
    wts = guarded(ctx, "weights", lambda: make_weights(ctx, E, H, I))
    flops = sum(gemm_flops(max(inp.rows_received(r) for r in range(ctx.world)), H, I))
    rtol = TOLERANCES[ctx.dtype][0]
    # A buffer and fused layers sized for this T, as a layer of this T would have.
    clear_cache()
    clear_layers()
    group_ok = True
    try:
        def first_dispatch() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
            recv, handle = dispatch(inp.x, inp.idx, num_experts=E, group=ctx.group)
            return recv, handle.expert_offsets, [int(v) for v in handle.expert_offsets.tolist()]

        with torch.no_grad():
            recv_x, off, host_off = guarded(ctx, "dispatch (untimed)", first_dispatch)
            grouped = probe_grouped_mm(ctx, recv_x, off[1:], wts) is None

            def native() -> torch.Tensor:
                return torch_native_moe(inp.x, inp.idx, inp.w, wts.w1, wts.w2, grouped, ctx.group)

            def layer(schedule: str) -> Callable[[], torch.Tensor]:
                return lambda: moe(inp.x, inp.idx, inp.w, wts.w1, wts.w2, group=ctx.group, schedule=schedule)

            def alone() -> torch.Tensor:
                return grouped_swiglu_ffn(recv_x, off, wts.w1, wts.w2, check=False)

            ours = {f"moe {S}": layer(S) for S in SCHEDULES}
            ref = guarded(ctx, f"{TORCH_NATIVE} (check)", native)
            outs, failed = {}, {}
            for impl, fn in ours.items():
                try:
                    outs[impl] = guarded(ctx, f"{impl} (check)", fn)
                except StageFailed as exc:
                    failed[impl] = str(exc)
            rel = relative_errors(ctx, ref, outs)
            experts_ref = guarded(ctx, "torch_experts (check)", lambda: torch_experts(
                recv_x, off[1:], wts.w1, wts.w2, None if grouped else host_off))
            rel_alone = relative_errors(ctx, experts_ref, {GEMM_ALONE: guarded(ctx, f"{GEMM_ALONE} (check)", alone)})
            graph = None
            if ctx.on_cuda and "moe overlap" in outs:
                graph, graph_out = guarded(ctx, f"{GRAPH} (capture)", lambda: capture_graph(
                    lambda: moe(inp.x, inp.idx, inp.w, wts.w1, wts.w2, group=ctx.group, schedule="overlap",
                                sync=False), warmup=2))
                guarded(ctx, f"{GRAPH} (check)", graph.replay)
                rel_graph = relative_errors(ctx, outs["moe overlap"], {GRAPH: graph_out})[GRAPH]
            del ref, outs, experts_ref

        out = []
        for impl, fn in ours.items():
            if impl in failed:
                out.append(Measurement(impl, None, flops, "", False, error=failed[impl]))
            else:
                out.append(ctx.measure(impl, fn, flops, *tolerance_check(rel[impl], rtol)))
        if ctx.on_cuda:
            if graph is None:
                out.append(Measurement(GRAPH, None, flops, "", False, error="the eager overlap call failed"))
            else:
                same = rel_graph == 0.0
                out.append(ctx.measure(GRAPH, graph.replay, flops,
                                       "ok: bitwise == eager overlap" if same else
                                       f"FAIL: differs from eager overlap ({rel_graph:.1e})", same))
        out.append(ctx.measure(TORCH_NATIVE, native, flops,
                            "reference" if grouped else "reference (per-expert matmul loop: no torch._grouped_mm)",
                            True))
        out.append(ctx.measure(GEMM_ALONE, alone, flops, *tolerance_check(rel_alone[GEMM_ALONE], rtol)))
        return out
    except Fatal:
        group_ok = False
        raise
    finally:
        if group_ok:
            clear_cache()
            clear_layers()


MOE = Benchmark(
    name="moe",
    description="EP MoE layer forward: dispatch, grouped SwiGLU experts, combine (ditron_ep.ops.moe_layer.functional)",
    ours=(*(f"moe {S}" for S in SCHEDULES), GRAPH), baselines=(TORCH_NATIVE, GEMM_ALONE), metric="TFLOP/s",
    gpu_only=(GRAPH,),
    work_rule=FLOP_RULE,
    check_rule=f"output vs {TORCH_NATIVE}'s ({GEMM_ALONE}: vs torch_experts on the same rows): max |diff| / "
               f"max |ref| over every rank within the dtype's rtol",
    shapes={"emulated": Shape(hidden=64, experts=8, topk=2, inter=32),
            "torch": Shape(hidden=7168, experts=64, topk=8, inter=2048)},
    tokens={"emulated": (8, 32), "torch": (128, 4096)},
    run=run_moe,
    # The Triton interpreter computes bf16 tl.dot wrongly; fp32 on the GPU would be TF32.
    dtypes={"emulated": ("fp32",), "torch": ("bf16", "fp16")})
