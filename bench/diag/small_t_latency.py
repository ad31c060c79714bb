"""Diagnostic (GPUs, torchrun; not a benchmark): where the fixed cost of a small-T cross-rank call goes.

    TOK=0,128 ITERS=30 torchrun --nproc-per-node 2 bench/diag/small_t_latency.py

Each operation is captured in a CUDA graph and timed under three rules (µs, slowest rank, median
over ITERS):
  barrier  the benchmarks' rule (ditron_ep/bench/timing.py): host barrier, device sync, events
           around one replay; the ranks' skew in leaving the barrier counts;
  aligned  the same with a one-element all_reduce on the stream right before the start event;
  steady   one replay of a graph holding REPS copies back to back, divided by REPS: what a call
           costs inside a stream of calls (the ranks' skew is paid once per REPS calls).
Operations: an empty one-program kernel (the launch floor); `call_begin` + `call_end` alone (the
entry barrier every cross-rank launch pays); EPBuffer's layout (sender kernels, in one program
and as three launches, + counts exchange), dispatch(sync=False) (layout + data kernel), combine; NCCL all_to_all_single moving
dispatch's bytes; FusedMoE's layout launches (E=64 layer: + row-tile map, signal resets) and a
whole eager FusedMoE call (timed as called: it replays its own CUDA graphs and reads the layout
status on the host; "steady" = REPS calls in a row).
Shapes: H=7168, top-8, bf16, uniform routing; EPBuffer E=256 sized for the call's T (>= 1).
"""
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from layer_inputs import E as LAYER_E  # noqa: E402
from layer_inputs import H, I, K, layer_inputs

from ditron_ep.bench.alltoall import AllToAll, gather_routing  # noqa: E402
from ditron_ep.bench.ep_inputs import make_inputs  # noqa: E402
from ditron_ep.bench.ranks import RankContext  # noqa: E402
from ditron_ep.bench.timing import capture_graph, time_fn  # noqa: E402
from ditron_ep.language.primitives import call_begin, call_end  # noqa: E402
from ditron_ep.ops import EPBuffer  # noqa: E402
from ditron_ep.ops.ep.layout_kernels import build_send_layout, exchange_layout  # noqa: E402
from ditron_ep.ops.moe_layer.fused import FusedMoE  # noqa: E402


@triton.jit
def empty_kernel(p):
    pass


@triton.jit
def entry_barrier_kernel(table_ptr, rank, world, budget):
    epoch, ok = call_begin(table_ptr, rank, world, budget)
    call_end(table_ptr, rank)


def graph_of(fn, reps):
    def many():
        out = None
        for _ in range(reps):
            out = fn()
        return out
    return capture_graph(many)[0]


def measure(name, fn, iters, reps, dev, graph=True):
    """graph=False: `fn` itself is timed (it may sync with the host; FusedMoE replays its own graphs)."""
    torch.cuda.synchronize()
    fn()  # eager warm-up (compiles outside the capture)
    torch.cuda.synchronize()
    if graph:
        g1, gn = graph_of(fn, 1), graph_of(fn, reps)
        one, many = g1.replay, gn.replay
    else:
        one = fn

        def many():
            for _ in range(reps):
                fn()
    row = {}
    row["barrier"] = statistics.median(time_fn(one, iters, 3, None, dev))
    row["aligned"] = statistics.median(time_fn(one, iters, 3, None, dev, align=True))
    row["steady"] = statistics.median(time_fn(many, iters, 3, None, dev)) / reps
    if dist.get_rank() == 0:
        print(f"  {name:34s} barrier {row['barrier']:8.1f}  aligned {row['aligned']:8.1f}  "
              f"steady {row['steady']:8.1f}", flush=True)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    iters = int(os.environ.get("ITERS", "30"))
    reps = int(os.environ.get("REPS", "16"))
    toks = [int(t) for t in os.environ.get("TOK", "0,128").split(",")]
    if rank == 0:
        print(f"small_t_latency: {world} ranks on {torch.cuda.get_device_name()}, iters {iters}, steady reps {reps}",
              flush=True)
    for T in toks:
        cap = max(T, 1)
        ctx = RankContext(rank=rank, world=world, device=dev, dtype=torch.bfloat16)
        inp = make_inputs(ctx, cap, 256, K, H, "uniform")
        x, idx, w = inp.x[:T], inp.idx[:T], inp.w[:T]
        buf = EPBuffer(None, 256, H, cap, K, torch.bfloat16)
        if rank == 0:
            print(f"T={T} (EPBuffer E=256 max_tokens={cap}, {buf.num_programs} programs)", flush=True)
        measure("empty kernel", lambda: empty_kernel[(1,)](x), iters, reps, dev)
        h = buf.heap
        measure("entry barrier kernel", lambda: entry_barrier_kernel[(1,)](h.ptr_table, h.rank, world, h.wait_budget),
                iters, reps, dev)
        measure("EPBuffer layout", lambda: buf._launch_layout(idx), iters, reps, dev)
        for one, what in ((True, "one program"), (False, "3 launches")):
            measure(f"  sender kernels ({what})", lambda: build_send_layout(idx, 256, world, cap, one_program=one),
                    iters, reps, dev)
        send = build_send_layout(idx, 256, world, cap)
        measure("  counts exchange kernel", lambda: exchange_layout(h, send, 256, "ep/layout", buf._sig_layout),
                iters, reps, dev)
        with torch.no_grad():
            r, hd = buf.dispatch(x, idx, w, sync=False)
            buf.combine(r, hd, w)
        measure("dispatch(sync=False)", lambda: buf.dispatch(x, idx, w, sync=False), iters, reps, dev)
        measure("combine", lambda: buf.combine(r, hd, w), iters, reps, dev)
        if T:
            a2a = AllToAll(ctx, x, *gather_routing(ctx, idx, w), 256)
            measure("nccl all_to_all_single (dispatch)", a2a.dispatch, iters, reps, dev)
        buf.free()
        xl, il, wl, w1, w2 = layer_inputs(cap, rank, world)
        layer = FusedMoE(None, LAYER_E, H, I, cap, K, torch.bfloat16)
        il = il[:T].to(torch.int32)
        measure("FusedMoE layout launches (E=64)", lambda: layer._launch_layout(il, wl[:T]), iters, reps, dev)
        if T:
            with torch.no_grad():
                measure("FusedMoE call (E=64, I=2048)", lambda: layer(xl[:T], il, wl[:T], w1, w2), iters, reps, dev,
                        graph=False)
        layer.free()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
