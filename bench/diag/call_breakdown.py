"""Diagnostic (GPUs, torchrun; not a benchmark): the GPU work of one eager call of a `FusedMoE` layer
(what `moe()` runs), activity by activity, timed as the benchmarks time it (barrier, device sync,
then the call).

    TOK=128,4096 torchrun --nproc-per-node 4 bench/diag/call_breakdown.py
    TOK=128 CAP=4096 torchrun --nproc-per-node 4 bench/diag/call_breakdown.py   # a prefill-sized layer

Per rank and T: the torch profiler's GPU activities (kernels, copies, memsets) of the median of
ITERS profiled calls, each as [start, end] in µs after the marker kernel launched right before the
call (only activities before the marker launched right after it count: not the next iteration's
barrier), and the mean per activity name over those calls. The profiler adds host time to every
torch call, so gaps that wait on the host are longer than in an unprofiled call. Shapes: E=64, top-8, H=7168, I=2048, bf16, uniform
routing; FusedMoE defaults (graph cache on: calls after the second replay CUDA graphs).
"""
import os
import statistics
from collections import defaultdict

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from layer_inputs import E, H, I, K, layer_inputs
from torch.profiler import ProfilerActivity, profile

from ditron_ep.ops.moe_layer.fused import FusedMoE


@triton.jit(do_not_specialize=["i"])
def iteration_marker_kernel(p, i):
    tl.store(p, i)


@triton.jit(do_not_specialize=["i"])
def call_end_marker_kernel(p, i):
    tl.store(p, i)


def gpu_events(prof):
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def main():
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    iters = int(os.environ.get("ITERS", "10"))
    mark = torch.zeros(1, dtype=torch.int32, device="cuda")
    iteration_marker_kernel[(1,)](mark, 0)  # compiled before any profiled call
    call_end_marker_kernel[(1,)](mark, 0)
    for T in [int(t) for t in os.environ.get("TOK", "128").split(",")]:
        x, idx, w, w1, w2 = layer_inputs(T, rank, W)
        cap = int(os.environ.get("CAP", "0")) or T  # layer capacity (max_tokens); default: the call's T
        layer = FusedMoE(None, E, H, I, max(cap, T), K, torch.bfloat16)
        with torch.no_grad():
            for _ in range(5):
                layer(x, idx, w, w1, w2)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for i in range(iters):
                    dist.barrier()
                    torch.cuda.synchronize()
                    iteration_marker_kernel[(1,)](mark, i)
                    layer(x, idx, w, w1, w2)
                    call_end_marker_kernel[(1,)](mark, i)
                torch.cuda.synchronize()
        events = gpu_events(prof)
        starts = [k for k, e in enumerate(events) if "iteration_marker" in e[2]]
        ends = [k for k, e in enumerate(events) if "call_end_marker" in e[2]]
        calls = []
        for a, b in zip(starts, ends):
            t0 = events[a][1]
            calls.append([(s - t0, e - t0, name) for s, e, name in events[a + 1:b]
                          if not name.startswith("nccl:")])  # the profiler's annotation of a collective
        spans = [max((e for _, e, _ in c), default=0.0) for c in calls]
        med = sorted(range(len(calls)), key=lambda k: spans[k])[len(calls) // 2]
        total = defaultdict(float)
        for c in calls:
            for s, e, name in c:
                total[name[:60]] += (e - s) / len(calls)
        lines = [f"[rank {rank}] T={T} (layer max_tokens={max(cap, T)}): GPU span after the marker, median {statistics.median(spans):.0f} us "
                 f"(min {min(spans):.0f}, max {max(spans):.0f}); median call:"]
        lines += [f"    {s:8.1f} {e:8.1f}  {e - s:8.1f}  {name[:90]}" for s, e, name in calls[med]]
        lines.append("  mean GPU time per call, by activity:")
        lines += [f"    {v:8.1f}  {k}" for k, v in sorted(total.items(), key=lambda kv: -kv[1])]
        for r in range(W):
            if r == rank:
                print("\n".join(lines), flush=True)
            dist.barrier()
        layer.free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
