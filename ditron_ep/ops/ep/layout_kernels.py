"""Layout stage of EP dispatch: who sends what where, as a pure function of `topk_idx`.

Sender side (Triton kernels, no host sync: one launch for one block of tokens, else three):
per-expert counts, the position of every (token, k) pair among the pairs of its expert on this
rank (pairs counted in (t, k) order), which tokens go to which rank and in which staging slot. A Triton kernel then exchanges the
counts through the heap (no NCCL) and turns them into receive offsets by prefix sums:
rows of local expert e are ordered by (source rank, source token) — no atomic decides a slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

from ditron_ep.language.primitives import (FLAG_GAVE_UP, FLAG_MISSING, FLAG_UNREAD, call_end, ctrl_ptr, heap_ptr, meet_peer,
                                          note_stop, notify, unread_flag)
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.runtime import control as C
from ditron_ep.runtime.fast_launch import fast
from ditron_ep.runtime.heap import SymmetricHeap, register_stage

STAGE_LAYOUT = tl.constexpr(register_stage(2, "ep layout: counts exchange"))
# A call record's request fields: the arguments every rank must share (hidden size, top-k,
# dtype, experts, ...), as int32 words; unused words are 0. Named by the object that sends them.
RECORD_FIELDS = 8
# Words per source row of the layout landing buffer: [E_local counts | tokens sent here | flags |
# call number | T | request fields] (flags and call number: the record `meet_peer` reads).
LAYOUT_EXTRA = 4 + RECORD_FIELDS
# The landing buffer has two halves, used by calls of alternate parity (see `ep_layout_kernel`).
LAYOUT_HALVES = 2
# Bits of a rank's record flags (runtime/control.py: exchanged with the counts, so every rank
# sees every rank's).
FLAG_BAD_EXPERT = C.FLAG_BAD_EXPERT
FLAG_TOO_MANY_TOKENS = C.FLAG_TOO_MANY_TOKENS
FLAG_REFUSED = C.FLAG_REFUSED
FLAG_REBUILD = C.FLAG_REBUILD
_FLAG_BAD_EXPERT = tl.constexpr(FLAG_BAD_EXPERT)
_FLAG_TOO_MANY_TOKENS = tl.constexpr(FLAG_TOO_MANY_TOKENS)
_RECORD_FIELDS = tl.constexpr(RECORD_FIELDS)
CALL = tl.constexpr(C.CALL)


def layout_landing_shape(world_size: int, num_local_experts: int) -> tuple[int, int, int]:
    """Shape of the symmetric int32 landing buffer of the counts exchange."""
    return (LAYOUT_HALVES, world_size, num_local_experts + LAYOUT_EXTRA)


@dataclass
class SendLayout:
    """This rank's side of the routing, all on the device.

    topk_idx:  int32 [T, K]  expert id, -1 for dropped (also out-of-range ids: see `flags`)
    pos:       int32 [T, K]  index of the pair among this rank's pairs of the same expert
    slot:      int32 [T, W]  staging slot of token t on rank d (-1: t does not go to d)
    send_idx:  int32 [W, max_tokens] token index of the j-th token sent to rank d
    counts:    int32 [E]     pairs per expert
    tokens_to: int32 [W]     tokens sent to each rank (each token once per rank)
    flags:     int32 [1]     FLAG_* bits of this rank's input problems (offending slots dropped)
    """

    topk_idx: torch.Tensor
    pos: torch.Tensor
    slot: torch.Tensor
    send_idx: torch.Tensor
    counts: torch.Tensor
    tokens_to: torch.Tensor
    flags: torch.Tensor


# Tokens per program of the sender-side layout kernels. The place kernel compares every pair of
# its block with every other ([BT*K]^2 booleans: 16K for K=8), so blocks stay small.
SEND_LAYOUT_BLOCK_T = 16
# Up to this many blocks one program walks them in turn instead of three launches. On 2xH200 (CUDA
# graphs, steady state) one program took 1.4 µs at T=0 against 6.4 µs for the launches, but each
# block costs it ~4.7 µs of serial work (39 against 8.4 µs at T=128, 77 against 8.9 at T=256):
# only a single block (T <= 16, decode) comes out ahead.
ONE_PROGRAM_MAX_BLOCKS = 1


# Makes an int32 tensor of a given shape on the layout's device (the launches' outputs): plain
# torch.empty by default, or views of one flat arena (ops/ep/layout_replay.py).
Int32Alloc = Callable[[tuple[int, ...]], torch.Tensor]


def send_layout_shapes(num_tokens: int, topk: int, num_experts: int, world_size: int,
                       max_tokens: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the int32 tensors `build_send_layout` returns (`prefix` holds counts and tokens_to)."""
    T, K, E, W = num_tokens, topk, num_experts, world_size
    return {"prefix": (triton.cdiv(T, SEND_LAYOUT_BLOCK_T) + 1, E + W + 1), "topk_idx": (T, K), "pos": (T, K),
            "slot": (T, W), "send_idx": (W, max_tokens), "flags": (1,)}


