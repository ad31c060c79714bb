"""EP combine kernel: expert outputs go back to the token's rank and are summed in k order.

One persistent launch whose programs take tasks from an interleaved queue (task_queue.py):
  - send-back tasks (chunk c, source s, column slice j), sources rank, rank-1, ...: the slice's
    columns of every expanded row of the chunk's tokens are written to s's landing buffer at
    [token, k] (its exact place, so no ordering question arises), then the (expert rank, chunk,
    slice) signal is stamped with the call number. A rank's own rows (pointer transport) do not
    land: its reduce reads them from y, one local copy of 1/W of the rows less;
  - reduce tasks (block b of this rank's tokens, slice j), trailing the send-backs by `lag`
    chunks: wait for exactly the chunks holding the block's tokens, then
    out[t] = sum over k = 0..K-1 of w[t, k] * y(t, k) for the slice's columns, fp32, cast once.
A token's staging slot on any rank is at most its index, so block b (BLOCK_T == BLOCK_S) needs
chunks 0..b only: the queue's producer-before-consumer rule holds.

RANK_REDUCED (the rank-reduced combine, `EPBuffer.combine(topk_sum="expert_rank")`): a send-back
first adds the token's rows on this rank, k = 0..K-1 in order, each times its row weight, in fp32,
and writes the one sum (in the partial dtype: y's, or fp32 with PARTIAL_FP32) to s's landing
buffer at [this rank, the token's staging slot] (a chunk's partials are contiguous rows); a reduce
adds a token's rank partials in rank order in fp32 and casts once. 1/K of the exact mode's bytes cross the wire for a token with K experts on one rank.
TOKEN_ROWS (with RANK_REDUCED): y is a token-major dispatch's row gradient, one row per (source,
token), which is the partial itself: the backward of `dispatch(layout="token_major")`.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.nvshmem import put_row_block, putmem_nbi_block, quiet, signal_after_puts
from ditron_ep.language.primitives import (call_begin, call_end, ctrl_ptr, dispatch_stopped, heap_ptr, next_task,
                                          notify, wait)
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.ops.ep.dispatch_kernels import copy_cols, own_by_pointer, token_major_row
from ditron_ep.language.task_queue import call_chunks, call_slices, chunk_signal, interleaved_task
from ditron_ep.runtime.heap import register_stage

STAGE_COMBINE_REDUCE = tl.constexpr(register_stage(4, "ep combine: wait for expert outputs"))

# fp32 elements of the weighted rank-reduced send's accumulator a program holds at once (BLOCK_S x
# columns). The copy steps are wide (EPBuffer: 1,024 bf16 columns, for bytes in flight), but that
# send's weighted fp32 sum of 16 x 1,024 spilled 2,456 bytes of stack a thread on sm_90 (bf16
# partials) and took 2,531 µs at T=4096 (H100 pair, graph mode) against 564 µs when it steps through
# the columns 512 at a time (24 bytes; bench/results/ab_ep_H100x2_20261127_s25_efba2fb.log). The
# exact reduce spills 272 bytes at 1,024 columns, yet ran 2.5 % faster than at 512 (its index loads
# are per column step), and the unweighted sends do not spill: they keep the copy step. Each
# element's sum is the same either way, so the bits are too.
SUM_ELEMENTS = 8192


def combine_sum_columns(block_hidden: int, block_rows: int, weighted_partials: bool) -> int:
    """Columns per step of the combine's fp32 sums (its BLOCK_HA) for a copy step of block_hidden;
    weighted_partials: a rank-reduced combine whose sends weigh the rows."""
    if not weighted_partials:
        return block_hidden
    # never wider than the copy step (a buffer of hidden <= 8 has block_hidden < 16)
    return min(block_hidden, max(16, SUM_ELEMENTS // block_rows))


@register_device_function
@triton.jit
def reduce_landed(p_land, topk_ptr, w_ptr, out_ptr, o_t, m_t, h_lo, h_hi, H, K: tl.constexpr,
                  HAS_WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  y_ptr=None, recv_rows_ptr=None, r_own=None):
    """out[t] = sum over k = 0..K-1 of w[t, k] * land[t, k] (routed k only), fp32, k in order, one
    cast: the combine contract, for columns [h_lo, h_hi). land is (T, K, H); o_t / m_t are the
    block's tokens and mask. With y_ptr: the (t, k) of this rank's own experts did not land, they
    are read from y at recv_rows[r_own[t], k] (r_own: the token's (this rank, slot) row of
    recv_rows, -1 when none) — the same values."""
    o_t64 = o_t.to(tl.int64)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        m = m_t[:, None] & (o_h < h_hi)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for k in tl.static_range(K):
            valid = tl.load(topk_ptr + o_t64 * K + k, mask=m_t, other=-1) >= 0
            p_y = p_land + (o_t64[:, None] * K + k) * H + o_h[None, :]
            if y_ptr is not None:
                row = tl.load(recv_rows_ptr + r_own * K + k, mask=m_t & (r_own >= 0), other=-1).to(tl.int64)
                p_y = tl.where((row >= 0)[:, None], y_ptr + row[:, None] * H + o_h[None, :], p_y)
            b_y = tl.load(p_y, mask=m & valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H]
            if HAS_WEIGHTS:
                b_w = tl.load(w_ptr + o_t64 * K + k, mask=m_t & valid, other=0.0)
                acc += b_w[:, None] * b_y
            else:
                acc += b_y
        tl.store(out_ptr + o_t64[:, None] * H + o_h[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


@register_device_function
@triton.jit
def reduce_rank_partials(p_part, slot_ptr, out_ptr, o_t, m_t, h_lo, h_hi, H, world, MAXT,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, y_ptr=None, own=-1, own_first=0):
    """out[t] = sum over ranks d = 0..W-1 that hold token t of part[d, slot of t on d], fp32, in rank
    order, one cast, for columns [h_lo, h_hi). part is (W, MAXT, H), indexed by the staging slot (a
    chunk's partials are contiguous rows: one put per chunk); o_t / m_t are the block's tokens and mask.
    With y_ptr (token rows, TOKEN_ROWS): rank own's partial did not land, it is y's row own_first +
    slot itself (the same value: a landed partial is that row, converted exactly)."""
    o_t64 = o_t.to(tl.int64)
    for h0 in range(h_lo, h_hi, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        m = m_t[:, None] & (o_h < h_hi)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for d in range(world):
            slot = tl.load(slot_ptr + o_t64 * world + d, mask=m_t, other=-1).to(tl.int64)
            m_d = m & (slot >= 0)[:, None]
            if y_ptr is not None:
                if d == own:
                    acc += tl.load(y_ptr + (own_first + slot)[:, None] * H + o_h[None, :], mask=m_d,
                                   other=0.0).to(tl.float32)
                else:
                    acc += tl.load(p_part + (d * MAXT + slot)[:, None] * H + o_h[None, :], mask=m_d,
                                   other=0.0).to(tl.float32)
            else:
                acc += tl.load(p_part + (d * MAXT + slot)[:, None] * H + o_h[None, :], mask=m_d,
                               other=0.0).to(tl.float32)
        tl.store(out_ptr + o_t64[:, None] * H + o_h[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


@register_device_function
@triton.jit
def send_rank_partial(y_ptr, row_w_ptr, recv_rows_ptr, p_part, r_src, o_j, tok_row, m_j, rank, h_lo, h_hi, H,
                      MAXT, K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, TOKEN_ROWS: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """part[rank, slot] = sum over k = 0..K-1 of row_w[row] * y[row] over the rows of the staged
    tokens r_src (their staging slots o_j, mask m_j) on this rank, fp32, k in order, cast once to part's dtype,
    for columns [h_lo, h_hi). TOKEN_ROWS: y holds one row per (source, token), tok_row: the row
    itself is the partial (a token-major dispatch's backward)."""
    for h0 in range(h_lo, h_hi, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        m = m_j[:, None] & (o_h < h_hi)[None, :]
        if TOKEN_ROWS:
            acc = tl.load(y_ptr + tok_row[:, None] * H + o_h[None, :], mask=m, other=0.0).to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
            for k in tl.static_range(K):
                row = tl.load(recv_rows_ptr + r_src * K + k, mask=m_j, other=-1).to(tl.int64)
                m_r = m_j & (row >= 0)
                b_y = tl.load(y_ptr + row[:, None] * H + o_h[None, :], mask=m & m_r[:, None],
                              other=0.0).to(tl.float32)
                if HAS_WEIGHTS:
                    acc += tl.load(row_w_ptr + row, mask=m_r, other=0.0)[:, None] * b_y
                else:
                    acc += b_y
        tl.store(p_part + (rank * MAXT + o_j.to(tl.int64))[:, None] * H + o_h[None, :], acc.to(p_part.dtype.element_ty),
                 mask=m)


@register_device_function
@triton.jit
def put_rows_back(y_ptr, recv_rows_ptr, recv_tok_ptr, p_send, table_ptr, i_s, rank, r0, n_rows, land_offset,
                  h_lo, h_hi, H, MAXT, K: tl.constexpr, RANK_REDUCED: tl.constexpr, PART_ELT: tl.constexpr):
    """The put transport's send-back of a chunk slice to rank i_s (r0: the chunk's first row (i_s,
    slot)): exact mode, one block-scoped NVSHMEM put per routed (token, k) row of y to land[token,
    k]; RANK_REDUCED, the chunk's partials from this rank's send area (rows (i_s, slot), written by
    send_rank_partial) to part[rank, slot] — contiguous rows: one put for the chunk when the slice
    is whole rows, else one per row. The same bytes land as with pointer stores."""
    Y_ELT: tl.constexpr = y_ptr.dtype.element_ty.primitive_bitwidth // 8
    own = tl.load(table_ptr + rank)  # symmetric addresses: this rank's base + offset
    slot0 = r0 - i_s * MAXT
    if RANK_REDUCED:
        put_row_block(own + land_offset + (rank * MAXT + slot0) * H * PART_ELT, tl.cast(p_send + r0 * H, tl.int64),
                      n_rows, h_lo, h_hi, H, PART_ELT, i_s)
    else:
        for j in range(0, n_rows):
            i_tok = tl.load(recv_tok_ptr + r0 + j).to(tl.int64)
            for k in tl.static_range(K):
                row = tl.load(recv_rows_ptr + (r0 + j) * K + k).to(tl.int64)
                if row >= 0:
                    putmem_nbi_block(own + land_offset + ((i_tok * K + k) * H + h_lo) * Y_ELT,
                                     tl.cast(y_ptr + row * H + h_lo, tl.int64),
                                     tl.cast(h_hi - h_lo, tl.int64) * Y_ELT, i_s)


@triton.jit(do_not_specialize=["T", "rank", "put_peers"])  # per-rank values: one binary (fused_kernels.py)
def ep_combine_kernel(
    y_ptr,            # (rows_cap, H) expert outputs in dispatch's row order
    recv_rows_ptr,    # int32 (W, MAXT, K) row of (source, slot, k), -1 if none
    recv_tok_ptr,     # int32 (W, MAXT) source token index of each staged token
    tokens_from_ptr,  # int32 (W,)
    src_info_ptr,     # int32 (W, 2): every rank's (FLAG_* bits, T) from the dispatch's layout exchange
    slot_ptr,         # int32 (T, W) staging slot of token t on rank d, -1 if t does not go there
    topk_ptr,         # int32 (T, K) expert ids, -1 = dropped
    w_ptr,            # fp32 (T, K) routing weights (read when HAS_WEIGHTS, exact mode)
    row_w_ptr,        # fp32 (rows_cap,) weight of each row (read when HAS_WEIGHTS and RANK_REDUCED)
    out_ptr,          # out (T, H)
    table_ptr,        # int64 (W,)
    sig_table_ptr,    # int64 (W,)
    land_offset,      # bytes: symmetric landing buffer: (MAXT, K, H) y dtype; RANK_REDUCED: (W, MAXT, H) partials at (source, slot)
    sig_first,        # W * n_chunks * n_slices signals: (expert rank, chunk, column slice)
    T, H, rank, world, MAXT, n_chunks, budget,
    n_slices,         # the buffer's column slices per chunk and per token block (task_queue.hidden_slices;
    slice_cols,       # a smaller call may use more, task_queue.call_slices), columns per slice
    lag,              # chunks a reduce trails the send-backs by in the queue
    mode_flags,       # the call record's mode bits (MODE_FLAGS): every rank must pass the same
    put_peers,        # bit s set: send back to rank s by NVSHMEM puts (runtime/transport.py; PUTS only)
    send_land_offset,  # bytes: this rank's send area for RANK_REDUCED partials put to peers, (W, MAXT, H) (PUTS)
    K: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    RANK_REDUCED: tl.constexpr = False, PARTIAL_FP32: tl.constexpr = False,
    TOKEN_ROWS: tl.constexpr = False,  # with RANK_REDUCED: y is token-major (one row per (source, token))
    PUTS: tl.constexpr = False,        # the put transport is compiled in (every signal then a uint64)
    BLOCK_HA: tl.constexpr = 0,        # columns per step of the fp32 sums (0: BLOCK_H); combine_sum_columns
    LAND_OWN: tl.constexpr = False,    # exact mode: this rank's own rows land too (the weights' gradient reads them)
    COL_PAIRS: tl.constexpr = False,   # the send-back's copy steps two column tiles at a time (load_cols)
):
    tl.static_assert(BLOCK_T == BLOCK_S, "reduce block b must need chunks 0..b only")
    SUM_H: tl.constexpr = BLOCK_H if BLOCK_HA == 0 else BLOCK_HA
    tl.static_assert(BLOCK_H % SUM_H == 0, "the sums' column steps must tile a copy step")
    SIG_STRIDE: tl.constexpr = 2 if PUTS else 1
    PART_ELT: tl.constexpr = 4 if PARTIAL_FP32 else y_ptr.dtype.element_ty.primitive_bitwidth // 8
    skip = dispatch_stopped(src_info_ptr, world, BLOCK_W)  # a graph-mode handle of a dispatch that did not go
    call_no, ok = call_begin(table_ptr, rank, world, budget, flags=mode_flags, skip=skip)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    n_blocks = tl.cdiv(T, BLOCK_T)
    n_call = call_chunks(src_info_ptr, world, n_chunks, BLOCK_S, BLOCK_W)
    n_sl, cols, lag_c = call_slices(n_call, world, n_chunks, n_slices, slice_cols, lag, H, world + 1, BLOCK_H)
    A = world * n_sl   # send-back tasks per chunk: (ring position, column slice)
    o_s = tl.arange(0, BLOCK_S)
    t = next_task(my_ctrl)
    while t < n_call * A + n_blocks * n_sl:
        if ok:
            is_send, idx = interleaved_task(t, n_call, A, n_blocks, n_sl, lag_c)
            i_j = idx % n_sl
            h_lo = i_j * cols
            h_hi = tl.minimum(h_lo + cols, H)
            if is_send:
                # ---- send back: the slice's columns of the rows of chunk c of source s's tokens
                i_c = idx // A
                i_s = (rank - (idx % A) // n_sl + world) % world
                n = tl.load(tokens_from_ptr + i_s)
                if i_c * BLOCK_S < n:
                    o_j = i_c * BLOCK_S + o_s
                    m_j = o_j < n
                    r_src = (i_s * MAXT + o_j).to(tl.int64)
                    i_tok = tl.load(recv_tok_ptr + r_src, mask=m_j, other=0).to(tl.int64)  # [BLOCK_S]
                    sig_word = sig_first + chunk_signal(0, rank, n_chunks, n_slices, i_c, n_sl, i_j) * SIG_STRIDE
                    by_put = False
                    if PUTS:
                        by_put = ((put_peers >> i_s) & 1) != 0
                    if by_put:
                        if RANK_REDUCED:  # the partials into this rank's send area at rows (i_s, token) first
                            if PARTIAL_FP32:
                                p_send = heap_ptr(table_ptr, rank, send_land_offset, tl.float32)
                            else:
                                p_send = heap_ptr(table_ptr, rank, send_land_offset, y_ptr.dtype.element_ty)
                            send_rank_partial(y_ptr, row_w_ptr, recv_rows_ptr, p_send, r_src, o_j,
                                              token_major_row(tokens_from_ptr, i_s, o_j, BLOCK_W), m_j, i_s,
                                              h_lo, h_hi, H, MAXT, K, HAS_WEIGHTS, TOKEN_ROWS, BLOCK_S, SUM_H)
                            tl.debug_barrier()  # the block-scoped puts read what every thread stored
                        else:
                            p_send = y_ptr
                        put_rows_back(y_ptr, recv_rows_ptr, recv_tok_ptr, p_send, table_ptr, i_s, rank,
                                      i_s.to(tl.int64) * MAXT + i_c * BLOCK_S, tl.minimum(BLOCK_S, n - i_c * BLOCK_S),
                                      land_offset, h_lo, h_hi, H, MAXT, K, RANK_REDUCED, PART_ELT)
                        signal_after_puts(sig_table_ptr, rank, i_s, sig_word, call_no)
                    elif RANK_REDUCED and ((i_s != rank) or not TOKEN_ROWS):  # own token rows: read from y
                        if PARTIAL_FP32:
                            p_part = heap_ptr(table_ptr, i_s, land_offset, tl.float32)
                        else:
                            p_part = heap_ptr(table_ptr, i_s, land_offset, y_ptr.dtype.element_ty)
                        tok_row = token_major_row(tokens_from_ptr, i_s, o_j, BLOCK_W)
                        send_rank_partial(y_ptr, row_w_ptr, recv_rows_ptr, p_part, r_src, o_j, tok_row, m_j, rank,
                                          h_lo, h_hi, H, MAXT, K, HAS_WEIGHTS, TOKEN_ROWS, BLOCK_S, SUM_H)
                    elif not RANK_REDUCED and ((i_s != rank) or LAND_OWN):  # else the reduce reads them from y
                        p_land = heap_ptr(table_ptr, i_s, land_offset, y_ptr.dtype.element_ty)
                        for k in tl.static_range(K):
                            row = tl.load(recv_rows_ptr + r_src * K + k, mask=m_j, other=-1).to(tl.int64)
                            m_r = m_j & (row >= 0)
                            copy_cols(y_ptr + row * H, p_land + (i_tok * K + k) * H, m_r, h_lo, h_hi, BLOCK_H,
                                      COL_PAIRS)
                    if not by_put:
                        notify(heap_ptr(sig_table_ptr, i_s, 0, tl.int32) + sig_word, call_no)
            else:
                # ---- reduce the slice's columns of a block of this rank's tokens
                o_t = (idx // n_sl) * BLOCK_T + tl.arange(0, BLOCK_T)
                m_t = o_t < T
                n_bad = 0
                for d in range(world):
                    b_slot = tl.load(slot_ptr + o_t * world + d, mask=m_t, other=-1)  # [BLOCK_T]
                    top = tl.max(b_slot, axis=0)
                    lo = tl.min(tl.where(b_slot >= 0, b_slot, MAXT), axis=0) // BLOCK_S
                    # No token of the block goes to d: an empty range (no signed division of -1).
                    hi = tl.where(top >= 0, top // BLOCK_S, lo - 1)
                    for c in range(lo, hi + 1):
                        i_sig = sig_first + chunk_signal(0, d, n_chunks, n_slices, c, n_sl, i_j) * SIG_STRIDE
                        ok_c = wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_COMBINE_REDUCE, i_sig, budget)
                        n_bad += (ok_c == 0).to(tl.int32)
                if n_bad == 0:
                    if RANK_REDUCED:
                        if PARTIAL_FP32:
                            p_own = heap_ptr(table_ptr, rank, land_offset, tl.float32)
                        else:
                            p_own = heap_ptr(table_ptr, rank, land_offset, y_ptr.dtype.element_ty)
                        if TOKEN_ROWS:  # this rank's own token rows never landed (unless put to itself)
                            own = tl.where(own_by_pointer(put_peers, rank, PUTS), rank, -1)
                            reduce_rank_partials(p_own, slot_ptr, out_ptr, o_t, m_t, h_lo, h_hi, H, world, MAXT,
                                                 BLOCK_T, SUM_H, y_ptr=y_ptr, own=own,
                                                 own_first=token_major_row(tokens_from_ptr, rank, 0, BLOCK_W))
                        else:
                            reduce_rank_partials(p_own, slot_ptr, out_ptr, o_t, m_t, h_lo, h_hi, H, world, MAXT,
                                                 BLOCK_T, SUM_H)
                    else:
                        self_read = own_by_pointer(put_peers, rank, PUTS)  # else a put to itself landed them
                        if LAND_OWN:
                            self_read = False
                        slot_me = tl.load(slot_ptr + o_t * world + rank, mask=m_t & self_read, other=-1)
                        r_own = tl.where(slot_me >= 0, rank * MAXT + slot_me, -1).to(tl.int64)
                        reduce_landed(heap_ptr(table_ptr, rank, land_offset, y_ptr.dtype.element_ty), topk_ptr,
                                      w_ptr, out_ptr, o_t, m_t, h_lo, h_hi, H, K, HAS_WEIGHTS, BLOCK_T, SUM_H,
                                      y_ptr=y_ptr, recv_rows_ptr=recv_rows_ptr, r_own=r_own)
        t = next_task(my_ctrl)
    if PUTS:
        quiet()  # this program's puts delivered (and their sources free) before the call ends
    call_end(table_ptr, rank, call_no, OPENS=True, skip=skip)


_SIG = {"y_ptr": "*bf16", "recv_rows_ptr": "*i32", "recv_tok_ptr": "*i32", "tokens_from_ptr": "*i32",
        "src_info_ptr": "*i32", "slot_ptr": "*i32", "topk_ptr": "*i32", "w_ptr": "*fp32", "row_w_ptr": "*fp32", "out_ptr": "*bf16", "table_ptr": "*i64",
        "sig_table_ptr": "*i64", "land_offset": "i64", "sig_first": "i32", "T": "i32", "H": "i32",
        "rank": "i32", "world": "i32", "MAXT": "i32", "n_chunks": "i32", "budget": "i32",
        "n_slices": "i32", "slice_cols": "i32", "lag": "i32", "mode_flags": "i32", "put_peers": "i32",
        "send_land_offset": "i64"}
_MULT16 = ("H", "land_offset", "slice_cols")
# bf16 as EPBuffer launches it on CUDA: 1,024-column copy steps, 16 warps; the weighted rank-reduced
# sums 512 columns at a time (combine_sum_columns)
_CUDA_BF16 = {"BLOCK_S": 16, "BLOCK_T": 16, "BLOCK_H": 1024, "BLOCK_W": 8, "COL_PAIRS": True}
_CUDA_BF16_REDUCED = {**_CUDA_BF16, "RANK_REDUCED": True}
_WARPS = {"num_warps": 16}  # EPBuffer's default on NVIDIA
register_kernel(ep_combine_kernel, _SIG, {**_CUDA_BF16, "K": 8, "HAS_WEIGHTS": True}, label="bf16-K8",
                multiples_of_16=_MULT16, options=_WARPS)
# fp32 also with the arguments equal to 1 that Triton specialises into plain ints (one chunk, one
# slice, lag 1; rank is never specialised)
_ONES = ("n_chunks", "n_slices", "lag")
register_kernel(ep_combine_kernel, {**{n: v for n, v in _SIG.items() if n not in _ONES},
                                    "y_ptr": "*fp32", "out_ptr": "*fp32"},
                {**{n: 1 for n in _ONES}, "K": 3, "HAS_WEIGHTS": False, "BLOCK_S": 16, "BLOCK_T": 16,
                 "BLOCK_H": 128, "BLOCK_W": 2}, label="fp32-K3-unweighted", multiples_of_16=_MULT16)
# the rank-reduced combine: bf16 partials (weighted) and fp32 partials (unweighted)
register_kernel(ep_combine_kernel, _SIG, {**_CUDA_BF16_REDUCED, "K": 8, "HAS_WEIGHTS": True, "BLOCK_HA": 512},
                label="bf16-K8-rank-reduced", multiples_of_16=_MULT16, options=_WARPS)
register_kernel(ep_combine_kernel, _SIG, {**_CUDA_BF16_REDUCED, "K": 8, "HAS_WEIGHTS": False, "PARTIAL_FP32": True},
                label="bf16-K8-rank-reduced-fp32", multiples_of_16=_MULT16, options=_WARPS)
register_kernel(ep_combine_kernel, _SIG, {**_CUDA_BF16_REDUCED, "K": 8, "HAS_WEIGHTS": False, "TOKEN_ROWS": True},
                label="bf16-K8-token-rows", multiples_of_16=_MULT16, options=_WARPS)


@triton.jit
def topk_dots_kernel(g_ptr, y_ptr, topk_ptr, out_ptr, T, H, K: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """The combine's weight gradient: out[t, k] = <g[t], y[t, k]> in fp32 (0 where topk[t, k] < 0),
    g [T, H], y [T, K, H] (the landed expert outputs), read once in their dtype; each dot adds
    its columns in one fixed order (deterministic). A block of BLOCK_T tokens a program."""
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_k = tl.arange(0, BLOCK_K)
    m_tk = (o_t < T)[:, None] & (o_k < K)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        o_h = h0 + tl.arange(0, BLOCK_H)
        m_h = o_h < H
        g = tl.load(g_ptr + o_t[:, None].to(tl.int64) * H + o_h[None, :],
                    mask=(o_t < T)[:, None] & m_h[None, :], other=0.0).to(tl.float32)
        rows = (o_t[:, None].to(tl.int64) * K + o_k[None, :])[:, :, None] * H + o_h[None, None, :]
        y = tl.load(y_ptr + rows, mask=m_tk[:, :, None] & m_h[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(y * g[:, None, :], axis=2)
    valid = tl.load(topk_ptr + o_t[:, None] * K + o_k[None, :], mask=m_tk, other=-1) >= 0
    tl.store(out_ptr + o_t[:, None] * K + o_k[None, :], tl.where(valid, acc, 0.0), mask=m_tk)


register_kernel(topk_dots_kernel, {"g_ptr": "*bf16", "y_ptr": "*bf16", "topk_ptr": "*i32", "out_ptr": "*fp32",
                                   "T": "i32", "H": "i32"},
                {"K": 8, "BLOCK_K": 8, "BLOCK_T": 4, "BLOCK_H": 256}, label="bf16-K8", multiples_of_16=("H",))
