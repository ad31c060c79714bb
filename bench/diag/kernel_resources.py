"""Diagnostic (GPU; not a benchmark): registers, spills and shared memory of every compiled
variant of the library's GEMM and megakernel kernels in this process.

    torchrun --nproc-per-node 2 bench/diag/kernel_resources.py     # rank 0 prints

Runs one FusedMoE call (layer_inputs.py's shape: E=64, top-8, H=7168, I=2048, bf16; T=TOK tokens,
default 4096) and one standalone `grouped_swiglu_ffn` on its dispatched rows, then lists, per
compiled kernel, what ptxas reported: a GEMM loop that spills (n_spills > 0) or a megakernel that
needs more registers than the standalone tile is a cost the stage timings alone do not show.
"""
import os

import torch
import torch.distributed as dist
from layer_inputs import E, H, I, K, layer_inputs

from ditron_ep.ops.ep.functional import dispatch
from ditron_ep.ops.moe_layer.fused import FusedMoE
from ditron_ep.ops.moe_layer.fused_kernels import moe_fused_kernel
from ditron_ep.ops.moe_layer.grouped_ffn import grouped_swiglu_ffn
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import grouped_down_kernel, grouped_swiglu_kernel


def report(fn, name):
    lines = []
    for device, (cache, *_rest) in fn.device_caches.items():
        for kernel in cache.values():
            kernel._init_handles()
            md = kernel.metadata
            lines.append(f"{name} (device {device}, {md.num_warps} warps, {md.num_stages} stages): "
                         f"{kernel.n_regs} registers, {kernel.n_spills} spilled, {md.shared} B shared")
    return lines or [f"{name}: not compiled in this process"]


def main():
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    T = int(os.environ.get("TOK", "4096"))
    x, idx, w, w1, w2 = layer_inputs(T, rank, W)
    with torch.no_grad():
        layer = FusedMoE(None, E, H, I, T, K, torch.bfloat16)
        layer(x, idx, w, w1, w2)
        layer.free()
        recv_x, handle = dispatch(x, idx, num_experts=E)
        grouped_swiglu_ffn(recv_x, handle.expert_offsets, w1, w2)
    torch.cuda.synchronize()
    if rank == 0:
        for fn, name in ((moe_fused_kernel, "moe_fused_kernel"), (grouped_swiglu_kernel, "grouped_swiglu_kernel"),
                         (grouped_down_kernel, "grouped_down_kernel")):
            print("\n".join(report(fn, name)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
