"""Tile primitives shared by every ditron_ep kernel: peer pointers, tile copies, signals.

Portable Triton only (`tl.atomic_*` with `sem`/`scope`, plain and volatile loads): the same source
compiles for sm_90 and gfx942 and runs under the interpreter on emulated ranks.

Signals are int32 words compared with wrap-around arithmetic (`value - target >= 0` in int32), and
kernels stamp them with the call's epoch, so they are reused across calls with no reset pass and
stay correct when the epoch wraps. Every wait is bounded: when its poll budget runs out it
records rank, stage, signal and values in the rank's error slot and returns False; the kernel
then skips the dependent work and the host raises `DitronTimeoutError`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.registry import register_device_function
from ditron_ep.runtime import control as C

EPOCH = tl.constexpr(C.EPOCH)
ARRIVALS = tl.constexpr(C.ARRIVALS)
TASKS = tl.constexpr(C.TASKS)
TASKS_B = tl.constexpr(C.TASKS_B)
ROLES = tl.constexpr(C.ROLES)
LAYOUT_SEQ = tl.constexpr(C.LAYOUT_SEQ)
ERR_FLAG = tl.constexpr(C.ERR_FLAG)
ERR_RANK = tl.constexpr(C.ERR_RANK)
ERR_STAGE = tl.constexpr(C.ERR_STAGE)
ERR_SIGNAL = tl.constexpr(C.ERR_SIGNAL)
ERR_OBSERVED = tl.constexpr(C.ERR_OBSERVED)
ERR_EXPECTED = tl.constexpr(C.ERR_EXPECTED)
ERR_EPOCH = tl.constexpr(C.ERR_EPOCH)
BARRIER = tl.constexpr(C.BARRIER)
REFUSED = tl.constexpr(C.REFUSED)
MAX_WORLD = tl.constexpr(C.MAX_WORLD)
STAGE_CALL_BARRIER = tl.constexpr(0)
ARENA_ALIGN = tl.constexpr(C.ARENA_ALIGN)


@register_device_function
@triton.jit
def heap_ptr(table_ptr, peer, offset_bytes, DTYPE: tl.constexpr):
    """Pointer to `offset_bytes` inside rank `peer`'s arena, typed as DTYPE (peer: a scalar, or a
    1-D tensor of ranks giving a tensor of pointers). offset_bytes must be a multiple of
    ARENA_ALIGN (heap offsets are: allocations start on 256-byte boundaries).

    The heap checks that every arena base is ARENA_ALIGN-byte aligned, and saying so here lets
    Triton prove heap tiles 16-byte aligned: it then moves them with 16-byte vector accesses and
    pipelines GEMM operands with async copies. Without the hint (an address made from an integer
    carries no alignment) every bf16 element is its own 2-byte access, several times slower.
    """
    base = tl.load(table_ptr + peer)  # int64 address of peer's arena in this process
    return tl.multiple_of((base + offset_bytes).to(tl.pointer_type(DTYPE)), ARENA_ALIGN)


@register_device_function
@triton.jit
def ctrl_ptr(table_ptr, peer):
    """int32 pointer to rank `peer`'s control block."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(tl.int32))


@register_device_function
@triton.jit
def notify(sig_ptr, value):
    """Publish `value` (an epoch stamp): every write this program made before is visible first."""
    # The scalar atomic is issued by one thread; the CTA barrier first makes the other threads'
    # stores happen-before it, so the (cumulative) release publishes the whole tile.
    tl.debug_barrier()
    tl.atomic_xchg(sig_ptr, value, sem="release", scope="sys")


@register_device_function
@triton.jit
def notify_add(sig_ptr, value):
    """Add `value` to a counting signal with release semantics (after a CTA barrier, as notify)."""
    tl.debug_barrier()
    tl.atomic_add(sig_ptr, value, sem="release", scope="sys")


@register_device_function
@triton.jit
def record_timeout(my_ctrl, rank, stage, signal_id, observed, expected):
    """First timeout of the rank wins the error slot; the flag is published last."""
    first = tl.atomic_cas(my_ctrl + ERR_FLAG, 0, -1, sem="acq_rel", scope="gpu")
    if first == 0:
        tl.store(my_ctrl + ERR_RANK, rank)
        tl.store(my_ctrl + ERR_STAGE, stage)
        tl.store(my_ctrl + ERR_SIGNAL, signal_id)
        tl.store(my_ctrl + ERR_OBSERVED, observed)
        tl.store(my_ctrl + ERR_EXPECTED, expected)
        tl.store(my_ctrl + ERR_EPOCH, tl.load(my_ctrl + EPOCH, volatile=True))
        tl.atomic_xchg(my_ctrl + ERR_FLAG, 1, sem="release", scope="gpu")


