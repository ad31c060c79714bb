"""Tile primitives shared by every ditron_ep kernel: peer pointers, tile copies, signals.

Portable Triton only (`tl.atomic_*` with `sem`/`scope`, plain and volatile loads): the same source
compiles for sm_90 and gfx942 and runs under the interpreter on emulated ranks.

Signals are int32 words compared with wrap-around arithmetic (`value - target >= 0` in int32), and
kernels stamp them with the call's number, so they are reused across calls with no reset pass and
stay correct when the number wraps; a stamp of an abandoned call never satisfies a later call's
wait, so a call that timed out leaves nothing to reset. Every wait is bounded: when its poll budget runs out it
records rank, stage, signal and values in the rank's error slot and returns False; the kernel
then skips the dependent work and the host raises `DitronTimeoutError`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.runtime import control as C

CALL = tl.constexpr(C.CALL)
ARRIVALS = tl.constexpr(C.ARRIVALS)
TASKS = tl.constexpr(C.TASKS)
TASKS_B = tl.constexpr(C.TASKS_B)
ROLES = tl.constexpr(C.ROLES)
GO = tl.constexpr(C.GO)
RESYNC = tl.constexpr(C.RESYNC)
NO_GO = tl.constexpr(C.NO_GO)
ABORT = tl.constexpr(C.ABORT)
ERR_FLAG = tl.constexpr(C.ERR_FLAG)
ERR_RANK = tl.constexpr(C.ERR_RANK)
ERR_STAGE = tl.constexpr(C.ERR_STAGE)
ERR_SIGNAL = tl.constexpr(C.ERR_SIGNAL)
ERR_OBSERVED = tl.constexpr(C.ERR_OBSERVED)
ERR_EXPECTED = tl.constexpr(C.ERR_EXPECTED)
FAIL_FLAGS = tl.constexpr(C.FAIL_FLAGS)
FAIL_RANK = tl.constexpr(C.FAIL_RANK)
FAIL_CALL = tl.constexpr(C.FAIL_CALL)
FAIL_PEER_CALL = tl.constexpr(C.FAIL_PEER_CALL)
BARRIER = tl.constexpr(C.BARRIER)
RECORD = tl.constexpr(C.RECORD)
MAX_WORLD = tl.constexpr(C.MAX_WORLD)
FLAG_GAVE_UP = tl.constexpr(C.FLAG_GAVE_UP)
FLAG_OUT_OF_STEP = tl.constexpr(C.FLAG_OUT_OF_STEP)
FLAG_MISSING = tl.constexpr(C.FLAG_MISSING)
FLAG_UNREAD = tl.constexpr(C.FLAG_UNREAD)
STOP_FLAGS = tl.constexpr(C.STOP_FLAGS)
MODE_FLAGS = tl.constexpr(C.MODE_FLAGS)
FLAG_MODE_MISMATCH = tl.constexpr(C.FLAG_MODE_MISMATCH)
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
    """Abort the launch's other waits; the rank's first unread timeout wins the error slot (the
    host reads and clears it), its flag published last."""
    tl.atomic_xchg(my_ctrl + ABORT, 1, sem="relaxed", scope="gpu")
    first = tl.atomic_cas(my_ctrl + ERR_FLAG, 0, -1, sem="acq_rel", scope="gpu")
    if first == 0:
        tl.store(my_ctrl + ERR_RANK, rank)
        tl.store(my_ctrl + ERR_STAGE, stage)
        tl.store(my_ctrl + ERR_SIGNAL, signal_id)
        tl.store(my_ctrl + ERR_OBSERVED, observed)
        tl.store(my_ctrl + ERR_EXPECTED, expected)
        tl.atomic_xchg(my_ctrl + ERR_FLAG, 1, sem="release", scope="gpu")


@register_device_function
@triton.jit
def read_abort(my_ctrl):
    """Whether a wait of this launch timed out, one value for the whole program: a scalar
    atomic's result is shared by every thread, while a plain scalar load is issued by each thread
    on its own and warps could see different values (and then leave a wait loop at different
    iterations)."""
    return tl.atomic_add(my_ctrl + ABORT, 0, sem="relaxed", scope="gpu")


@register_device_function
@triton.jit
def wait_value(sig_ptr, target, my_ctrl, rank, stage, signal_id, budget):
    """Spin (acquire) until `*sig_ptr - target >= 0` in int32, at most `budget` polls; returns
    the last value seen. On timeout the rank's first unread failing wait records (rank, stage,
    signal_id, observed, target) in the error slot of `my_ctrl`; once a wait of the launch has
    failed, its other waits give up after at most one more poll so the launch drains quickly.
    """
    target = tl.cast(target, tl.int32)  # (a plain int when Triton specialises an argument to 1)
    v = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
    # The abort word is read only once the first poll fell short: a satisfied wait costs one
    # atomic round trip, not two (every GEMM tile of the megakernel waits once).
    failed = 0
    n = 0
    while ((v - target) < 0) & (n < budget) & (failed == 0):
        v = tl.atomic_add(sig_ptr, 0, sem="acquire", scope="sys")
        failed = read_abort(my_ctrl)
        n += 1
    # Every thread of the program reads the awaited data only after the acquiring thread saw it.
    tl.debug_barrier()
    if (v - target) < 0:
        record_timeout(my_ctrl, rank, stage, signal_id, v, target)
    return v


@register_device_function
@triton.jit
def wait(sig_ptr, target, my_ctrl, rank, stage, signal_id, budget):
    """`wait_value`, returning True when the signal reached `target`."""
    return (wait_value(sig_ptr, target, my_ctrl, rank, stage, signal_id, budget) - target) >= 0


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
        failed = read_abort(my_ctrl)
        n += 1
    n_pending = tl.sum(pending.to(tl.int32), axis=None)  # any shape: reduce every axis
    tl.debug_barrier()
    if n_pending > 0:
        record_timeout(my_ctrl, rank, stage, signal_id, n_pending, 0)
    return n_pending == 0


@register_device_function
@triton.jit
def meet_peer(sig_ptr, rec_ptr, call, my_ctrl, rank, stage, peer, budget):
    """An opening launch meets `peer` on the signal the peer stamps with its call number
    (bounded wait), and reads the peer's record at `rec_ptr` ((flags, call number) of the
    peer's call of this parity). Returns (FLAG_* bits found, the peer's call number): the
    record's flags when the peer entered this call; FLAG_MISSING when it did not arrive (a
    timeout); FLAG_OUT_OF_STEP when its stamp passed this call without its entering it (it skipped
    a call) or it gave up on it. A peer stamped past this call after entering it is in step (it
    met every rank here and went on). A peer ahead moves this rank's next call to the peer's
    (RESYNC), so the ranks meet again."""
    v = wait_value(sig_ptr, call, my_ctrl, rank, stage, peer, budget)
    # scalar atomics: one value for every thread of the program (see read_abort)
    rec_call = tl.atomic_add(rec_ptr + 1, 0, sem="relaxed", scope="sys")
    rec_flags = tl.atomic_add(rec_ptr, 0, sem="relaxed", scope="sys")
    arrived = (v - call) >= 0
    entered = arrived & (rec_call == call)
    skipped = arrived & (rec_call != call)
    flags = tl.where(entered, rec_flags, 0)
    flags |= tl.where(arrived, 0, FLAG_MISSING) | tl.where(skipped, FLAG_OUT_OF_STEP, 0)
    flags |= tl.where((flags & FLAG_GAVE_UP) != 0, FLAG_OUT_OF_STEP, 0)
    if skipped:
        tl.atomic_max(my_ctrl + RESYNC, v - call - 1, sem="relaxed", scope="gpu")
    return flags, tl.where(entered, call, v)


@register_device_function
@triton.jit
def note_stop(my_ctrl, flags, peer, call, peer_call, KEEP: tl.constexpr):
    """An opening launch's program found `flags` (FLAG_*) at `peer`: if any stops the call, the
    launch does not go (call_end leaves GO behind); KEEP (a call whose host reads no records:
    barrier-opened ones) keeps the rank's first such finding not yet read by the host (FAIL_*).
    Returns 1 when it stops the call."""
    stop = (flags & STOP_FLAGS) != 0
    if stop:
        tl.atomic_xchg(my_ctrl + NO_GO, 1, sem="relaxed", scope="gpu")
    if KEEP:
        if stop:
            if tl.atomic_cas(my_ctrl + FAIL_CALL, 0, call, sem="relaxed", scope="gpu") == 0:
                tl.store(my_ctrl + FAIL_RANK, peer + 1)
                tl.store(my_ctrl + FAIL_PEER_CALL, peer_call)
                tl.atomic_xchg(my_ctrl + FAIL_FLAGS, flags, sem="release", scope="gpu")
    return stop.to(tl.int32)


@register_device_function
@triton.jit
def unread_flag(my_ctrl):
    """FLAG_UNREAD when this rank holds an error its host has not raised yet (a timeout or a
    stopped barrier-opened call): its record then stops the next call on every rank, and its
    host raises that error at the call's status read."""
    held = tl.atomic_add(my_ctrl + ERR_FLAG, 0, sem="relaxed", scope="gpu") | \
        tl.atomic_add(my_ctrl + FAIL_CALL, 0, sem="relaxed", scope="gpu")
    return tl.where(held != 0, FLAG_UNREAD, 0)


