"""EP dispatch kernel: each token crosses the wire once per destination rank, the receiver
expands it into expert-major rows.

One persistent launch whose programs take tasks from an interleaved queue (task_queue.py):
  - send tasks (chunk c, destination d, column slice j): copy columns of the c-th chunk of the
    tokens going to d into d's staging area (slot = prefix count, never an atomic); slice 0 adds
    per-token metadata (source token, local expert and position of every k); then stamp the
    (source, chunk, slice) signal with the call number. Destinations rank, rank-1, rank-2, ...;
  - receive tasks (chunk c, source s, slice j), sources rank, rank+1, ..., trailing the sends
    by `lag` chunks: wait for the slice (and slice 0, which carries the metadata), then write
    every staged token's columns to its rows expert_off[e] + src_off[s, e] + pos.
    A rank's own tokens (pointer transport) stage only their metadata: their receive reads the
    columns straight from x, one local copy of 1/W of the bytes less.
Sending and expanding thereby overlap. Column slices exist for small T, where the chunks alone
would leave most programs idle. Rows of local expert e are ordered by (source rank, source
token): a pure function of the routing. The same kernel replays a dispatch for combine's
backward (SCALE_ROWS: each row times its routing weight, in fp32, cast once).
TOKEN_MAJOR (`EPBuffer.dispatch(layout="token_major")`): the receiver writes each staged token once,
to row (tokens from earlier sources) + slot, and the expert-major position of each of its pairs
gets that row's index (`row_index`): 1/K of the expert-major layout's writes when a token's K
experts share a rank, and what a grouped GEMM's gathered-A load reads without a permutation copy.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.nvshmem import put_row_block, putmem_nbi_block, quiet, signal_after_puts
from ditron_ep.language.primitives import (call_begin, call_end, ctrl_ptr, dispatch_stopped, heap_ptr, next_task,
                                          notify, wait)
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.language.task_queue import call_chunks, call_slices, chunk_signal, interleaved_task
from ditron_ep.runtime.heap import register_stage

STAGE_DISPATCH_RECV = tl.constexpr(register_stage(3, "ep dispatch: receive chunk"))


@register_device_function
@triton.jit
def stage_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, i_d, dst, row_block, o_j, m_j,
                      stage_offset, meta_offset, wstage_offset, h_lo, h_hi, write_meta, H, E_local, MAXT,
                      s_ptr, sstage_offset, n_scales,
                      K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr,
                      HAS_SCALES: tl.constexpr = False, BLOCK_SC: tl.constexpr = 64, COL_PAIRS: tl.constexpr = False):
    """Copy columns [h_lo, h_hi) of staging slots o_j (mask m_j) of the tokens going to rank i_d
    into rank dst's arena at rows (row_block, slot) of the staging area; with write_meta also the
    per-token metadata [token, local expert of every k (-1: not on i_d), position of every k] and,
    with HAS_WEIGHTS, the routing weights, with HAS_SCALES the token's n_scales fp32 scales (FP8
    dispatch). Pointer transport: dst = i_d, row_block = this rank; put transport: dst = this
    rank, row_block = i_d (its send areas, put from there)."""
    i_t = tl.load(send_idx_ptr + i_d * MAXT + o_j, mask=m_j, other=0).to(tl.int64)  # [BLOCK_S]
    r_dst = (row_block * MAXT + o_j).to(tl.int64)
    copy_cols(x_ptr + i_t * H, heap_ptr(table_ptr, dst, stage_offset, x_ptr.dtype.element_ty) + r_dst * H, m_j,
              h_lo, h_hi, BLOCK_H, COL_PAIRS)
    if write_meta:
        write_token_meta(heap_ptr(table_ptr, dst, meta_offset, tl.int32) + r_dst * (1 + 2 * K),
                         heap_ptr(table_ptr, dst, wstage_offset, tl.float32) + r_dst * K,
                         i_t, m_j, i_d, topk_ptr, pos_ptr, w_ptr, E_local, K, HAS_WEIGHTS)
        if HAS_SCALES:
            p_sst = heap_ptr(table_ptr, dst, sstage_offset, tl.float32)
            for c0 in range(0, n_scales, BLOCK_SC):
                o_c = c0 + tl.arange(0, BLOCK_SC)
                m_c = m_j[:, None] & (o_c < n_scales)[None, :]
                b_sc = tl.load(s_ptr + i_t[:, None] * n_scales + o_c[None, :], mask=m_c)
                tl.store(p_sst + (r_dst * n_scales)[:, None] + o_c[None, :], b_sc, mask=m_c)


@register_device_function
@triton.jit
def load_cols(p_rows, m_rows, h0, h_hi, BLOCK_H: tl.constexpr):
    """Columns [h0, h0 + BLOCK_H) (below h_hi) of the rows starting at p_rows [BLOCK_S] (mask
    m_rows): (tile, columns, mask).

    The copy loops step by COL_PAIRS tiles: with COL_PAIRS both tiles' loads are issued before
    either store, twice the bytes in flight of one tile per step: +24-35 % copy rate on an H200
    at 132 and at 24 programs (bench/results/copy_probe_H200x2_20261128_s31.log). Launchers set it
    when a column slice spans more than one tile."""
    o_h = h0 + tl.arange(0, BLOCK_H)
    m = m_rows[:, None] & (o_h < h_hi)[None, :]
    return tl.load(p_rows[:, None] + o_h[None, :], mask=m), o_h, m


@register_device_function
@triton.jit
def own_by_pointer(put_peers, rank, PUTS: tl.constexpr):
    """Whether this rank reaches itself by pointer stores: then its own tokens and rows skip the
    staging and landing areas (read from x or y where they are). Transport "put" puts to every
    peer, itself included."""
    if PUTS:
        return ((put_peers >> rank) & 1) == 0
    else:
        return True


@register_device_function
@triton.jit
def copy_cols(p_from, p_to, m_rows, h_lo, h_hi, BLOCK_H: tl.constexpr, COL_PAIRS: tl.constexpr):
    """Columns [h_lo, h_hi) of the rows starting at p_from [BLOCK_S] to the rows starting at p_to
    (mask m_rows), BLOCK_H columns a tile, COL_PAIRS tiles a step (load_cols)."""
    for h0 in range(h_lo, h_hi, BLOCK_H * (1 + COL_PAIRS)):
        a, o_a, m_a = load_cols(p_from, m_rows, h0, h_hi, BLOCK_H)
        if COL_PAIRS:
            b, o_b, m_b = load_cols(p_from, m_rows, h0 + BLOCK_H, h_hi, BLOCK_H)
        tl.store(p_to[:, None] + o_a[None, :], a, mask=m_a)
        if COL_PAIRS:
            tl.store(p_to[:, None] + o_b[None, :], b, mask=m_b)


@register_device_function
@triton.jit
def write_token_meta(p_meta, p_wst, i_t, m_j, i_d, topk_ptr, pos_ptr, w_ptr, E_local, K: tl.constexpr,
                     HAS_WEIGHTS: tl.constexpr):
    """The metadata rows of tokens i_t (mask m_j) going to rank i_d: at p_meta (one pointer per row)
    [token, local expert of every k (-1: not on i_d), position of every k]; with HAS_WEIGHTS the
    routing weights at p_wst (one pointer per row)."""
    tl.store(p_meta, i_t.to(tl.int32), mask=m_j)
    for k in tl.static_range(K):
        e = tl.load(topk_ptr + i_t * K + k, mask=m_j, other=-1)
        mine = (e >= 0) & (e // E_local == i_d)
        tl.store(p_meta + 1 + k, tl.where(mine, e - i_d * E_local, -1), mask=m_j)
        tl.store(p_meta + 1 + K + k, tl.load(pos_ptr + i_t * K + k, mask=m_j, other=0), mask=m_j)
        if HAS_WEIGHTS:
            tl.store(p_wst + k, tl.load(w_ptr + i_t * K + k, mask=m_j, other=0.0), mask=m_j)


@register_device_function
@triton.jit
def put_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, sig_table_ptr, i_d, rank, i_c, n,
                    stage_offset, meta_offset, wstage_offset, send_x_offset, send_meta_offset, send_w_offset,
                    h_lo, h_hi, write_meta, H, E_local, MAXT, sig_word, call_no,
                    K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    """The put transport's `stage_token_chunk` + notify: the chunk's columns [h_lo, h_hi) (and slice
    0's metadata and weights) staged with the pointer path's tile copies into this rank's send
    areas at rows (i_d, slot) — symmetric memory, what NVSHMEM's remote transports need as a put's
    source — then put to i_d's staging rows (rank, slot): the chunk as one block when the slice is
    whole rows, else one put per row; a fence, then the slice's signal, so it lands after every
    byte. The same bytes land as with pointer stores."""
    META: tl.constexpr = 1 + 2 * K
    ELT: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    first = i_c * BLOCK_S
    o_j = first + tl.arange(0, BLOCK_S)
    stage_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, i_d, rank, i_d, o_j, o_j < n,
                      send_x_offset, send_meta_offset, send_w_offset, h_lo, h_hi, write_meta, H, E_local, MAXT,
                      x_ptr, 0, 0, K, HAS_WEIGHTS, BLOCK_H)
    tl.debug_barrier()  # the block-scoped puts below read what every thread just stored
    own = tl.load(table_ptr + rank)  # symmetric addresses: this rank's base + offset
    n_rows = tl.cast(tl.minimum(BLOCK_S, n - first), tl.int64)
    row0 = tl.cast(rank, tl.int64) * MAXT + first   # the chunk's first staging row on i_d
    loc0 = tl.cast(i_d, tl.int64) * MAXT + first    # ... and in this rank's send areas
    put_row_block(own + stage_offset + row0 * H * ELT, own + send_x_offset + loc0 * H * ELT, n_rows, h_lo, h_hi, H,
                  ELT, i_d)
    if write_meta:
        putmem_nbi_block(own + meta_offset + row0 * META * 4, own + send_meta_offset + loc0 * META * 4,
                         n_rows * META * 4, i_d)
        if HAS_WEIGHTS:
            putmem_nbi_block(own + wstage_offset + row0 * K * 4, own + send_w_offset + loc0 * K * 4,
                             n_rows * K * 4, i_d)
    signal_after_puts(sig_table_ptr, rank, i_d, sig_word, call_no)


@register_device_function
@triton.jit
def token_major_row(tokens_from_ptr, i_s, o_j, BLOCK_W: tl.constexpr):
    """The token-major row of staging slots o_j of source i_s: rows in (source rank, token) order,
    so after the tokens of the sources before i_s (the dispatch writes there, the backward of a
    token-major dispatch reads there)."""
    o_w = tl.arange(0, BLOCK_W)
    before = tl.load(tokens_from_ptr + o_w, mask=o_w < i_s, other=0)
    return (tl.sum(before, axis=0) + o_j).to(tl.int64)


@register_device_function
@triton.jit
def _copy_scales(p_sst, r_src, recv_s_ptr, dst_row, m, n_scales, BLOCK_SC: tl.constexpr):
    """recv_s[dst_row] = the staged scales of tokens r_src (mask m), n_scales fp32 each."""
    for c0 in range(0, n_scales, BLOCK_SC):
        o_c = c0 + tl.arange(0, BLOCK_SC)
        m_c = m[:, None] & (o_c < n_scales)[None, :]
        b_sc = tl.load(p_sst + r_src[:, None] * n_scales + o_c[None, :], mask=m_c)
        tl.store(recv_s_ptr + dst_row[:, None] * n_scales + o_c[None, :], b_sc, mask=m_c)


@register_device_function
@triton.jit
def place_received(b_x, o_h, m, recv_x_ptr, tok_row, recv_rows_ptr, r_src, m_j, p_wst, p_sst, n_scales, H,
                   K: tl.constexpr, SCALE_ROWS: tl.constexpr, TOKEN_MAJOR: tl.constexpr, DEQUANT: tl.constexpr):
    """Store the received columns o_h (mask m) of staged tokens r_src: token-major once to rows
    tok_row, else once per (token, k) routed here to recv_rows[r_src, k] (SCALE_ROWS: times the
    staged weight at p_wst, fp32, cast once); DEQUANT: FP8 x times its 128-column block's scale
    (staged at p_sst), fp32, cast once."""
    if DEQUANT:
        b_sc = tl.load(p_sst + r_src[:, None] * n_scales + (o_h // 128)[None, :], mask=m, other=0.0)
        b_x = (b_x.to(tl.float32) * b_sc).to(recv_x_ptr.dtype.element_ty)
    if TOKEN_MAJOR:  # once per (source, token)
        tl.store(recv_x_ptr + tok_row[:, None] * H + o_h[None, :], b_x, mask=m)
    else:  # once per (source, token, k) routed here
        for k in tl.static_range(K):
            r_dst = tl.load(recv_rows_ptr + r_src * K + k, mask=m_j, other=-1).to(tl.int64)
            m_k = m & (r_dst >= 0)[:, None]
            if SCALE_ROWS:
                b_s = tl.load(p_wst + r_src * K + k, mask=m_j & (r_dst >= 0), other=0.0)
                b_y = (b_x.to(tl.float32) * b_s[:, None]).to(recv_x_ptr.dtype.element_ty)
                tl.store(recv_x_ptr + r_dst[:, None] * H + o_h[None, :], b_y, mask=m_k)
            else:
                tl.store(recv_x_ptr + r_dst[:, None] * H + o_h[None, :], b_x, mask=m_k)


# rank, put_peers: per-rank values, one binary (fused_kernels.py); rows_cap: a default-mode call's
# exact row count and the capacity a captured whole call passes (EPBuffer._whole_call) share one
# binary, so a capture never compiles
@triton.jit(do_not_specialize=["rank", "put_peers", "rows_cap"])
def ep_dispatch_kernel(
    x_ptr,            # (T, H) tokens of this rank
    w_ptr,            # fp32 (T, K) routing weights (read when HAS_WEIGHTS)
    topk_ptr,         # int32 (T, K) expert ids, -1 = dropped
    pos_ptr,          # int32 (T, K) position of the pair among this rank's pairs of its expert
    send_idx_ptr,     # int32 (W, MAXT) token index of the j-th token sent to rank d
    tokens_to_ptr,    # int32 (W,)
    expert_off_ptr,   # int32 (E_local + 1,)
    src_off_ptr,      # int32 (W, E_local)
    tokens_from_ptr,  # int32 (W,)
    src_info_ptr,     # int32 (W, 2): every rank's (FLAG_* bits, T) from the layout exchange
    recv_x_ptr,       # out (rows_cap, H) expert-major rows
    recv_w_ptr,       # out fp32 (rows_cap,) weight of each row (written when HAS_WEIGHTS)
    recv_rows_ptr,    # out int32 (W, MAXT, K) row of (source, slot, k), -1 if none
    recv_tok_ptr,     # out int32 (W, MAXT) source token index of each staged token
    row_index_ptr,    # out int32 (rows_cap,) TOKEN_MAJOR: the recv_x row of each expert-major row
    s_ptr,            # fp32 (T, n_scales) per-token, per-128-column scales of FP8 tokens (HAS_SCALES)
    recv_s_ptr,       # out fp32 (rows, n_scales): the received rows' scales (HAS_SCALES, not DEQUANT)
    table_ptr,        # int64 (W,) arena bases
    sig_table_ptr,    # int64 (W,) signal bases
    stage_offset,     # bytes: symmetric (W, MAXT, H) staged tokens, x dtype
    meta_offset,      # bytes: symmetric int32 (W, MAXT, 1 + 2K): [token, e_local[K], pos[K]]
    wstage_offset,    # bytes: symmetric fp32 (W, MAXT, K) staged weights
    sstage_offset,    # bytes: symmetric fp32 (W, MAXT, n_scales) staged scales (HAS_SCALES)
    sig_first,        # W * n_chunks * n_slices signals: (source, chunk, column slice)
    H, rank, world, E_local, MAXT, n_chunks, rows_cap, budget,
    n_slices,         # the buffer's column slices per chunk (task_queue.hidden_slices; a smaller call
    slice_cols,       # may use more, task_queue.call_slices) and columns per slice, a multiple of BLOCK_H
    lag,              # chunks a receive trails its send by in the queue (task_queue.default_lag)
    n_scales,         # scales per token (H / 128) when HAS_SCALES
    put_peers,        # bit d set: reach rank d by NVSHMEM put-with-signal (runtime/transport.py; PUTS only)
    send_x_offset,    # bytes: symmetric (W, MAXT, H) this rank's send area of tokens, x dtype (PUTS)
    send_meta_offset,  # bytes: symmetric int32 (W, MAXT, 1 + 2K) ... of metadata (PUTS)
    send_w_offset,    # bytes: symmetric fp32 (W, MAXT, K) ... of weights (PUTS)
    K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, SCALE_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    ENTRY_BARRIER: tl.constexpr = True,  # False only right after this call's layout exchange (call_begin)
    TOKEN_MAJOR: tl.constexpr = False,   # recv_x: one row per (source rank, token); row_index maps the pairs
    HAS_SCALES: tl.constexpr = False,    # FP8 tokens with scales: the scales travel with the metadata
    DEQUANT: tl.constexpr = False,       # ... and the receiver writes x * scale (fp32, cast once) to recv_x
    BLOCK_SC: tl.constexpr = 64,
    PUTS: tl.constexpr = False,          # the put transport is compiled in (every signal then a uint64)
    COL_PAIRS: tl.constexpr = False,     # copy loops step two column tiles at a time (load_cols)
):
    SIG_STRIDE: tl.constexpr = 2 if PUTS else 1
    tl.static_assert(not (PUTS and HAS_SCALES), "FP8 dispatch (HAS_SCALES) has no put path")
    skip = 0
    if ENTRY_BARRIER:  # a replay along a graph-mode handle of a dispatch that did not go is no call
        skip = dispatch_stopped(src_info_ptr, world, BLOCK_W)
    call_no, ok = call_begin(table_ptr, rank, world, budget, OPENS=ENTRY_BARRIER, skip=skip)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    META: tl.constexpr = 1 + 2 * K
    n_call = call_chunks(src_info_ptr, world, n_chunks, BLOCK_S, BLOCK_W)
    n_sl, cols, lag_c = call_slices(n_call, world, n_chunks, n_slices, slice_cols, lag, H, 2 * world, BLOCK_H)
    A = world * n_sl  # tasks per chunk and side: (ring position, column slice)
    o_s = tl.arange(0, BLOCK_S)
    t = next_task(my_ctrl)
    while t < 2 * n_call * A:
        if ok:
            is_send, idx = interleaved_task(t, n_call, A, n_call, A, lag_c)
            i_c = idx // A
            i_pos = (idx % A) // n_sl
            i_j = idx % n_sl
            h_lo = i_j * cols
            h_hi = tl.minimum(h_lo + cols, H)
            o_j = i_c * BLOCK_S + o_s
            if is_send:
                # ---- send: columns [h_lo, h_hi) of chunk c of the tokens going to rank d
                # (slice 0 also carries the metadata); destinations rank, rank-1, ...
                i_d = (rank - i_pos + world) % world
                n = tl.load(tokens_to_ptr + i_d)
                if i_c * BLOCK_S < n:
                    sig_word = sig_first + chunk_signal(0, rank, n_chunks, n_slices, i_c, n_sl, i_j) * SIG_STRIDE
                    by_put = False
                    if PUTS:
                        by_put = ((put_peers >> i_d) & 1) != 0
                    if by_put:
                        put_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, sig_table_ptr, i_d,
                                        rank, i_c, n, stage_offset, meta_offset, wstage_offset, send_x_offset,
                                        send_meta_offset, send_w_offset, h_lo, h_hi, i_j == 0, H, E_local, MAXT,
                                        sig_word, call_no, K, HAS_WEIGHTS, BLOCK_S, BLOCK_H)
                    else:
                        # to itself only the metadata: its receive reads the columns from x (self_copy)
                        h_end = tl.where(i_d == rank, h_lo, h_hi)
                        stage_token_chunk(x_ptr, w_ptr, topk_ptr, pos_ptr, send_idx_ptr, table_ptr, i_d, i_d, rank, o_j,
                                          o_j < n, stage_offset, meta_offset, wstage_offset, h_lo, h_end, i_j == 0,
                                          H, E_local, MAXT, s_ptr, sstage_offset, n_scales, K, HAS_WEIGHTS, BLOCK_H,
                                          HAS_SCALES, BLOCK_SC, COL_PAIRS)
                        notify(heap_ptr(sig_table_ptr, i_d, 0, tl.int32) + sig_word, call_no)
            else:
                # ---- receive: the slice's columns of chunk c from source s, expanded into
                # expert-major rows; sources rank, rank+1, ...
                i_s = (rank + i_pos) % world
                n = tl.load(tokens_from_ptr + i_s)
                if i_c * BLOCK_S < n:
                    i_sig = sig_first + chunk_signal(0, i_s, n_chunks, n_slices, i_c, n_sl, 0) * SIG_STRIDE
                    arrived = wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_DISPATCH_RECV, i_sig, budget)
                    if i_j > 0:  # the metadata travels with slice 0
                        i_sig_j = i_sig + i_j * SIG_STRIDE
                        arrived = arrived & wait(p_sig + i_sig_j, call_no, my_ctrl, rank, STAGE_DISPATCH_RECV,
                                                 i_sig_j, budget)
                    if arrived:
                        m_j = o_j < n
                        self_copy = (i_s == rank) & own_by_pointer(put_peers, rank, PUTS)  # else a put staged them
                        r_src = (i_s * MAXT + o_j).to(tl.int64)
                        p_meta = heap_ptr(table_ptr, rank, meta_offset, tl.int32) + r_src * META
                        tok_row = r_src  # (read only in the token-major layout)
                        if TOKEN_MAJOR:
                            tok_row = token_major_row(tokens_from_ptr, i_s, o_j, BLOCK_W)  # [BLOCK_S]
                        if i_j == 0:
                            tl.store(recv_tok_ptr + r_src, tl.load(p_meta, mask=m_j, other=0), mask=m_j)
                        p_sst = heap_ptr(table_ptr, rank, sstage_offset, tl.float32)
                        for k in tl.static_range(K):
                            el = tl.load(p_meta + 1 + k, mask=m_j, other=-1)
                            pos = tl.load(p_meta + 1 + K + k, mask=m_j, other=0)
                            valid = m_j & (el >= 0)
                            base = tl.load(expert_off_ptr + el, mask=valid, other=0) + \
                                tl.load(src_off_ptr + i_s * E_local + el, mask=valid, other=0)
                            row = tl.where(valid & (base + pos < rows_cap), base + pos, -1)
                            # every slice stores the same rows (it reads them back below)
                            tl.store(recv_rows_ptr + r_src * K + k, row, mask=m_j)
                            if TOKEN_MAJOR:
                                if i_j == 0:
                                    tl.store(row_index_ptr + row, tok_row.to(tl.int32), mask=m_j & (row >= 0))
                            elif HAS_SCALES and not DEQUANT:
                                if i_j == 0:  # each row carries its token's scales
                                    _copy_scales(p_sst, r_src, recv_s_ptr, row.to(tl.int64), m_j & (row >= 0),
                                                 n_scales, BLOCK_SC)
                            if HAS_WEIGHTS:
                                if i_j == 0:
                                    b_w = tl.load(heap_ptr(table_ptr, rank, wstage_offset, tl.float32) + r_src * K + k,
                                                  mask=row >= 0, other=0.0)
                                    tl.store(recv_w_ptr + row, b_w, mask=row >= 0)
                        if TOKEN_MAJOR and HAS_SCALES and not DEQUANT:
                            if i_j == 0:  # each token row carries its scales
                                _copy_scales(p_sst, r_src, recv_s_ptr, tok_row, m_j, n_scales, BLOCK_SC)
                        # recv_rows was just written lane by lane; other warps read it below.
                        tl.debug_barrier()
                        # the columns: from the staging area, or this rank's own tokens straight from x
                        # (their send staged only the metadata: one local copy less, same bytes)
                        p_src = heap_ptr(table_ptr, rank, stage_offset, x_ptr.dtype.element_ty) + r_src * H
                        if self_copy:
                            p_src = x_ptr + tl.load(p_meta, mask=m_j, other=0).to(tl.int64) * H
                        p_wst = heap_ptr(table_ptr, rank, wstage_offset, tl.float32)
                        for h0 in range(h_lo, h_hi, BLOCK_H * (1 + COL_PAIRS)):
                            a, o_a, m_a = load_cols(p_src, m_j, h0, h_hi, BLOCK_H)
                            if COL_PAIRS:
                                b, o_b, m_b = load_cols(p_src, m_j, h0 + BLOCK_H, h_hi, BLOCK_H)
                            place_received(a, o_a, m_a, recv_x_ptr, tok_row, recv_rows_ptr, r_src, m_j, p_wst, p_sst,
                                           n_scales, H, K, SCALE_ROWS, TOKEN_MAJOR, DEQUANT)
                            if COL_PAIRS:
                                place_received(b, o_b, m_b, recv_x_ptr, tok_row, recv_rows_ptr, r_src, m_j, p_wst,
                                               p_sst, n_scales, H, K, SCALE_ROWS, TOKEN_MAJOR, DEQUANT)
        t = next_task(my_ctrl)
    if PUTS:
        quiet()  # this program's puts delivered (and their sources free) before the call ends
    call_end(table_ptr, rank, call_no, OPENS=ENTRY_BARRIER, skip=skip)


_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp32", "topk_ptr": "*i32", "pos_ptr": "*i32", "send_idx_ptr": "*i32",
        "tokens_to_ptr": "*i32", "expert_off_ptr": "*i32", "src_off_ptr": "*i32", "tokens_from_ptr": "*i32",
        "src_info_ptr": "*i32", "recv_x_ptr": "*bf16", "recv_w_ptr": "*fp32", "recv_rows_ptr": "*i32", "recv_tok_ptr": "*i32",
        "row_index_ptr": "*i32", "s_ptr": "*fp32", "recv_s_ptr": "*fp32", "table_ptr": "*i64", "sig_table_ptr": "*i64", "stage_offset": "i64", "meta_offset": "i64",
        "wstage_offset": "i64", "sstage_offset": "i64", "sig_first": "i32", "H": "i32", "rank": "i32", "world": "i32",
        "E_local": "i32", "MAXT": "i32", "n_chunks": "i32", "rows_cap": "i32", "budget": "i32",
        "n_slices": "i32", "slice_cols": "i32", "lag": "i32", "n_scales": "i32", "put_peers": "i32",
        "send_x_offset": "i64", "send_meta_offset": "i64", "send_w_offset": "i64"}
_MULT16 = ("H", "stage_offset", "meta_offset", "wstage_offset", "sstage_offset", "slice_cols")  # real sizes; heap offsets
# half-precision rows as EPBuffer launches them on CUDA: 1,024-column steps, 16 warps
_CUDA_HALF = {"K": 8, "HAS_WEIGHTS": True, "SCALE_ROWS": False, "BLOCK_S": 16, "BLOCK_H": 1024, "BLOCK_W": 8,
              "ENTRY_BARRIER": False, "COL_PAIRS": True}
_WARPS = {"num_warps": 16}  # EPBuffer's default on NVIDIA
# the forward dispatch (right after its layout: no entry barrier) ...
register_kernel(ep_dispatch_kernel, _SIG, _CUDA_HALF, label="bf16-K8", multiples_of_16=_MULT16, options=_WARPS)
# ... and combine's backward (scaled rows, along an old handle: with the barrier), fp32 also with
# the arguments equal to 1 that Triton specialises into plain ints (one chunk, one slice, lag 1; rank
# is never specialised)
_ONES = ("n_chunks", "n_slices", "lag")
register_kernel(ep_dispatch_kernel, {**{n: v for n, v in _SIG.items() if n not in _ONES},
                                     "x_ptr": "*fp32", "recv_x_ptr": "*fp32"},
                {**{n: 1 for n in _ONES}, "K": 2, "HAS_WEIGHTS": True, "SCALE_ROWS": True, "BLOCK_S": 16,
                 "BLOCK_H": 128, "BLOCK_W": 2, "ENTRY_BARRIER": True}, label="fp32-K2-scaled", multiples_of_16=_MULT16)
# the token-major layout
register_kernel(ep_dispatch_kernel, _SIG, {**_CUDA_HALF, "TOKEN_MAJOR": True}, label="bf16-K8-token-major",
                multiples_of_16=_MULT16, options=_WARPS)
# FP8 dispatch: e4m3 rows with their scales, and dequantised on receipt to bf16 (token-major)
register_kernel(ep_dispatch_kernel, {**_SIG, "x_ptr": "*fp8e4nv", "recv_x_ptr": "*fp8e4nv"},
                {**_CUDA_HALF, "HAS_SCALES": True}, label="fp8-K8-scales", multiples_of_16=_MULT16,
                targets=("cuda:90",), options=_WARPS)
register_kernel(ep_dispatch_kernel, {**_SIG, "x_ptr": "*fp8e4nv"},
                {**_CUDA_HALF, "TOKEN_MAJOR": True, "HAS_SCALES": True, "DEQUANT": True},
                label="fp8-K8-dequant-token-major", multiples_of_16=_MULT16, targets=("cuda:90",),
                options=_WARPS)
