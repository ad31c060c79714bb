"""Diagnostic (GPUs, torchrun; not a benchmark): the fused kernel's GEMM stages against the standalone
persistent GEMM kernels on the same rows, in the same run.

    TOK=4096 SCHEDS=overlap,sequential torchrun --nproc-per-node 2 bench/diag/gemm_stages.py

Per rank: two traced calls of `FusedMoE` per schedule (after an untimed traced call that compiles
the traced kernel), each printed as `stage first_start-last_end (busy µs per program)` from
`timeline()`, with the spread of each GEMM stage's task durations; then the standalone
`grouped_swiglu_kernel` and `grouped_down_kernel` (one program per SM, default tiles) timed alone
on this rank's rows as `ditron_ep.ops.dispatch` lays them out (median of 10, CUDA events). Busy per
program of a fused GEMM stage against the standalone kernel's time says what the stage costs
inside the megakernel beyond the GEMM itself; a fused task's duration against the standalone's
time per tile (time x programs / tiles) says whether that cost is in every tile or in a few.
Shapes: E=64, top-8, H=7168, I=2048, bf16; inputs as bench/moe_timeline.py draws them (seed
1234 + rank).
LABEL (optional) tags the lines, e.g. for a patched build. VARIANTS (optional) adds overlap runs
with Device-level plan overrides: runs separated by ";", a run's overrides by ",", e.g.
VARIANTS="comm_programs=0;comm_programs=33,recv_lag=132" is two runs. Every run also prints the
median gate-up task duration by start time, to show when in the launch tasks run slow.
"""
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root: `bench.moe_timeline`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import triton  # noqa: E402

from bench.moe_timeline import parse_variant  # noqa: E402  (--variant's syntax, one run's overrides)
from ditron_ep.compiler.core_config import default_gemm_configs  # noqa: E402
from ditron_ep.ops.ep.functional import clear_cache, dispatch  # noqa: E402
from ditron_ep.ops.moe_layer.fused import FusedMoE  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_ffn import launch_grouped_down, launch_grouped_swiglu  # noqa: E402
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map  # noqa: E402


def median_us(fn, n=10):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


BIN_US = 500


def binned_p50(layer, stage_name):
    """Median duration of a stage's tasks by the time they started (BIN_US bins after program 0's entry)."""
    seg = layer.task_times(stage_name)
    start, dur = seg[:, 0], seg[:, 1] - seg[:, 0]
    cells = []
    for b in range(int(start.max() // BIN_US) + 1):
        d = dur[(start >= b * BIN_US) & (start < (b + 1) * BIN_US)]
        cells.append(f"{d.median():.0f}({len(d)})" if len(d) else "-")
    return " ".join(cells)


def main():
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    E, K, H, I, T = 64, 8, 7168, 2048, int(os.environ.get("TOK", "4096"))
    label = os.environ.get("LABEL", "")
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    w1 = (torch.randn(E // W, H, 2 * I, device=dev, generator=gen) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E // W, I, H, device=dev, generator=gen) * I ** -0.5).bfloat16()
    x = torch.randn(T, H, device=dev, generator=gen).bfloat16()
    w, idx = torch.topk(torch.randn(T, E, device=dev, generator=gen).softmax(-1), K, dim=-1)
    lines = []
    with torch.no_grad():
        runs = [(sched, "") for sched in os.environ.get("SCHEDS", "overlap,sequential").split(",")]
        runs += [("overlap", v) for v in os.environ.get("VARIANTS", "").split(";") if v]
        for sched, variant in runs:
            layer = FusedMoE(None, E, H, I, T, K, torch.bfloat16, schedule=sched, **parse_variant(variant))
            sched = f"{sched}{' ' + variant if variant else ''}"
            for _ in range(3):
                layer(x, idx, w, w1, w2)
            layer(x, idx, w, w1, w2, trace=True)  # compiles the traced kernel
            for rep in range(2):
                dist.barrier()
                layer(x, idx, w, w1, w2, trace=True)
                timeline = layer.timeline()
                lines.append(f"[rank {rank}] {label} T={T} {sched} traced {rep}: " + "  ".join(
                    f"{r['stage']} {r['first_start_us']:.0f}-{r['last_end_us']:.0f} ({r['busy_us_per_program']:.0f})"
                    for r in timeline))
                lines.append(f"[rank {rank}] {label} T={T} {sched} traced {rep} task us min/p50/p90/max: " + "  ".join(
                    f"{r['stage']} {r['task_min_us']:.1f}/{r['task_p50_us']:.1f}/{r['task_p90_us']:.1f}/"
                    f"{r['task_max_us']:.1f}" for r in timeline if r["stage"].startswith("gemm")))
                lines.append(f"[rank {rank}] {label} T={T} {sched} traced {rep} gemm_gate_up task p50 us by start "
                             f"time (bins of {BIN_US} us): {binned_p50(layer, 'gemm_gate_up')}")
            layer.free()
        recv_x, handle = dispatch(x, idx, num_experts=E)
        offsets = handle.expert_offsets
        gate_up_cfg, down_cfg = default_gemm_configs(torch.bfloat16, "cuda")
        rows = recv_x.shape[0]
        h = torch.empty((rows, I), dtype=x.dtype, device=dev)
        y = torch.empty((rows, H), dtype=x.dtype, device=dev)
        tile_start = build_tile_map(offsets, gate_up_cfg.block_m)  # both configs share block_m
        n_prog = torch.cuda.get_device_properties(dev).multi_processor_count
        gate_up = median_us(lambda: launch_grouped_swiglu(recv_x, None, w1, h, offsets, tile_start, gate_up_cfg,
                                                          n_prog, "tf32", 1))  # grouped_swiglu_ffn's tile order
        down = median_us(lambda: launch_grouped_down(h, w2, y, offsets, tile_start, down_cfg, n_prog, "tf32", 1))
        n_m = int(tile_start[-1])  # M-tiles of this routing
        tiles_gu = n_m * triton.cdiv(I, gate_up_cfg.block_n)
        tiles_dn = n_m * triton.cdiv(H, down_cfg.block_n)
        lines.append(f"[rank {rank}] {label} standalone persistent ({n_prog} programs) on {rows} rows: "
                     f"gate-up {gate_up:.0f} us ({gate_up * n_prog / tiles_gu:.1f} us per tile of {tiles_gu}), "
                     f"down {down:.0f} us ({down * n_prog / tiles_dn:.1f} us per tile of {tiles_dn})")
    for r in range(W):
        if r == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    clear_cache()  # the EPBuffer dispatch() made
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
