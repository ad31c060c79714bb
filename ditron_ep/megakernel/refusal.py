"""Refusal: a rank that rejects its own arguments still takes part in a collective launch.

A launch that enters through `call_begin`'s barrier waits for every peer. When one rank's host
rejects its arguments and raises, its peers would wait in that barrier until their budget runs
out. Instead the rank launches `refused_call_kernel`: it stamps the call's epoch into every peer's
REFUSED slot for this rank, then meets the peers at the barrier (the barrier's release publishes
the stamp) and leaves, advancing its epoch like any launch. A peer's kernel asks `peer_refused`
right after its barrier, runs no task, and records the refusal in its error slot, which the host
reads back as a DitronConfigError naming the rank (runtime/heap.py). Nothing moves on any rank
and every epoch advances, so the next call finds the ranks in step.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..compiler.portability import register_device_function, register_kernel
from ..runtime import control as C
from .primitives import call_begin, call_end, ctrl_ptr, record_timeout

EPOCH = tl.constexpr(C.EPOCH)
REFUSED = tl.constexpr(C.REFUSED)
STAGE_PEER_REFUSED = tl.constexpr(C.ERR_STAGE_PEER_REFUSED)


@register_device_function
@triton.jit
def peer_refused(table_ptr, rank, world, epoch, BLOCK_W: tl.constexpr):
    """After `call_begin`'s barrier: 1 when a peer refused this call (its REFUSED slot holds
    `epoch`), else 0; the refusing rank is recorded in this rank's error slot. One value for the whole
    program (a reduction over one atomic read per peer)."""
    my_ctrl = ctrl_ptr(table_ptr, rank)
    o_w = tl.arange(0, BLOCK_W)
    m_w = o_w < world
    stamps = tl.atomic_add(my_ctrl + REFUSED + o_w, 0, mask=m_w, sem="acquire", scope="sys")
    first = tl.min(tl.where(m_w & (stamps == epoch), o_w, BLOCK_W), axis=0)
    if first < world:
        record_timeout(my_ctrl, first, STAGE_PEER_REFUSED, 0, 0, 0)
    return (first < world).to(tl.int32)


@triton.jit
def refused_call_kernel(table_ptr, rank, world, budget):
    """This rank's part in a call it refused (one program): stamp the refusal, meet the peers at
    the entry barrier, leave."""
    my_ctrl = ctrl_ptr(table_ptr, rank)
    epoch = tl.load(my_ctrl + EPOCH, volatile=True) + 1  # the epoch call_begin will use
    for p in range(world):
        tl.atomic_xchg(ctrl_ptr(table_ptr, p) + REFUSED + rank, epoch, sem="relaxed", scope="sys")
    call_begin(table_ptr, rank, world, budget)  # its notifies release the stamps above
    call_end(table_ptr, rank)


register_kernel(refused_call_kernel, {"table_ptr": "*i64", "rank": "i32", "world": "i32", "budget": "i32"},
                label="refusal")