def _int32_tensors(shapes: dict[str, tuple[int, ...]], alloc: Int32Alloc | None,
                   device: torch.device) -> dict[str, torch.Tensor]:
    make = alloc or (lambda shape: torch.empty(shape, dtype=torch.int32, device=device))
    return {name: make(shape) for name, shape in shapes.items()}


def build_send_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                      max_tokens: int, alloc: Int32Alloc | None = None,
                      one_program: bool | None = None) -> SendLayout:
    """Sender-side layout from `topk_idx` [T, K] (int32 or int64; device only, graph-capturable).

    Three launches: per-block counts (`send_layout_count_kernel`), their prefix over blocks
    (`column_prefix_kernel`; torch.cumsum's outer-dim scan took 50 µs at T=4096 on an H200), and
    the placement of every pair and token (`send_layout_place_kernel`). Up to
    ONE_PROGRAM_MAX_BLOCKS blocks (T <= 16, where the launches are the cost) one program does the
    same work block after block (`send_layout_one_program_kernel`): the same tensors, bit for bit;
    one_program forces either path.
    Every position is a count of earlier pairs/tokens: no atomic decides one. Out-of-range expert
    ids and tokens beyond `max_tokens` are treated as dropped and flagged.
    send_idx entries past tokens_to[d] are left unwritten (kernels read j < tokens_to[d] only).
    alloc makes the returned tensors (shapes: `send_layout_shapes`); default torch.empty.
    """
    if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be an int32/int64 [T, K] tensor, got {tuple(topk_idx.shape)} {topk_idx.dtype}")
    dev = topk_idx.device
    T, K = topk_idx.shape
    E, W = num_experts, world_size
    topk_idx = topk_idx.contiguous()
    bt = SEND_LAYOUT_BLOCK_T
    n_blk = triton.cdiv(T, bt)
    n_col = E + W + 1  # per block: pairs per expert | tokens per rank | bad expert ids
    out = _int32_tensors(send_layout_shapes(T, K, E, W, max_tokens), alloc, dev)
    consts = dict(K=K, BLOCK_K=triton.next_power_of_2(K), BT=bt, BLOCK_E=triton.next_power_of_2(E + 1),
                  BLOCK_W=triton.next_power_of_2(W))
    prefix = out["prefix"]  # row b: totals of the blocks before b
    if one_program if one_program is not None else n_blk <= ONE_PROGRAM_MAX_BLOCKS:
        fast(send_layout_one_program_kernel)[(1,)](topk_idx, prefix, out["topk_idx"], out["pos"], out["slot"],
                                             out["send_idx"], out["flags"], T, E, E // W, W, max_tokens, n_blk,
                                             **consts)
        return _send_layout(out, prefix[n_blk], E, W)
    counts = torch.empty((n_blk + 1, n_col), dtype=torch.int32, device=dev)
    if n_blk:
        fast(send_layout_count_kernel)[(n_blk,)](topk_idx, counts, T, E, E // W, W, max_tokens, **consts)
    else:
        counts.zero_()
    bc = 128
    fast(column_prefix_kernel)[(triton.cdiv(n_col, bc),)](counts, prefix, n_blk + 1, n_col, BR=16, BC=bc)
    fast(send_layout_place_kernel)[(max(n_blk, 1),)](topk_idx, prefix, out["topk_idx"], out["pos"], out["slot"],
                                               out["send_idx"], out["flags"], T, E, E // W, W, max_tokens, n_blk,
                                               **consts)
    return _send_layout(out, prefix[n_blk], E, W)


def _send_layout(out: dict[str, torch.Tensor], totals: torch.Tensor, E: int, W: int) -> SendLayout:
    return SendLayout(topk_idx=out["topk_idx"], pos=out["pos"], slot=out["slot"], send_idx=out["send_idx"],
                      counts=totals[:E], tokens_to=totals[E:E + W], flags=out["flags"])


@register_device_function
@triton.jit
def _route_bins(topk_ptr, o_pair, o_t, m, E, MAXT):
    """Pairs at offsets o_pair of tokens o_t (mask m) -> (bin, valid, bad): bin = the expert id of
    a routed pair, E for a dropped one (id -1, an id out of range, or a token at or past MAXT).
    Compared in the input's own integer type, so an int64 id cannot wrap into range."""
    e = tl.load(topk_ptr + o_pair, mask=m, other=-1)
    valid = m & (e >= 0) & (e < E) & (o_t < MAXT)
    bad = m & ((e < -1) | (e >= E))
    return tl.where(valid, e, E).to(tl.int32), valid, bad


@register_device_function
@triton.jit
def _token_hits(topk_ptr, o_t, m_t, E, E_local, MAXT, K: tl.constexpr, BLOCK_W: tl.constexpr):
    """[BT, BLOCK_W] int32: 1 where token o_t has a routed pair on rank d."""
    o_w = tl.arange(0, BLOCK_W)
    hit = tl.zeros((o_t.shape[0], BLOCK_W), dtype=tl.int32)
    for k in tl.static_range(K):
        e, valid, bad = _route_bins(topk_ptr, o_t * K + k, o_t, m_t, E, MAXT)
        d = tl.where(valid, e // E_local, -1)
        hit = tl.maximum(hit, (d[:, None] == o_w[None, :]).to(tl.int32))
    return hit


@register_device_function
@triton.jit
def _block_counts(topk_ptr, b, T, E, E_local, MAXT, K: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr):
    """Block b's counts: pairs per expert [BLOCK_E] (bin E and above: the dropped pairs), tokens
    per destination rank [BLOCK_W], bad expert ids (a scalar)."""
    o_p = tl.arange(0, BT * BLOCK_K)  # pairs in (t, k) order; lanes with k >= K are padding
    o_t = b * BT + o_p // BLOCK_K
    o_k = o_p % BLOCK_K
    m = (o_t < T) & (o_k < K)
    e, valid, bad = _route_bins(topk_ptr, o_t * K + o_k, o_t, m, E, MAXT)
    o_tt = b * BT + tl.arange(0, BT)
    hit = _token_hits(topk_ptr, o_tt, o_tt < T, E, E_local, MAXT, K, BLOCK_W)
    return tl.histogram(e, BLOCK_E), tl.sum(hit, axis=0), tl.sum(bad.to(tl.int32), axis=0)


@triton.jit
def send_layout_count_kernel(
    topk_ptr,    # int32/int64 (T, K) expert ids
    counts_ptr,  # out int32 (n_blk + 1, E + W + 1): row b + 1 = block b's counts, row 0 = zeros
    T, E, E_local, W, MAXT,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program b counts its BT tokens: pairs per expert, tokens per destination rank, bad ids."""
    b = tl.program_id(0)
    n_col = E + W + 1
    per_expert, per_rank, n_bad = _block_counts(topk_ptr, b, T, E, E_local, MAXT, K, BLOCK_K, BT, BLOCK_E, BLOCK_W)
    o_e = tl.arange(0, BLOCK_E)
    o_w = tl.arange(0, BLOCK_W)
    p_row = counts_ptr + (b + 1) * n_col
    tl.store(p_row + o_e, per_expert, mask=o_e < E)
    tl.store(p_row + E + o_w, per_rank, mask=o_w < W)
    tl.store(p_row + E + W, n_bad)
    if b == 0:
        for c0 in range(0, n_col, BLOCK_E):
            tl.store(counts_ptr + c0 + o_e, tl.zeros((BLOCK_E,), dtype=tl.int32), mask=c0 + o_e < n_col)


@triton.jit
def column_prefix_kernel(x_ptr, out_ptr, n_rows, n_col, BR: tl.constexpr, BC: tl.constexpr):
    """out = cumsum(x, axis=0) of an int32 (n_rows, n_col) matrix; program c owns BC columns."""
    o_c = tl.program_id(0) * BC + tl.arange(0, BC)
    o_r = tl.arange(0, BR)
    m_c = o_c < n_col
    carry = tl.zeros((BC,), dtype=tl.int32)
    for r0 in range(0, n_rows, BR):
        m = ((r0 + o_r) < n_rows)[:, None] & m_c[None, :]
        offs = (r0 + o_r)[:, None] * n_col + o_c[None, :]
        b_x = tl.load(x_ptr + offs, mask=m, other=0)
        tl.store(out_ptr + offs, carry[None, :] + tl.cumsum(b_x, axis=0), mask=m)
        carry += tl.sum(b_x, axis=0)


@register_device_function
@triton.jit
def _place_block(topk_ptr, p_pre, b, topk_out_ptr, pos_ptr, slot_ptr, send_idx_ptr, T, E, E_local, W, MAXT,
                 K: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr, BLOCK_W: tl.constexpr):
    """Place block b's BT tokens: position = the blocks-before prefix (row p_pre) + earlier pairs
    (tokens) of the same expert (rank) inside the block, in (t, k) order."""
    o_p = tl.arange(0, BT * BLOCK_K)
    o_t = b * BT + o_p // BLOCK_K
    o_k = o_p % BLOCK_K
    m = (o_t < T) & (o_k < K)
    e, valid, bad = _route_bins(topk_ptr, o_t * K + o_k, o_t, m, E, MAXT)
    earlier = (e[None, :] == e[:, None]) & (o_p[None, :] < o_p[:, None]) & valid[None, :]  # [P, P]
    pos = tl.load(p_pre + e, mask=valid, other=0) + tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(pos_ptr + o_t * K + o_k, tl.where(valid, pos, 0), mask=m)
    tl.store(topk_out_ptr + o_t * K + o_k, tl.where(valid, e, -1), mask=m)

    o_tt = b * BT + tl.arange(0, BT)
    m_tt = o_tt < T
    o_w = tl.arange(0, BLOCK_W)
    hit = _token_hits(topk_ptr, o_tt, m_tt, E, E_local, MAXT, K, BLOCK_W)  # [BT, BLOCK_W]
    slot = tl.load(p_pre + E + o_w, mask=o_w < W, other=0)[None, :] + tl.cumsum(hit, axis=0) - hit
    slot = tl.where(hit > 0, slot, -1)
    tl.store(slot_ptr + o_tt[:, None] * W + o_w[None, :], slot, mask=m_tt[:, None] & (o_w < W)[None, :])
    tl.store(send_idx_ptr + o_w[None, :] * MAXT + slot, o_tt[:, None] + 0 * slot, mask=hit > 0)


@register_device_function
@triton.jit
def _send_flags(n_bad, T, MAXT):
    return tl.where(n_bad > 0, _FLAG_BAD_EXPERT, 0) | tl.where(T > MAXT, _FLAG_TOO_MANY_TOKENS, 0)


@triton.jit
def send_layout_place_kernel(
    topk_ptr,      # int32/int64 (T, K) expert ids
    prefix_ptr,    # int32 (n_blk + 1, E + W + 1): row b = counts of the blocks before b
    topk_out_ptr,  # out int32 (T, K): the id of a routed pair, -1 for a dropped one
    pos_ptr,       # out int32 (T, K): index of the pair among this rank's pairs of its expert
    slot_ptr,      # out int32 (T, W): index of token t among the tokens sent to rank d, or -1
    send_idx_ptr,  # out int32 (W, MAXT): send_idx[d, slot[t, d]] = t
    flags_ptr,     # out int32 (1,): FLAG_* bits
    T, E, E_local, W, MAXT, n_blk,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program b places its BT tokens (`_place_block`)."""
    b = tl.program_id(0)
    n_col = E + W + 1
    _place_block(topk_ptr, prefix_ptr + b * n_col, b, topk_out_ptr, pos_ptr, slot_ptr, send_idx_ptr, T, E, E_local,
                 W, MAXT, K, BLOCK_K, BT, BLOCK_W)
    if b == 0:
        tl.store(flags_ptr, _send_flags(tl.load(prefix_ptr + n_blk * n_col + E + W), T, MAXT))


@triton.jit
def send_layout_one_program_kernel(
    topk_ptr, prefix_ptr, topk_out_ptr, pos_ptr, slot_ptr, send_idx_ptr, flags_ptr,  # as the place kernel
    T, E, E_local, W, MAXT, n_blk,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """The three launches' work in one program, for a few blocks: block b's prefix row is the
    running total of the blocks before it (written, then read back by the placement), then its
    own counts join the total. The same functions as the three kernels: the same bits."""
    n_col = E + W + 1
    o_e = tl.arange(0, BLOCK_E)
    o_w = tl.arange(0, BLOCK_W)
    per_expert = tl.zeros((BLOCK_E,), dtype=tl.int32)
    per_rank = tl.zeros((BLOCK_W,), dtype=tl.int32)
    n_bad = tl.sum(per_rank, axis=0)  # an int32 zero that the loop may carry
    for b in range(0, n_blk + 1):
        p_pre = prefix_ptr + b * n_col
        tl.store(p_pre + o_e, per_expert, mask=o_e < E)
        tl.store(p_pre + E + o_w, per_rank, mask=o_w < W)
        tl.store(p_pre + E + W, n_bad)
        if b < n_blk:
            tl.debug_barrier()  # the placement gathers from the row every thread just wrote
            _place_block(topk_ptr, p_pre, b, topk_out_ptr, pos_ptr, slot_ptr, send_idx_ptr, T, E, E_local, W, MAXT,
                         K, BLOCK_K, BT, BLOCK_W)
            c_e, c_w, c_bad = _block_counts(topk_ptr, b, T, E, E_local, MAXT, K, BLOCK_K, BT, BLOCK_E, BLOCK_W)
            per_expert += c_e
            per_rank += c_w
            n_bad += c_bad
    tl.store(flags_ptr, _send_flags(n_bad, T, MAXT))


@register_device_function
@triton.jit
def _row_tiles(o_i, t_incl, t_excl, b_num, b_off, m_e, E_local, n_used, BLOCK_M: tl.constexpr):
    """Natural row tiles o_i of BLOCK_M rows per expert (an expert's last tile may be partial; an
    expert without rows owns none): (expert, first row, rows, sel) with sel the one-hot [BI, BE]
    of the expert; rows = 0 past the last tile."""
    o_e = tl.arange(0, b_num.shape[0])
    # expert of tile i: the number of experts whose tiles all come before i
    e = tl.minimum(tl.sum(((t_incl[None, :] <= o_i[:, None]) & m_e[None, :]).to(tl.int32), axis=1), E_local - 1)
    sel = (o_e[None, :] == e[:, None]).to(tl.int32)  # one-hot gathers of per-expert values
    row0 = tl.sum(sel * b_off[None, :], axis=1) + (o_i - tl.sum(sel * t_excl[None, :], axis=1)) * BLOCK_M
    n = tl.minimum(tl.sum(sel * (b_off + b_num)[None, :], axis=1) - row0, BLOCK_M)
    return e, row0, tl.where(o_i < n_used, tl.maximum(n, 0), 0), sel


@register_device_function
@triton.jit
def _tile_arrival(o_i, sel, rel0, n, n_used, b_n, b_src_off, rank, world, ring_step, BLOCK_W: tl.constexpr):
    """Sort key of row tiles: the ring position (0 = this rank's own rows, then the order in which
    sources are received) of the last-received source any of its rows comes from; world for
    tiles without rows. b_n / b_src_off: [BLOCK_W, BLOCK_E] rows and first row of each source
    inside each expert's segment."""
    o_w = tl.arange(0, BLOCK_W)
    rel1 = rel0 + n - 1
    key = tl.zeros_like(o_i)
    for s in range(world):
        on_s = (o_w == s)[:, None]
        n_s = tl.sum(sel * tl.sum(tl.where(on_s, b_n, 0), axis=0)[None, :], axis=1)  # [BI]
        off_s = tl.sum(sel * tl.sum(tl.where(on_s, b_src_off, 0), axis=0)[None, :], axis=1)
        has_s = (n_s > 0) & (off_s <= rel1) & (off_s + n_s > rel0)
        key = tl.maximum(key, tl.where(has_s, ((s - rank) * ring_step + world) % world, 0))
    return tl.where((o_i < n_used) & (n > 0), key, world)


@register_device_function
@triton.jit
def _row_tile_map(b_num, b_off, b_n, b_src_off, m_e, E_local, n_tiles, tile_start_ptr, tiles_ptr, rank, world,
                  ring_step, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr,
                  BLOCK_KEY: tl.constexpr):
    """tile_start = exclusive prefix of the experts' row tiles, and the tile table in the order
    the GEMM stages take tiles: by arrival (`_tile_arrival`), then by natural index — so tiles of
    rows already here come first. Entry: (expert, first row, rows, natural index); the natural
    index names the tile's signal words. A stable counting sort: two passes over the tiles."""
    n_t = tl.where(m_e, (b_num + BLOCK_M - 1) // BLOCK_M, 0)  # [BLOCK_E]
    t_incl = tl.cumsum(n_t, axis=0)
    t_excl = t_incl - n_t
    o_e = tl.arange(0, b_num.shape[0])
    tl.store(tile_start_ptr + o_e, t_excl, mask=m_e)
    n_used = tl.sum(n_t, axis=0)
    tl.store(tile_start_ptr + E_local, n_used)
    o_k = tl.arange(0, BLOCK_KEY)
    per_key = tl.zeros((BLOCK_KEY,), dtype=tl.int32)
    for i0 in range(0, n_tiles, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I)
        e, row0, n, sel = _row_tiles(o_i, t_incl, t_excl, b_num, b_off, m_e, E_local, n_used, BLOCK_M)
        rel0 = row0 - tl.sum(sel * b_off[None, :], axis=1)
        key = _tile_arrival(o_i, sel, rel0, n, n_used, b_n, b_src_off, rank, world, ring_step, BLOCK_W)
        hot = ((key[:, None] == o_k[None, :]) & (o_i < n_tiles)[:, None]).to(tl.int32)
        per_key += tl.sum(hot, axis=0)
    before = tl.cumsum(per_key, axis=0) - per_key  # tiles of smaller keys
    for i0 in range(0, n_tiles, BLOCK_I):
        o_i = i0 + tl.arange(0, BLOCK_I)
        m_i = o_i < n_tiles
        e, row0, n, sel = _row_tiles(o_i, t_incl, t_excl, b_num, b_off, m_e, E_local, n_used, BLOCK_M)
        rel0 = row0 - tl.sum(sel * b_off[None, :], axis=1)
        key = _tile_arrival(o_i, sel, rel0, n, n_used, b_n, b_src_off, rank, world, ring_step, BLOCK_W)
        hot = ((key[:, None] == o_k[None, :]) & m_i[:, None]).to(tl.int32)
        pos = tl.sum(hot * (before[None, :] + tl.cumsum(hot, axis=0) - hot), axis=1)
        before += tl.sum(hot, axis=0)
        p = tiles_ptr + pos * 4
        tl.store(p, e, mask=m_i)
        tl.store(p + 1, row0, mask=m_i)
        tl.store(p + 2, n, mask=m_i)
        tl.store(p + 3, o_i, mask=m_i)


@register_device_function
@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit(do_not_specialize=["record_pending", "T", "rank"])
def ep_layout_kernel(
    counts_ptr,      # int32 (E,) pairs per expert on this rank
    tokens_to_ptr,   # int32 (W,) tokens this rank sends to each rank
    flags_ptr,       # int32 (1,) this rank's FLAG_* bits
    fields_ptr,      # int32 (RECORD_FIELDS,) this call's request fields
    T,               # this rank's token count
    table_ptr,       # int64 (W,) arena bases
    sig_table_ptr,   # int64 (W,) signal bases
    layout_offset,   # bytes: symmetric int32 (2, W, E_local + LAYOUT_EXTRA) landing buffer
    sig_first,       # W signals: one per source rank
    num_recv_ptr,    # out int32 (E_local,) rows per local expert
    expert_off_ptr,  # out int32 (E_local + 1,) exclusive prefix of num_recv; last = total
    src_off_ptr,     # out int32 (W, E_local) row offset of source s inside expert e's segment
    tokens_from_ptr, # out int32 (W,) tokens each source sends here
    src_info_ptr,    # out int32 (W, 2): (FLAG_* bits, T) of every source rank, with the meeting's bits
    records_ptr,     # out int32 (W, 2 + RECORD_FIELDS): every source's call number, T and request fields
    tile_start_ptr,  # out int32 (E_local + 1,) first row tile of each expert (BLOCK_M > 0)
    tiles_ptr,       # out int32 (n_tiles, 4): row tiles in GEMM order (BLOCK_M > 0; see _row_tile_map)
    pending_ptr,     # int32 (1,): problems recorded by graph-mode calls, raised by the next host-visible call
    record_pending,  # 1 in graph mode: every rank's FLAG_* bits are OR-ed into pending; 0 (default mode):
                     # this rank's record gets FLAG_UNREAD while pending holds any (buffer.raise_pending_flags)
    rank, world, E_local, budget, n_tiles,
    ring_step,       # +1: sources are received in ring order rank, rank+1, ...; -1: rank, rank-1, ...
    BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr = 0, BLOCK_I: tl.constexpr = 128,
):
    """The opening launch of a dispatch or FusedMoE call (one program): the counts exchange,
    carrying every rank's call record (flags, T, request fields; its call number as the signal's
    stamp). Every rank reads every rank's record before any data moves (`meet_peer`); the
    launches after it go only if every rank is at this call and none is flagged to stop
    (call_begin(OPENS=False) reads GO)."""
    # No entry barrier: the exchange writes into the half of every peer's landing buffer picked
    # by the call number's parity. A peer may still be reading the other half, for its previous
    # call; the previous call of this parity is at least two calls back, and the call between
    # opened by meeting every peer, which each did only after finishing the one before.
    my_ctrl = ctrl_ptr(table_ptr, rank)
    call = tl.load(my_ctrl + CALL, volatile=True) + 1
    row = E_local + 4 + _RECORD_FIELDS
    half = (call & 1) * world * row
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E_local
    o_f = tl.arange(0, _RECORD_FIELDS)
    flags = tl.load(flags_ptr) | unread_flag(my_ctrl)
    if record_pending == 0:
        # problems graph-mode calls left on this rank (some are its alone: a max_recv_rows overflow,
        # a timeout it saw) stop this call on every rank; its host raises them, the others name it
        flags |= tl.where(tl.load(pending_ptr) != 0, FLAG_UNREAD, 0)
    for i in range(world):
        i_dst = (rank - i + world) % world
        p_dst = heap_ptr(table_ptr, i_dst, layout_offset, tl.int32) + half + rank * row
        b_cnt = tl.load(counts_ptr + i_dst * E_local + o_e, mask=m_e)  # [BLOCK_E]
        tl.store(p_dst + o_e, b_cnt, mask=m_e)
        tl.store(p_dst + E_local, tl.load(tokens_to_ptr + i_dst))
        tl.store(p_dst + E_local + 1, flags)
        tl.store(p_dst + E_local + 2, call)
        tl.store(p_dst + E_local + 3, T)
        tl.store(p_dst + E_local + 4 + o_f, tl.load(fields_ptr + o_f))
        notify(heap_ptr(sig_table_ptr, i_dst, 0, tl.int32) + sig_first + rank, call)
    p_in = heap_ptr(table_ptr, rank, layout_offset, tl.int32) + half
    n_stop = 0
    n_missing = 0
    for s in range(world):
        seen, v = meet_peer(heap_ptr(sig_table_ptr, rank, 0, tl.int32) + sig_first + s, p_in + s * row + E_local + 1,
                            call, my_ctrl, rank, STAGE_LAYOUT, s, budget)
        n_stop += note_stop(my_ctrl, seen, s, call, v, False)  # the host reads these records
        n_missing += ((seen & FLAG_MISSING) != 0).to(tl.int32)
        tl.store(src_info_ptr + s * 2, seen)
        tl.store(records_ptr + s * (2 + _RECORD_FIELDS), v)
    if n_missing > 0:
        # Leave the call: a rank that joins it late (one that missed the call) finds this in
        # the flags and leaves too, instead of taking these counts as current.
        for i in range(world):
            p_dst = heap_ptr(table_ptr, i, layout_offset, tl.int32) + half + rank * row
            tl.store(p_dst + E_local + 1, flags | FLAG_GAVE_UP)
    go = n_stop == 0
    o_w = tl.arange(0, BLOCK_W)
    m_w = o_w < world
    m = m_w[:, None] & m_e[None, :]
    # A call that does not go moves nothing: its layout says so (no rows), so nothing reads past it.
    b_n = tl.load(p_in + o_w[:, None] * row + o_e[None, :], mask=m & go, other=0)  # [BLOCK_W, BLOCK_E]
    b_src_off = tl.cumsum(b_n, axis=0) - b_n
    tl.store(src_off_ptr + o_w[:, None] * E_local + o_e[None, :], b_src_off, mask=m)
    b_num = tl.sum(b_n, axis=0)                                                # [BLOCK_E]
    b_incl = tl.cumsum(b_num, axis=0)
    tl.store(num_recv_ptr + o_e, b_num, mask=m_e)
    tl.store(expert_off_ptr + o_e, b_incl - b_num, mask=m_e)
    tl.store(expert_off_ptr + E_local, tl.sum(b_num, axis=0))
    tl.store(tokens_from_ptr + o_w, tl.load(p_in + o_w * row + E_local, mask=m_w & go, other=0), mask=m_w)
    b_t = tl.load(p_in + o_w * row + E_local + 3, mask=m_w, other=0)
    tl.store(src_info_ptr + o_w * 2 + 1, tl.where(go, b_t, 0), mask=m_w)
    tl.store(records_ptr + o_w * (2 + _RECORD_FIELDS) + 1, b_t, mask=m_w)
    p_rec = records_ptr + o_w[:, None] * (2 + _RECORD_FIELDS) + 2 + o_f[None, :]
    tl.store(p_rec, tl.load(p_in + o_w[:, None] * row + E_local + 4 + o_f[None, :], mask=m_w[:, None], other=0),
             mask=m_w[:, None])
    if record_pending != 0:  # bit sets: OR-ed, not maxed (a max drops every smaller bit)
        tl.debug_barrier()  # the scalar stores of src_info above, read back as a vector
        b_flags = tl.load(src_info_ptr + o_w * 2, mask=m_w, other=0)
        tl.store(pending_ptr, tl.load(pending_ptr) | tl.reduce(b_flags, 0, _bitwise_or))
    if BLOCK_M > 0:
        _row_tile_map(b_num, b_incl - b_num, b_n, b_src_off, m_e, E_local, n_tiles, tile_start_ptr, tiles_ptr,
                      rank, world, ring_step, BLOCK_M, BLOCK_I, BLOCK_W, 2 * BLOCK_W)
    call_end(table_ptr, rank, call, OPENS=True)


register_kernel(column_prefix_kernel, {"x_ptr": "*i32", "out_ptr": "*i32", "n_rows": "i32", "n_col": "i32"},
                {"BR": 16, "BC": 128})
for _idx_ty in ("*i32", "*i64"):
    _consts = {"K": 8, "BLOCK_K": 8, "BT": SEND_LAYOUT_BLOCK_T, "BLOCK_E": 512, "BLOCK_W": 8}
    register_kernel(send_layout_count_kernel,
                    {"topk_ptr": _idx_ty, "counts_ptr": "*i32", **{n: "i32" for n in ("T", "E", "E_local", "W", "MAXT")}},
                    _consts, label=f"{_idx_ty[1:]}-K8-E256")
    for _place in (send_layout_place_kernel, send_layout_one_program_kernel):
        register_kernel(_place,
                        {"topk_ptr": _idx_ty, "prefix_ptr": "*i32", "topk_out_ptr": "*i32", "pos_ptr": "*i32",
                         "slot_ptr": "*i32", "send_idx_ptr": "*i32", "flags_ptr": "*i32",
                         **{n: "i32" for n in ("T", "E", "E_local", "W", "MAXT", "n_blk")}},
                        _consts, label=f"{_idx_ty[1:]}-K8-E256")

register_kernel(
    ep_layout_kernel,
    {"counts_ptr": "*i32", "tokens_to_ptr": "*i32", "flags_ptr": "*i32", "fields_ptr": "*i32", "T": "i32", "table_ptr": "*i64",
     "sig_table_ptr": "*i64", "layout_offset": "i64", "sig_first": "i32", "num_recv_ptr": "*i32",
     "expert_off_ptr": "*i32", "src_off_ptr": "*i32", "tokens_from_ptr": "*i32", "src_info_ptr": "*i32",
     "records_ptr": "*i32",
     "tile_start_ptr": "*i32", "tiles_ptr": "*i32", "pending_ptr": "*i32", "record_pending": "i32",
     "rank": "i32", "world": "i32", "E_local": "i32",
     "budget": "i32", "n_tiles": "i32", "ring_step": "i32"},
    {"BLOCK_W": 8, "BLOCK_E": 64, "BLOCK_M": 128}, label="W8-E64-tiles")


@dataclass
class RecvLayout:
    """This rank's receive side, on the device.

    num_recv:    int32 [E_local]      rows per local expert
    expert_off:  int32 [E_local + 1]  start row of each local expert; [-1] = total rows
    src_off:     int32 [W, E_local]   start of source s inside expert e's rows
    tokens_from: int32 [W]            tokens each source stages here
    src_info:    int32 [W, 2]         (FLAG_* bits, T) of every source rank (bits of the meeting included)
    records:     int32 [W, 2 + RECORD_FIELDS]  every source's call number, T and request fields
    tile_start:  int32 [E_local + 1]  first GEMM row tile of each expert (when asked for)
    """

    num_recv: torch.Tensor
    expert_off: torch.Tensor
    src_off: torch.Tensor
    tokens_from: torch.Tensor
    src_info: torch.Tensor
    records: torch.Tensor
    tile_start: torch.Tensor | None = None


def recv_layout_shapes(world_size: int, num_local_experts: int, tile_rows: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes of the int32 tensors `exchange_layout` returns (the fields of RecvLayout)."""
    W, e_local = world_size, num_local_experts
    shapes = {"num_recv": (e_local,), "expert_off": (e_local + 1,), "src_off": (W, e_local), "tokens_from": (W,),
              "src_info": (W, 2), "records": (W, 2 + RECORD_FIELDS)}
    if tile_rows:
        shapes["tile_start"] = (e_local + 1,)
    return shapes


def exchange_layout(heap: SymmetricHeap, send: SendLayout, num_experts: int,
                    layout_name: str, sig_first: int, fields: torch.Tensor, *, tile_rows: int = 0,
                    tiles: torch.Tensor | None = None, ring_step: int = 1,
                    alloc: Int32Alloc | None = None, pending: torch.Tensor,
                    record_pending: bool = False, tokens: int | None = None) -> RecvLayout:
    """Launch the counts exchange (one program); returns the receive layout (no host sync).

    fields: int32 [RECORD_FIELDS] on the device, this call's request fields (the call record).

    tile_rows > 0 also builds the GEMM row-tile map in the same launch: `tile_start`
    [E_local + 1] in the result and `tiles` [n_tiles, 4] filled in place, in the order the GEMM
    stages take them (rows that arrive first, first; see `_row_tile_map`); ring_step: +1 when
    sources are received in the order rank, rank + 1, ..., -1 for rank, rank - 1, ...
    alloc makes the returned tensors (shapes: `recv_layout_shapes`); default torch.empty.
    pending: the owner's int32 [1] problems recorded by graph-mode calls; record_pending (graph
    mode): every rank's FLAG_* bits are OR-ed into it; else this rank's record gets FLAG_UNREAD
    while it holds any.
    tokens: the T this rank's record carries (default: the routing's; a flagged call joins
    with no routing but its request's T).
    """
    W = heap.world_size
    e_local = num_experts // W
    dev = heap.device
    out = RecvLayout(**_int32_tensors(recv_layout_shapes(W, e_local, tile_rows), alloc, dev))
    if tile_rows and (tiles is None or tiles.dim() != 2 or tiles.shape[1] != 4 or tiles.dtype != torch.int32):
        raise ValueError("tile_rows > 0 needs `tiles`, an int32 [n_tiles, 4] tensor")
    if ring_step not in (1, -1):
        raise ValueError(f"ring_step must be 1 or -1, got {ring_step}")
    fast(ep_layout_kernel)[(1,)](
        send.counts, send.tokens_to, send.flags, fields,
        send.topk_idx.shape[0] if tokens is None else tokens, heap.ptr_table, heap.signal_table,
        heap.offset_of(layout_name), sig_first, out.num_recv, out.expert_off, out.src_off,
        out.tokens_from, out.src_info, out.records, out.tile_start if tile_rows else out.num_recv,
        tiles if tile_rows else out.num_recv, pending, int(record_pending), heap.rank, W, e_local, heap.wait_budget,
        tiles.shape[0] if tile_rows else 0, ring_step,
        BLOCK_W=triton.next_power_of_2(W), BLOCK_E=triton.next_power_of_2(e_local), BLOCK_M=tile_rows)
    return out