@register_device_function
@triton.jit
def read_error_flag(my_ctrl):
    """This rank's error flag, one value for the whole program: a scalar atomic's result is
    shared by every thread, while a plain scalar load is issued by each thread on its own and
    warps could see different values (and then leave a wait loop at different iterations)."""
    return tl.atomic_add(my_ctrl + ERR_FLAG, 0, sem="relaxed", scope="gpu")


@register_device_function
@triton.jit
def wait(sig_ptr, target, my_ctrl, rank, stage, signal_id, budget):
    """Spin (acquire) until `*sig_ptr - target >= 0` in int32, at most `budget` polls.

    Returns True when reached. On timeout the first failing wait of the rank records
    (rank, stage, signal_id, observed, target) in the error slot of `my_ctrl`; once a rank has
    failed, its other waits give up after at most one more poll so the launch drains quickly.
    """
    target = tl.cast(target, tl.int32)  # (a plain int when Triton specialises an argument to 1)
    v = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
    # The error flag is read only once the first poll fell short: a satisfied wait costs one
    # atomic round trip, not two (every GEMM tile of the megakernel waits once).
    failed = 0
    n = 0
    while ((v - target) < 0) & (n < budget) & (failed == 0):
        v = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
        failed = read_error_flag(my_ctrl)
        n += 1
    ok = (v - target) >= 0
    # Every thread of the program reads the awaited data only after the acquiring thread saw it.
    tl.debug_barrier()
    if not ok:
        record_timeout(my_ctrl, rank, stage, signal_id, v, target)
    return ok


@register_device_function
@triton.jit
def wait_all(p_sig, target, mask, my_ctrl, rank, stage, signal_id, budget):
    """Vector form of `wait`: spin until `*p_sig - target >= 0` for every lane in `mask`.

    Each lane polls its own word with an acquire atomic (no CAS: masked atomics are fine), lanes
    drop out once satisfied. On timeout records `signal_id` (the caller's id for the vector).
    """
    target = tl.cast(target, tl.int32)
    v = tl.atomic_add(p_sig, 0, mask=mask, sem="acquire", scope="sys")
    pending = mask & ((v - target) < 0)
    failed = 0  # read only once a poll fell short, as in `wait`
    n = 0
    while (tl.max(pending.to(tl.int32), axis=None) > 0) & (n < budget) & (failed == 0):
        v = tl.atomic_add(p_sig, 0, mask=pending, sem="acquire", scope="sys")
        pending = pending & ((v - target) < 0)
        failed = read_error_flag(my_ctrl)
        n += 1
    n_pending = tl.sum(pending.to(tl.int32), axis=None)  # any shape: reduce every axis
    tl.debug_barrier()
    if n_pending > 0:
        record_timeout(my_ctrl, rank, stage, signal_id, n_pending, 0)
    return n_pending == 0


@register_device_function
@triton.jit
def call_begin(table_ptr, rank, world, budget, ENTRY_BARRIER: tl.constexpr = True):
    """Enter a collective launch: returns (epoch, ok).

    The epoch is one more than the rank's call counter. With ENTRY_BARRIER it is stamped into
    every peer's barrier slot for this rank, and every program waits until all peers have entered
    the same call, so no rank writes into a peer's buffers while the peer still reads the previous
    call's data.

    ENTRY_BARRIER=False skips that round trip (~5.5 µs of a one-program launch on 2xH200,
    bench/results/HISTORY.md: small_t_latency). Only for a launch that follows, on the same stream and in the
    same call, a layout counts exchange (`ep_layout_kernel`) with every peer: a peer's counts
    arrived only once that peer had started this call's exchange, so its launches of the previous
    call had finished (stream order), and nothing of ours can land in a buffer it still reads.
    The host must not reset, between that exchange and this launch, a signal that peers write
    (resetting this rank's local counters there is fine: only its own programs add to them).
    """
    my_ctrl = ctrl_ptr(table_ptr, rank)
    epoch = tl.load(my_ctrl + EPOCH, volatile=True) + 1
    n_bad = 0
    if ENTRY_BARRIER:
        # Every program stamps (the same value): no program depends on another being resident.
        for p in range(world):
            notify(ctrl_ptr(table_ptr, p) + BARRIER + rank, epoch)
        for p in range(world):
            ok_p = wait(my_ctrl + BARRIER + p, epoch, my_ctrl, rank, STAGE_CALL_BARRIER, p, budget)
            n_bad += (ok_p == 0).to(tl.int32)
    # A rank whose error slot is set (a timeout not yet cleared by heap.reset()) runs no task:
    # its buffers may hold half-written data.
    return epoch, (n_bad == 0) & (read_error_flag(my_ctrl) == 0)


