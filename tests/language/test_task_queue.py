"""The interleaved task queue of the copy kernels: the device function walks exactly the host
mirror's order, every task appears once, and every consumer group comes after the producer
groups it needs (on every rank, whatever each rank's consumer count)."""
from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from ditron_ep.language.task_queue import (
    call_chunks,
    call_slices,
    default_lag,
    hidden_slices,
    interleaved_order,
    interleaved_task,
)

SHAPES = [  # (n_groups, A, m, R, lag)
    (5, 3, 5, 3, 0), (5, 3, 5, 3, 2), (6, 2, 3, 1, 1), (4, 4, 0, 2, 1), (3, 2, 3, 2, 7), (1, 1, 1, 1, 1),
    (7, 2, 4, 3, 3), (2, 5, 6, 1, 0),
]


@triton.jit
def _walk_kernel(out_ptr, n_tickets, n_groups, A, m, R, lag):
    for t in range(0, n_tickets):
        is_p, idx = interleaved_task(t, n_groups, A, m, R, lag)
        tl.store(out_ptr + 2 * t, is_p.to(tl.int32))
        tl.store(out_ptr + 2 * t + 1, idx)


@pytest.mark.parametrize("n_groups,A,m,R,lag", SHAPES)
def test_device_walk_equals_host_order(n_groups, A, m, R, lag):
    order = interleaved_order(n_groups, A, m, R, lag)
    n = n_groups * A + m * R
    assert len(order) == n
    out = torch.full((max(n, 1), 2), -7, dtype=torch.int32)
    _walk_kernel[(1,)](out, n, n_groups, A, m, R, lag)
    assert [(bool(p), int(i)) for p, i in out[:n].tolist()] == order
    assert sorted(i for p, i in order if p) == list(range(n_groups * A))
    assert sorted(i for p, i in order if not p) == list(range(m * R))


