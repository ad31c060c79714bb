"""Diagnostic (GPUs, torchrun; not a benchmark): one call size T served by layers of different
capacity (max_tokens), timed as the benchmarks time it, plus one traced call per layer (the
megakernel's per-stage timeline from the device timer): what a layer sized for prefill costs at
decode, and in which stage.

    T=128 CAP=128,4096 ITERS=20 torchrun --nproc-per-node 4 bench/diag/sized_layer.py

Shapes: layer_inputs.py (E=64, top-8, H=7168, I=2048, bf16, uniform routing); FusedMoE defaults.
Every layer's output must equal the first's bit for bit (capacity changes no result).
"""
import os
import statistics

import torch
import torch.distributed as dist
from layer_inputs import E, H, I, K, layer_inputs

from ditron_ep.bench.timing import time_fn
from ditron_ep.ops.moe_layer.fused import FusedMoE


def main():
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    T = int(os.environ.get("T", "128"))
    caps = [int(c) for c in os.environ.get("CAP", f"{T},4096").split(",")]
    iters = int(os.environ.get("ITERS", "20"))
    x, idx, w, w1, w2 = layer_inputs(T, rank, W)
    first = None
    for cap in caps:
        layer = FusedMoE(None, E, H, I, cap, K, torch.bfloat16)
        out = layer(x, idx, w, w1, w2)
        same = first is None or torch.equal(out, first)
        first = out if first is None else first
        times = time_fn(lambda: layer(x, idx, w, w1, w2), iters, 3, None, torch.device("cuda"))
        layer(x, idx, w, w1, w2, trace=True)
        torch.cuda.synchronize()
        stages = "  ".join(f"{r['stage']} {r['first_start_us']:.0f}-{r['last_end_us']:.0f} "
                           f"(busy {r['busy_us_per_program']:.0f})" for r in layer.timeline())
        print(f"[rank {rank}] T={T} layer max_tokens={cap} block_t={layer.plan.device.block_t}: median "
              f"{statistics.median(times):.1f} us (slowest rank per call, {iters} calls); bitwise == first: {same}\n"
              f"    traced call, us after kernel entry: {stages}", flush=True)
        layer.free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