@register_device_function
@triton.jit
def next_task(my_ctrl):
    """Ticket from the launch's ordered task queue (0, 1, 2, ... across all programs)."""
    return tl.atomic_add(my_ctrl + TASKS, 1, sem="relaxed", scope="gpu")


@register_device_function
@triton.jit
def take_role(my_ctrl, comm_programs):
    """Role split: True for the first comm_programs programs to get here (by arrival, not by
    program id: CUDA does not promise to start blocks in id order, and a compute program must
    never wait for rows that only a not-yet-started program would place)."""
    return tl.atomic_add(my_ctrl + ROLES, 1, sem="relaxed", scope="gpu") < comm_programs


@register_device_function
@triton.jit
def next_task_split(my_ctrl, on_comm, split_at):
    """Role split: a ticket for a program on the communication queue (tickets [0, split_at), the
    queue's own counter) or on the compute queue (tickets [split_at, ...), a second counter).
    Exactly one atomic per call, at a computed address: a version that took the second counter's
    atomic under a branch compiled into a kernel that died with "illegal instruction" on H200
    (even when no program took that branch). A communication program that finds its queue
    drained gets -1, no task, and is a compute program from then on.
    Returns (ticket or -1, still on the communication queue). Callers must skip ticket -1 (and
    pass nothing derived from it on: interleaved_task(-1, ...) is not a task)."""
    raw = tl.atomic_add(my_ctrl + tl.where(on_comm, TASKS, TASKS_B), 1, sem="relaxed", scope="gpu")
    t = tl.where(on_comm, tl.where(raw < split_at, raw, -1), split_at + raw)
    return t, on_comm & (raw < split_at)


@register_device_function
@triton.jit
def refusal_slot(ctrl, epoch):
    """First word of the REFUSED slot of call `epoch` in the control block at `ctrl`
    (runtime/control.refusal_slot; ops/ep/refusal_kernels.py)."""
    return ctrl + REFUSED + (epoch & 1) * MAX_WORLD


@register_device_function
@triton.jit
def call_end(table_ptr, rank, epoch=0, world=0, RETIRE_REFUSALS: tl.constexpr = False):
    """Leave the launch; the last program out resets the queue and advances the epoch.

    RETIRE_REFUSALS (a launch whose programs read this call's refusal stamps, refusal.py): the
    last program out, after every program's read, rewrites that slot of the `world` peers with
    `epoch`, so that no old stamp can match a later call's epoch."""
    my_ctrl = ctrl_ptr(table_ptr, rank)
    n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    arrived = tl.atomic_add(my_ctrl + ARRIVALS, 1, sem="acq_rel", scope="gpu")
    if arrived == n_programs - 1:
        if RETIRE_REFUSALS:
            for p in range(world):
                tl.store(refusal_slot(my_ctrl, epoch) + p, epoch)
        tl.atomic_xchg(my_ctrl + ARRIVALS, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + TASKS, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + TASKS_B, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + ROLES, 0, sem="relaxed", scope="gpu")
        tl.atomic_add(my_ctrl + EPOCH, 1, sem="release", scope="gpu")


@register_device_function
@triton.jit
def copy_rows(src_ptr, src_stride, dst_ptr, dst_stride, n_rows, n_cols,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Copy an [n_rows, n_cols] tile (n_rows <= BLOCK_R) from src to dst, either side remote.

    A put when dst is a peer's heap pointer, a get when src is. Bits are copied unchanged.
    """
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < n_rows
    for c0 in range(0, n_cols, BLOCK_C):
        o_c = c0 + tl.arange(0, BLOCK_C)
        m = m_r[:, None] & (o_c < n_cols)[None, :]
        b_x = tl.load(src_ptr + o_r[:, None] * src_stride + o_c[None, :], mask=m)  # [BLOCK_R, BLOCK_C]
        tl.store(dst_ptr + o_r[:, None] * dst_stride + o_c[None, :], b_x, mask=m)
