"""Refusal: a rank that rejects its own arguments still takes part in a collective launch.

A launch that enters through `call_begin`'s barrier waits for every peer. When one rank's host
rejects its arguments and raises, its peers would wait in that barrier until their budget runs
out. Instead the rank launches `refused_call_kernel`: it stamps the call's epoch e into its
REFUSED word in every peer's control block, then meets the peers at the barrier (the barrier's
release publishes the stamp) and leaves, advancing its epoch like any launch. A peer's kernel
asks `peer_refused` right after its barrier, runs no task, and records the refusing rank in its
REFUSAL_SEEN word. Nothing moves on any rank and every epoch advances, so the ranks stay in step.

The record does not block later launches (unlike a timeout in the error slot). The host raises
it as a DitronConfigError when it reads the error slot (`SymmetricHeap.read_error`: at once with
`check_errors`); otherwise the rank's next counts exchange sends FLAG_UNREPORTED_REFUSAL, so every
rank raises at that call's status read, and the rank that held the record clears it.

Stamps come in two slots picked by the epoch's parity: the refusing rank leaves the barrier once
any program of a peer has arrived, and may refuse its next call while that peer's other
programs have yet to read the stamp of this one; it cannot reach call e + 2 before every peer
finished call e (each launch waits for every peer, or follows a counts exchange that did). The
last program of a peer's launch rewrites the slot it read with e (`call_end(RETIRE_REFUSALS)`), so
no stamp lingers to match an epoch 2**32 launches later.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.primitives import call_begin, call_end, ctrl_ptr, refusal_slot
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.runtime import control as C

EPOCH = tl.constexpr(C.EPOCH)
REFUSAL_SEEN = tl.constexpr(C.REFUSAL_SEEN)
REFUSERS_SEEN = tl.constexpr(C.REFUSERS_SEEN)


@register_device_function
@triton.jit
def peer_refused(table_ptr, rank, world, epoch, BLOCK_W: tl.constexpr):
    """After `call_begin`'s barrier: 1 when a peer refused this call (its stamp holds `epoch`),
    else 0; the lowest refusing rank is recorded in REFUSAL_SEEN and how many refused in
    REFUSERS_SEEN. One value for the whole program (a reduction over one atomic read per peer)."""
    my_ctrl = ctrl_ptr(table_ptr, rank)
    o_w = tl.arange(0, BLOCK_W)
    m_w = o_w < world
    stamps = tl.atomic_add(refusal_slot(my_ctrl, epoch) + o_w, 0, mask=m_w, sem="acquire", scope="sys")
    refused = m_w & (stamps == epoch)
    first = tl.min(tl.where(refused, o_w, BLOCK_W), axis=0)
    if first < world:
        tl.atomic_xchg(my_ctrl + REFUSERS_SEEN, tl.sum(refused.to(tl.int32), axis=0), sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + REFUSAL_SEEN, first + 1, sem="relaxed", scope="gpu")
    return (first < world).to(tl.int32)


@triton.jit
def refused_call_kernel(table_ptr, rank, world, budget):
    """This rank's part in a call it refused (one program): stamp the refusal, meet the peers at
    the entry barrier, leave."""
    my_ctrl = ctrl_ptr(table_ptr, rank)
    epoch = tl.load(my_ctrl + EPOCH, volatile=True) + 1  # the epoch call_begin will use
    for p in range(world):
        tl.atomic_xchg(refusal_slot(ctrl_ptr(table_ptr, p), epoch) + rank, epoch, sem="relaxed", scope="sys")
    call_begin(table_ptr, rank, world, budget)  # its notifies release the stamps above
    call_end(table_ptr, rank)


register_kernel(refused_call_kernel, {"table_ptr": "*i64", "rank": "i32", "world": "i32", "budget": "i32"},
                label="refusal")
