"""Diagnostic (GPUs, torchrun; not a benchmark): host time of each step of a graph-cached eager call.

    TOK=128,4096 torchrun --nproc-per-node 2 bench/diag/replay_steps.py

Per rank and T, medians over 40 calls (each after a barrier and a device sync), in µs of host
time (time.perf_counter): the argument checks, the input copies into the replay's static buffers
(`copies`: three copy_ calls; `foreach_copy`: the same as one torch._foreach_copy_, which the
layer uses), each graph replay, the event between them, the output clone, and the wait for the
layout (`sync`: the host waiting for the GPU, not host work), step by step as FusedMoE._replay
takes them (x copied on this stream); then `whole_call`, one whole `layer(...)` call. At T=128 the GPU
waits for the host, so host µs before the layout replay are µs of the call.
Shapes: E=64, top-8, H=7168, I=2048, bf16, uniform routing.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
from layer_inputs import E, H, I, K, layer_inputs

from ditron_ep.ops.moe_layer.fused import FusedMoE

dist.init_process_group("nccl")
rank, W = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
for T in [int(t) for t in os.environ.get("TOK", "128").split(",")]:
    x, idx, w, w1, w2 = layer_inputs(T, rank, W)
    layer = FusedMoE(None, E, H, I, T, K, torch.bfloat16)
    with torch.no_grad():
        for _ in range(5):
            layer(x, idx, w, w1, w2)
        c = next(iter(layer._graphs._entries.values()))
        steps = {k: [] for k in ("validate", "copies", "foreach_copy", "layout.replay", "ready.record", "kernel.replay",
                                 "clone", "sync", "whole_call")}
        for it in range(40):
            dist.barrier(); torch.cuda.synchronize()
            t = [time.perf_counter()]
            layer._validate(x, idx, w, w1, w2); t.append(time.perf_counter())
            c.topk_idx.copy_(idx); c.topk_weights.copy_(w); c.x.copy_(x); t.append(time.perf_counter())
            torch._foreach_copy_([c.x, c.topk_idx, c.topk_weights], [x, idx, w]); t.append(time.perf_counter())
            c.layout.replay(); t.append(time.perf_counter())
            c.ready.record(); t.append(time.perf_counter())
            c.kernel.replay(); t.append(time.perf_counter())
            out = c.out.clone(); t.append(time.perf_counter())
            c.ready.synchronize(); t.append(time.perf_counter())
            for k, a, b in zip(list(steps)[:8], t, t[1:]):
                steps[k].append((b - a) * 1e6)
            torch.cuda.synchronize(); dist.barrier(); torch.cuda.synchronize()
            t0 = time.perf_counter(); layer(x, idx, w, w1, w2); steps["whole_call"].append((time.perf_counter() - t0) * 1e6)
        line = f"[rank {rank}] T={T} host us (median of 40): " + "  ".join(f"{k} {statistics.median(v):.1f}" for k, v in steps.items())
    for r in range(W):
        if r == rank:
            print(line, flush=True)
        dist.barrier()
    layer.free()
dist.destroy_process_group()