@pytest.mark.parametrize("n_groups,A,m,R,lag", SHAPES)
def test_consumers_follow_their_producers_across_ranks(n_groups, A, m, R, lag):
    """Consumer group g of one rank (any m, any lag) sits at a later ticket than producer group g
    of any other rank (any m', lag'): the queue rule that keeps persistent kernels deadlock-free."""
    def tickets(m_, lag_):
        producer_last, consumer_first = {}, {}
        for t, (is_p, i) in enumerate(interleaved_order(n_groups, A, m_, R, lag_)):
            if is_p:
                producer_last[i // A] = t
            else:
                consumer_first.setdefault(i // R, t)
        return producer_last, consumer_first
    for (m1, lag1), (m2, lag2) in itertools.product([(m, lag), (0, 0), (n_groups, 3), (1, 9)], repeat=2):
        m1, m2 = min(m1, n_groups), min(m2, n_groups)
        _, consumer_first = tickets(m1, lag1)
        producer_last, _ = tickets(m2, lag2)
        for g, t in consumer_first.items():
            assert all(producer_last[h] < t for h in range(g + 1)), (m1, lag1, m2, lag2, g)


def test_hidden_slices():
    # small T: chunks alone give 4 * 8 = 32 tasks, so columns split into 4 slices of 2 blocks
    assert hidden_slices(128, 4, 16, 7168, 1024) == (4, 2048)
    assert hidden_slices(4096, 4, 16, 7168, 1024) == (1, 7168)  # one slice: the whole row
    # never an empty slice: 3 blocks asked for 2 slices -> 2 slices (2 + 1 blocks)
    assert hidden_slices(16, 2, 16, 40, 16, requested=2) == (2, 32)
    assert hidden_slices(16, 2, 16, 40, 16, requested=99) == (3, 16)
    assert hidden_slices(16, 2, 16, 40, 64) == (1, 64)


@triton.jit
def _call_chunks_kernel(src_info_ptr, out_ptr, world, n_chunks, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    tl.store(out_ptr, call_chunks(src_info_ptr, world, n_chunks, BLOCK_S, BLOCK_W))


@pytest.mark.parametrize("tokens,n_chunks,expected", [
    ([0, 0, 0], 8, 0),          # nobody has tokens: no chunk, no ticket
    ([5, 0, 17], 8, 2),         # the largest T decides: cdiv(17, 16)
    ([16, 16, 16], 8, 1),       # exactly one chunk
    ([128, 3, 0], 8, 8),        # a full buffer
    ([300, 3, 0], 8, 8),        # T past the buffer (flagged input): capped at the buffer's chunks
])
def test_call_chunks_follows_the_largest_rank(tokens, n_chunks, expected):
    """Dispatch and combine walk only the chunks below the largest T of any rank."""
    src_info = torch.tensor([[0, t] for t in tokens], dtype=torch.int32)
    out = torch.full((1,), -7, dtype=torch.int32)
    _call_chunks_kernel[(1,)](src_info, out, len(tokens), n_chunks, BLOCK_S=16, BLOCK_W=4)
    assert int(out) == expected


@triton.jit
def _call_slices_kernel(out_ptr, n_call, world, n_chunks, n_slices, slice_cols, lag, H, tasks_per_slice,
                        BLOCK_H: tl.constexpr):
    s, cols, lag_c = call_slices(n_call, world, n_chunks, n_slices, slice_cols, lag, H, tasks_per_slice, BLOCK_H)
    tl.store(out_ptr, s)
    tl.store(out_ptr + 1, cols)
    tl.store(out_ptr + 2, lag_c)


def _device_call_slices(programs, *args, block_h):
    out = torch.full((3,), -7, dtype=torch.int32)
    _call_slices_kernel[(programs,)](out, *args, BLOCK_H=block_h)
    return tuple(int(v) for v in out)


@pytest.mark.parametrize("world,max_tokens,block_rows,hidden,block_h", [
    (2, 4096, 16, 7168, 1024), (4, 4096, 16, 7168, 1024), (3, 70, 4, 40, 16), (2, 256, 16, 4096, 256)])
def test_call_slices(world, max_tokens, block_rows, hidden, block_h):
    """A call using every chunk keeps the buffer's slicing; a smaller call gets the slicing of a
    buffer of its size, as long as the buffer's signal words hold it."""
    n_chunks = -(-max_tokens // block_rows)
    n_slices, cols = hidden_slices(max_tokens, world, block_rows, hidden, block_h)
    programs = 7
    lag = 5
    tps = 2 * world
    assert _device_call_slices(programs, n_chunks, world, n_chunks, n_slices, cols, lag, hidden, tps,
                               block_h=block_h) == (n_slices, cols, lag)
    for n_call in range(0, n_chunks + 1, max(1, n_chunks // 9)):
        got = _device_call_slices(programs, n_call, world, n_chunks, n_slices, cols, lag, hidden, tps, block_h=block_h)
        want_s, want_cols = hidden_slices(max(n_call, 1) * block_rows, world, block_rows, hidden, block_h)
        if want_s * max(n_call, 1) > n_chunks * n_slices:  # more than the signal words hold: capped
            assert got[0] * max(n_call, 1) <= n_chunks * n_slices
        elif want_s > n_slices:
            assert got == (want_s, want_cols, default_lag(programs, tps * want_s)), f"n_call={n_call}"
        else:
            assert got == (n_slices, cols, lag), f"n_call={n_call}"
    # a buffer whose own slices were asked for (1): a one-chunk call takes what its 2 chunks' words hold
    capped = _device_call_slices(programs, 1, world, 2, 1, cols, lag, hidden, tps, block_h=block_h)
    n_hb = -(-hidden // block_h)
    if n_hb >= 2 and 128 // world >= 2:
        per = -(-n_hb // 2)
        assert capped == (-(-n_hb // per), per * block_h, default_lag(programs, tps * -(-n_hb // per))), capped
    # the 4096-token buffer serving a 128-token call slices like a 128-token buffer
    if (max_tokens, hidden, block_h) == (4096, 7168, 1024):
        small = hidden_slices(128, world, block_rows, hidden, block_h)
        assert _device_call_slices(programs, 8, world, n_chunks, n_slices, cols, lag, hidden, tps,
                                   block_h=block_h)[:2] == small
