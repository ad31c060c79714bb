"""Where the fused MoE kernel's time goes: a per-stage timeline of one traced launch, per rank.

    torchrun --nproc-per-node 4 bench/moe_timeline.py [--tokens 128 4096] [--hidden 7168] [--inter 2048]
        [--experts 64] [--topk 8] [--schedules overlap sequential] [--warmup 3] [--iters 0]
        [--variant comm_programs=0,recv_lag=0 ...]
    TRITON_INTERPRET=1 GLOO_SOCKET_IFNAME=lo torchrun --nproc-per-node 2 bench/moe_timeline.py --smoke

For every (T, schedule, plan variant): a `FusedMoE` layer is built (a variant is a comma-separated
list of Device-level plan overrides, e.g. `comm_programs=0,recv_lag=1024`, or Core-level tile
configs, e.g. `gate_up_config=BM128-BN128-BK64-w8-s3`; none: the plan's defaults), run `--warmup`
times, then once with `trace=True` (on GPUs after one untimed traced call that compiles the
traced kernel). With --iters N, N more eager calls are timed with CUDA events
(median of the slowest rank per call) and every variant's output is compared bitwise with the
first variant's (Device-level fields must not change a bit; a tile shape may, as it fixes the
fp32 summation of the dot products). Printed per rank: `overlap_report()` (GEMM tiles started before the last remote
dispatch chunk, from the logical clock) and, on GPUs, `timeline()` from the device timer: per
stage, when its first task started and its last ended (µs after program 0 entered the kernel,
"call_barrier" being the wait for every rank to enter) and its busy time per program. The
interpreter has no device timer: under --smoke only the overlap report is printed.
Inputs: bf16 on GPUs (fp32 under the interpreter), uniform top-k from softmax scores, weights
scaled by H^-1/2 and I^-1/2; every rank draws its own from seed 1234 + rank.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # repo root: `ditron_ep`

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ditron_ep  # noqa: E402,F401  (decides compiled vs interpreted kernels before any triton.jit)
from ditron_ep.bench.timing import time_fn  # noqa: E402
from ditron_ep.compiler.core_config import GemmTileConfig  # noqa: E402
from ditron_ep.compiler.plan import PlanError  # noqa: E402
from ditron_ep.ops.moe_layer.fused import FusedMoE  # noqa: E402
from ditron_ep.runtime.errors import DitronConfigError  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096], help="tokens per rank T")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--schedules", nargs="+", default=["overlap", "sequential"], choices=["overlap", "sequential"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpreter)")
    p.add_argument("--variant", action="append", default=None, metavar="FIELD=VALUE[,...]",
                   help="Device-level plan overrides (repeatable); default: one variant, the plan's defaults")
    p.add_argument("--iters", type=int, default=0, help="timed eager calls per variant (0: trace only)")
    return p


def parse_variant(text: str) -> dict[str, int | str | GemmTileConfig]:
    """'comm_programs=0,recv_lag=8' -> {'comm_programs': 0, 'recv_lag': 8} (ints where they parse;
    gate_up_config / down_config as GEMM tile configs, e.g. down_config=BM128-BN128-BK64-w8-s3)."""
    out: dict[str, int | str | GemmTileConfig] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--variant: expected FIELD=VALUE, got {item!r}")
        if key.endswith("_config"):
            out[key] = GemmTileConfig.parse(value)
        else:
            out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:  # before any rank starts: a typo fails here, not after the process group is up
        variants = [(v, parse_variant(v)) for v in (args.variant or [""])]
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if args.smoke:
        args.tokens, args.hidden, args.inter, args.experts, args.topk, args.warmup = [12], 32, 16, 2 * world, 2, 0
    if args.experts % world:
        print(f"--experts {args.experts} is not a multiple of the world size {world}", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    H, I, E, K = args.hidden, args.inter, args.experts, args.topk
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)
    w1 = (torch.randn(E // world, H, 2 * I, device=dev, generator=gen) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E // world, I, H, device=dev, generator=gen) * I ** -0.5).to(dtype)
    for T in args.tokens:
        x = torch.randn(T, H, device=dev, generator=gen).to(dtype)
        w, idx = torch.topk(torch.randn(T, E, device=dev, generator=gen).softmax(-1), K, dim=-1)
        first_out = None
        for schedule, (_, overrides) in [(s, v) for s in args.schedules for v in variants]:
            try:
                layer = FusedMoE(None, E, H, I, T, K, dtype, schedule=schedule,
                                 backend="torch" if on_gpu else "emulated", **overrides)
            except (PlanError, DitronConfigError) as err:  # raised alike on every rank, before any collective
                if rank == 0:
                    print(f"T={T} {schedule} {overrides}: skipped, the plan is refused: {err}", flush=True)
                continue
            for _ in range(args.warmup):
                layer(x, idx, w, w1, w2)
            if on_gpu:
                # The traced kernel is its own compile (TRACE is a constexpr): compile it untimed.
                # Otherwise one rank waits out the other's compile in its first waits, and traced
                # calls after such a wait showed dispatch copies ~8x slower than any timed call
                # (bench/results/moe_timeline_H200x2_20261122_s5_T128_variants.log).
                layer(x, idx, w, w1, w2, trace=True)
            dist.barrier()
            out = layer(x, idx, w, w1, w2, trace=True)
            if first_out is None:
                first_out = out
            d = layer.plan.device
            name = (f"{schedule} comm_programs={d.comm_programs} recv_lag={d.recv_lag} "
                    f"chunk_rows={layer.plan.routing.chunk_rows} block_t={d.block_t} "
                    f"gemm_tile_order={d.gemm_tile_order}/{d.gemm_group_rows}")
            lines = [f"[rank {rank}] T={T} {name}: {layer.overlap_report()}  "
                     f"bitwise == first variant: {torch.equal(out, first_out)}"]
            if args.iters > 0:
                ms = statistics.median(time_fn(lambda: layer(x, idx, w, w1, w2), args.iters, 0, device=dev)) / 1e3
                lines.append(f"    median {ms:.3f} ms per call (slowest rank, {args.iters} eager calls)")
            if on_gpu:
                for r in layer.timeline():
                    lines.append(f"    {r['stage']:16s} tasks {r['tasks']:6d}  start {r['first_start_us']:9.1f}  "
                                 f"end {r['last_end_us']:9.1f}  busy/program {r['busy_us_per_program']:9.1f} us"
                                 + (f"  task p50 {r['task_p50_us']:7.1f} us" if "task_p50_us" in r else ""))
            for r in range(world):  # one rank at a time, in rank order
                if r == rank:
                    print("\n".join(lines), flush=True)
                dist.barrier()
            layer.free()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
