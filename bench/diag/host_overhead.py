"""Diagnostic (GPUs, torchrun; not a benchmark): where an eager `moe()` call spends host time.

    TOK=128 torchrun --nproc-per-node 4 bench/diag/host_overhead.py

Per rank: back-to-back eager calls (host runs ahead), the host time to issue a sync=False call,
one call from an idle GPU (when the host returns, when the GPU is done: the benchmarks' rule),
then rank 0's cProfile of 30 calls. Shapes: T=$TOK tokens per rank, E=64, top-8, H=7168,
I=2048, bf16, uniform routing.
"""
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist
from layer_inputs import layer_inputs

from ditron_ep.ops import moe

dist.init_process_group("nccl")
rank, W = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
T = int(os.environ.get("TOK", "128"))
x, idx, w, w1, w2 = layer_inputs(T, rank, W)
with torch.no_grad():
    for _ in range(5):
        moe(x, idx, w, w1, w2)
    torch.cuda.synchronize(); dist.barrier()
    for _ in range(3):
        moe(x, idx, w, w1, w2, sync=False)
    torch.cuda.synchronize(); dist.barrier()
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        moe(x, idx, w, w1, w2)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    # host time per phase, GPU kept out of it: sync=False calls (no host read)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        moe(x, idx, w, w1, w2, sync=False)
    host_nosync = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    # one call at a time (the benchmarks' rule): latency from an idle GPU
    lat = []
    for _ in range(20):
        dist.barrier(); torch.cuda.synchronize()
        t0 = time.perf_counter(); moe(x, idx, w, w1, w2); t1 = time.perf_counter(); torch.cuda.synchronize()
        lat.append(((t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6))
    lat.sort()
    print(f"[rank {rank}] T={T}: back-to-back eager {wall:.0f} us/call; host issue time with sync=False {host_nosync:.0f} us/call; "
          f"one call from idle: host returns after {lat[10][0]:.0f} us, GPU done after {lat[10][1]:.0f} us", flush=True)
    dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(30):
        moe(x, idx, w, w1, w2)
    pr.disable()
    torch.cuda.synchronize()
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue()[:9000])
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        print(s.getvalue()[:9000])
dist.barrier()
dist.destroy_process_group()
