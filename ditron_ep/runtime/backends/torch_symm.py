"""CUDA/ROCm backend: the arena is one `torch.distributed._symmetric_memory` allocation.

CUDA IPC maps every peer's allocation into this process; `buffer_ptrs` gives their addresses.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.runtime.backends import Arena


def create_arena(size_bytes: int, group: dist.ProcessGroup, rank: int, world_size: int,
                 device: torch.device) -> Arena:
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(size_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(local, group)
    bases = [int(p) for p in handle.buffer_ptrs]
    if len(bases) != world_size:
        raise RuntimeError(f"symmetric memory rendezvous returned {len(bases)} peers, expected {world_size}")
    # buffer_ptrs are the bases of whole allocations; with torch's memory pool our tensor may start
    # inside one, at an offset that can differ per rank. Exchange the offsets and apply them.
    offsets: list[int] = [0] * world_size
    dist.all_gather_object(offsets, local.data_ptr() - bases[rank], group=group)
    bases = [b + o for b, o in zip(bases, offsets)]
    local.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    holder = [local, handle]

    def release() -> None:
        holder.clear()

    return Arena(local=local, peer_bases=bases, release=release)
