"""Interleaved producer/consumer task queues for the persistent copy kernels.

A queue holds n_groups producer groups of A tasks each (group g = chunk g of the tokens) and m
consumer groups of R tasks each, where consumer group g needs producer groups 0..g only (of this
rank and of its peers). Consumer group g is placed right after producer group g + lag, or at the
end when there is none:

    P0 .. P(lag-1) | P(lag) C0 | P(lag+1) C1 | ... | remaining P or remaining C

So senders and receivers run at the same time (a receiver starts on chunk g while chunk g + lag
is still being sent) instead of one after the other. Assumed: n_groups, A and R are the same on
every rank, and consumer group g needs producer groups 0..g only; m and lag may differ per rank.
Then every consumer sits at a later ticket than every producer it needs, on every rank: the
peer's producer group g ends no later than ticket (g + 1) * A + g * R - 1 (its value at lag 0
and m >= n_groups), and this rank's consumer group g starts no earlier than (g + 1) * A + g * R.
That is the ordered-queue rule (a task waits only on tasks at earlier tickets of every rank's
queue; the verifier checks it), so a GPU with every program resident cannot deadlock
and the interpreter (one program runs the queue in order) never waits on work not yet done.
Which task runs where never changes what a task computes: results stay bitwise.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.registry import register_device_function

# Send tasks per side a small-T call should have: about one per SM of an H100/H200.
TARGET_TASKS = 128
TARGET_TASKS_C = tl.constexpr(TARGET_TASKS)


@register_device_function
@triton.jit
def interleaved_task(t, n_groups, A, m, R, lag):
    """Ticket t -> (is_producer, index); index = group * A + i for producers, group * R + i for
    consumers. Tickets run from 0 to n_groups * A + m * R."""
    head_g = tl.minimum(lag, n_groups)
    head = head_g * A
    n_mid = tl.maximum(tl.minimum(n_groups - head_g, m), 0)
    mid_end = head + n_mid * (A + R)
    rest_p = (n_groups - head_g - n_mid) * A
    t2 = tl.maximum(t - head, 0)
    g = t2 // (A + R)
    r = t2 - g * (A + R)
    t3 = tl.maximum(t - mid_end, 0)
    in_head = t < head
    in_mid = (t >= head) & (t < mid_end)
    is_producer = in_head | (in_mid & (r < A)) | ((t >= mid_end) & (t3 < rest_p))
    index = tl.where(in_head, t,
                     tl.where(in_mid, tl.where(r < A, (head_g + g) * A + r, g * R + r - A),
                              tl.where(t3 < rest_p, (head_g + n_mid) * A + t3, n_mid * R + t3 - rest_p)))
    return is_producer, index


@register_device_function
@triton.jit
def call_chunks(src_info_ptr, world, n_chunks, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """Chunks of BLOCK_S staging slots this call uses: those below the largest T of any rank
    (src_info [W, 2] = every rank's (flags, T), from the layout exchange, so every rank gets the
    same count and the queues keep the same producer groups everywhere). A rank sends a peer at
    most T tokens, so later chunks are empty for every (source, destination) pair: a buffer sized
    for prefill does not walk (and take tickets for) its empty chunks at decode."""
    o_w = tl.arange(0, BLOCK_W)
    max_t = tl.max(tl.load(src_info_ptr + o_w * 2 + 1, mask=o_w < world, other=0), axis=0)
    return tl.minimum(tl.cdiv(max_t, BLOCK_S), n_chunks)


@register_device_function
@triton.jit
def call_slices(n_call, world, n_chunks, n_slices, slice_cols, lag, H, tasks_per_slice,
                BLOCK_H: tl.constexpr):
    """(slices, columns per slice, lag) of a call that uses n_call of the buffer's n_chunks chunks.

    A buffer picks its column slices for its capacity (`hidden_slices`): a call with fewer tokens
    gets more slices, as `hidden_slices` would give a buffer of the call's size (TARGET_TASKS send
    tasks per side), within the buffer's signal words: a source's words (n_chunks * n_slices) are
    indexed chunk * slices + slice, so n_call * slices must fit. Otherwise the buffer's own
    (n_slices, slice_cols, lag). Every rank computes the same from shared values. lag: producer
    groups a consumer trails by, about one grid of tickets (`default_lag`; tasks_per_slice = the
    queue's tasks per chunk and column slice over both sides: 2 * world for dispatch)."""
    n_used = tl.maximum(n_call, 1)
    n_hb = tl.cdiv(H, BLOCK_H)
    want = tl.minimum(tl.minimum(TARGET_TASKS_C // (world * n_used), n_hb), (n_chunks * n_slices) // n_used)
    per = tl.cdiv(n_hb, tl.maximum(want, 1))
    more = tl.cdiv(n_hb, per) > n_slices  # (equal: the same slices; keep the buffer's lag too)
    s = tl.where(more, tl.cdiv(n_hb, per), n_slices)
    cols = tl.where(more, per * BLOCK_H, slice_cols)
    lag = tl.where(more, tl.cdiv(tl.num_programs(0), tasks_per_slice * s), lag)
    return s, cols, lag


@register_device_function
@triton.jit
def chunk_signal(sig_first, rank, n_chunks, n_slices, chunk, n_sl, slice_j):
    """Signal word of (rank, chunk, column slice) in a copy kernel's family, the one index both
    the stamping and the waiting side use. Each rank owns the buffer's n_chunks * n_slices words,
    indexed chunk * n_sl + slice with the call's slices n_sl (`call_slices` keeps that inside)."""
    return sig_first + rank * (n_chunks * n_slices) + chunk * n_sl + slice_j


def interleaved_order(n_groups: int, A: int, m: int, R: int, lag: int) -> list[tuple[bool, int]]:
    """The queue interleaved_task walks, in ticket order (host mirror, for tests and plans)."""
    order: list[tuple[bool, int]] = []
    for g in range(min(lag, n_groups)):
        order += [(True, g * A + i) for i in range(A)]
    placed = 0
    for g in range(min(lag, n_groups), n_groups):
        order += [(True, g * A + i) for i in range(A)]
        if placed < m:
            order += [(False, placed * R + i) for i in range(R)]
            placed += 1
    for g in range(placed, m):
        order += [(False, g * R + i) for i in range(R)]
    return order


def default_lag(num_programs: int, tasks_per_group: int) -> int:
    """Producer groups a consumer trails by: about one grid of tickets, so the chunk it waits for
    was handed out a whole wave earlier and has usually landed."""
    return triton.cdiv(num_programs, max(tasks_per_group, 1))


def hidden_slices(max_tokens: int, world: int, block_rows: int, hidden: int, block_hidden: int,
                  requested: int | None = None) -> tuple[int, int]:
    """(slices, columns per slice): split every chunk's hidden columns over several tasks when the
    chunks alone would leave most programs idle (small T), so one program does not walk a whole
    row. Depends only on quantities every rank shares (sender and receiver index the signals by
    it). Columns per slice are a multiple of block_hidden; no slice is empty."""
    n_hb = triton.cdiv(hidden, block_hidden)
    if requested is None:
        requested = TARGET_TASKS // (world * triton.cdiv(max_tokens, block_rows))
    per = triton.cdiv(n_hb, max(1, min(requested, n_hb)))
    return triton.cdiv(n_hb, per), per * block_hidden
