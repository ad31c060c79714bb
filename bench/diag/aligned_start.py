"""Diagnostic (GPUs, torchrun; not a benchmark): how much of a call's time under the benchmarks'
timing rule is the ranks' skew in leaving the barrier?

    TOK=128,4096 torchrun --nproc-per-node 4 bench/diag/aligned_start.py

Per T: `moe()` (overlap, default mode) and the torch-native pipeline (NCCL all_to_all_single +
torch._grouped_mm, as bench/moe_layer.py runs it) timed with `time_fn` twice, in alternation:
the benchmarks' rule (barrier, device drain, each rank's own CUDA events: skew counts) and
align=True (the ranks also meet in an all_reduce queued on the stream right before the start
event: the skew drops out, each rank's host time to issue the call still counts). Median (p20,
p80) of the slowest rank, ITERS (default 30) iterations each, rank 0 prints. Shapes: E=64, top-8,
H=7168, I=2048, bf16, uniform routing (layer_inputs.py).
"""
import os

import torch
import torch.distributed as dist
from layer_inputs import layer_inputs

from ditron_ep.bench.timing import summarize, time_fn
from ditron_ep.bench.torch_moe import torch_native_moe
from ditron_ep.ops import moe


def main():
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    iters = int(os.environ.get("ITERS", "30"))
    lines = []
    with torch.no_grad():
        for T in [int(t) for t in os.environ.get("TOK", "128,4096").split(",")]:
            x, idx, w, w1, w2 = layer_inputs(T, rank, W)
            calls = {"moe overlap": lambda: moe(x, idx, w, w1, w2),
                     "torch-native": lambda: torch_native_moe(x, idx, w, w1, w2, True)}
            for round_ in range(2):
                for name, fn in calls.items():
                    for align in (False, True):
                        s = summarize(time_fn(fn, iters, 5, device=dev, align=align))
                        rule = "aligned start" if align else "barrier rule "
                        lines.append(f"T={T:5d} {name:13s} {rule} round {round_}: median {s['median']:8.1f} us "
                                     f"(p20 {s['p20']:.1f}, p80 {s['p80']:.1f})")
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