@register_device_function
@triton.jit
def held_errors(my_ctrl, call):
    """`unread_flag` and whether the held error is of a call before `call`, from one read of the
    error words (an opening launch's entry path): a timeout whose awaited stamp (ERR_EXPECTED: a
    call number) is not `call`, or a stopped call other than `call`. An error another program of
    this very launch just recorded does not count (its programs still meet, and leave at once on
    the abort word)."""
    err = tl.atomic_add(my_ctrl + ERR_FLAG, 0, sem="acquire", scope="gpu")
    fail_call = tl.atomic_add(my_ctrl + FAIL_CALL, 0, sem="relaxed", scope="gpu")
    err_call = tl.atomic_add(my_ctrl + ERR_EXPECTED, 0, sem="relaxed", scope="gpu")
    unread = tl.where((err | fail_call) != 0, FLAG_UNREAD, 0)
    return unread, ((err == 1) & (err_call != call)) | ((fail_call != 0) & (fail_call != call))


@register_device_function
@triton.jit
def dispatch_stopped(src_info_ptr, world, BLOCK_W: tl.constexpr):
    """1 when the dispatch whose layout gave `src_info` [W, 2] (every rank's flags, T) did not go
    (a stop flag of any rank): a combine or replay along its handle is then no call (call_begin's
    skip). Every rank holding such a handle reads the same flags."""
    o_w = tl.arange(0, BLOCK_W)
    flags = tl.load(src_info_ptr + o_w * 2, mask=o_w < world, other=0)
    return (tl.max(flags & STOP_FLAGS, axis=0) != 0).to(tl.int32)


@register_device_function
@triton.jit
def record_slot(ctrl, call):
    """First word of the RECORD slot of barrier-opened call `call` in the control block at
    `ctrl` (runtime/control.record_slot)."""
    return ctrl + RECORD + (call & 1) * 2 * MAX_WORLD


@register_device_function
@triton.jit
def call_begin(table_ptr, rank, world, budget, OPENS: tl.constexpr = True, flags=0,
               KEEP: tl.constexpr = True, skip=0):
    """Enter a collective launch: returns (call, go).

    OPENS (an opening launch: the call's first, with an entry barrier): the call number is one
    more than the rank's CALL word. The rank writes its record (`flags`, FLAG_*, with the call's
    mode bits, MODE_FLAGS, which every rank must pass alike) into every
    peer's RECORD slot of the call, then stamps its BARRIER word there with the call number; every
    program then meets every peer (`meet_peer`). go = every peer is at this call and none is
    flagged; otherwise no program runs a task, on any rank (every rank read the same records).
    A rank that timed out marks its record FLAG_GAVE_UP, so a peer arriving late leaves too; one
    holding an unread error marks it FLAG_UNREAD. KEEP: see `note_stop`. skip != 0: the launch
    follows a handle whose dispatch did not go (graph mode; every rank holding such a handle
    sees it): it is no call at all (no record, no stamp, CALL unchanged) and runs no task, so the
    ranks' call numbers stay in step with the rank that raised instead.
    No rank writes into a peer's buffers while the peer still reads the previous call's data.

    OPENS=False: a launch that follows, on the same stream and in the same call, the call's
    opening launch (the counts exchange, `ep_layout_kernel`): it takes that call's number and
    goes only if the opening went (GO). A peer's counts arrived only once that peer had started
    this call, so its launches of the previous call had finished (stream order), and nothing of
    ours can land in a buffer it still reads. Saves the barrier's round trip (~5.5 µs of a
    one-program launch on 2xH200, bench/results/HISTORY.md: small_t_latency).
    """
    my_ctrl = ctrl_ptr(table_ptr, rank)
    if OPENS:
        call = tl.load(my_ctrl + CALL, volatile=True) + 1
        unread, held = held_errors(my_ctrl, call)
        flags |= unread
        n_stop = 0
        n_missing = 0
        if skip == 0:
            # Every program writes (the same values): no program depends on another being resident.
            for p in range(world):
                p_ctrl = ctrl_ptr(table_ptr, p)
                tl.store(record_slot(p_ctrl, call) + 2 * rank, flags)
                tl.store(record_slot(p_ctrl, call) + 2 * rank + 1, call)
                notify(p_ctrl + BARRIER + rank, call)  # its release publishes the record
        if (skip == 0) & (held != 0):
            # The call cannot go (every peer reads FLAG_UNREAD in the record just written and stops
            # too): leave without meeting. A host that defers its reads (calls under autograd) may
            # issue several calls before it raises; waiting for a peer that is gone would cost a
            # whole budget at each, and a timeout recorded here would hide the held error.
            tl.atomic_xchg(my_ctrl + NO_GO, 1, sem="relaxed", scope="gpu")
            n_stop = 1
        elif skip == 0:
            for p in range(world):
                seen, v = meet_peer(my_ctrl + BARRIER + p, record_slot(my_ctrl, call) + 2 * p, call, my_ctrl, rank,
                                    STAGE_CALL_BARRIER, p, budget)
                # a peer that entered asking for another mode (flags' MODE_FLAGS) stops the call
                entered = (seen & (FLAG_MISSING | FLAG_OUT_OF_STEP)) == 0
                seen |= tl.where(entered & ((seen & MODE_FLAGS) != (flags & MODE_FLAGS)), FLAG_MODE_MISMATCH, 0)
                n_stop += note_stop(my_ctrl, seen, p, call, v, KEEP)
                n_missing += ((seen & FLAG_MISSING) != 0).to(tl.int32)
            if n_missing > 0:  # leave the call: a peer that comes late finds this and leaves too
                for p in range(world):
                    tl.store(record_slot(ctrl_ptr(table_ptr, p), call) + 2 * rank, flags | FLAG_GAVE_UP)
        go = (n_stop == 0) & (skip == 0)
    else:
        call = tl.load(my_ctrl + CALL, volatile=True)
        go = tl.load(my_ctrl + GO, volatile=True) == call
    return call, go


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
def call_end(table_ptr, rank, call, OPENS: tl.constexpr = True, skip=0):
    """Leave the launch; the last program out resets the launch's words and, for an opening
    launch, moves the call number on: CALL = call (plus RESYNC when a peer was ahead), and
    GO = call when no program found a reason to stop (skip != 0: no call, see call_begin)."""
    my_ctrl = ctrl_ptr(table_ptr, rank)
    n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    arrived = tl.atomic_add(my_ctrl + ARRIVALS, 1, sem="acq_rel", scope="gpu")
    if arrived == n_programs - 1:
        tl.atomic_xchg(my_ctrl + ARRIVALS, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + TASKS, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + TASKS_B, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + ROLES, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(my_ctrl + ABORT, 0, sem="relaxed", scope="gpu")
        if OPENS:
            if skip == 0:
                if tl.atomic_xchg(my_ctrl + NO_GO, 0, sem="relaxed", scope="gpu") == 0:
                    tl.atomic_xchg(my_ctrl + GO, call, sem="relaxed", scope="gpu")
                resync = tl.atomic_xchg(my_ctrl + RESYNC, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(my_ctrl + CALL, call + resync, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["rank"])
def flagged_call_kernel(table_ptr, rank, world, budget, flags):
    """This rank's part in a barrier-opened call it cannot run (one program): its record carries
    `flags` (FLAG_REFUSED: it rejected its own arguments), so every peer's launch stops at the
    barrier and records why; nothing moves, and every rank's call number advances alike."""
    call, go = call_begin(table_ptr, rank, world, budget, OPENS=True, flags=flags, KEEP=False)
    call_end(table_ptr, rank, call, OPENS=True)


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


register_kernel(flagged_call_kernel, {"table_ptr": "*i64", "rank": "i32", "world": "i32", "budget": "i32",
                                      "flags": "i32"}, label="flagged-call")
