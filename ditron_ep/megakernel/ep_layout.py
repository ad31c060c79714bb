"""Layout stage of EP dispatch: who sends what where, as a pure function of `topk_idx`.

Sender side (torch ops on the device, no host sync): per-expert counts, the position of every
(token, k) pair among the pairs of its expert on this rank (pairs counted in (t, k) order),
which tokens go to which rank and in which staging slot. A Triton kernel then exchanges the
counts through the heap (no NCCL) and turns them into receive offsets by prefix sums:
rows of local expert e are ordered by (source rank, source token) — no atomic decides a slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..compiler.portability import register_kernel
from ..runtime.heap import SymmetricHeap, register_stage
from .primitives import call_begin, call_end, ctrl_ptr, heap_ptr, notify, wait

STAGE_LAYOUT = tl.constexpr(register_stage(2, "ep layout: counts exchange"))
# Words per source row of the layout landing buffer: [E_local counts | tokens sent here | flags | T].
LAYOUT_EXTRA = 3
# Bits of a rank's input flags (exchanged with the counts, so every rank sees every rank's).
FLAG_BAD_EXPERT = 1     # an expert id outside [-1, E)
FLAG_TOO_MANY_TOKENS = 2  # T > max_tokens_per_rank


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


def build_send_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int,
                      max_tokens: int) -> SendLayout:
    """Sender-side layout from `topk_idx` [T, K] (device ops only; graph-capturable).

    Out-of-range expert ids and tokens beyond `max_tokens` are treated as dropped and flagged.
    """
    dev = topk_idx.device
    T, K = topk_idx.shape
    E, W = num_experts, world_size
    e_local = E // W
    idx = topk_idx.to(torch.int64)
    in_range = (idx >= 0) & (idx < E)
    flags = ((idx < -1) | (idx >= E)).any().to(torch.int32).reshape(1) * FLAG_BAD_EXPERT
    if T > max_tokens:
        in_range &= (torch.arange(T, device=dev) < max_tokens)[:, None]
        flags = flags | FLAG_TOO_MANY_TOKENS
    e = torch.where(in_range, idx, torch.full_like(idx, E))            # E = "dropped" bin
    flat = e.reshape(-1)
    # Stable sort by expert keeps (t, k) order inside each expert: position = rank in segment.
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_e, torch.arange(E + 2, device=dev, dtype=sorted_e.dtype))
    counts = (bounds[1:E + 1] - bounds[:E]).to(torch.int32)
    pos_sorted = torch.arange(T * K, device=dev) - bounds[sorted_e]
    pos = torch.empty_like(flat).scatter_(0, order, pos_sorted).reshape(T, K)
    dest = torch.where(in_range, e // e_local, torch.full_like(e, W))   # W = "no rank" column
    hit = torch.zeros((T, W + 1), dtype=torch.int32, device=dev).scatter_(1, dest, 1)[:, :W]
    slot = torch.cumsum(hit, dim=0, dtype=torch.int32) - 1
    slot = torch.where(hit.bool(), slot, torch.full_like(slot, -1))
    tokens_to = hit.sum(dim=0, dtype=torch.int32)
    # send_idx[d, slot[t, d]] = t. Tokens not going to d write scratch column max_tokens + t: one
    # scratch column for all of them made ~T*W writes collide on one address (measured: the
    # layout took ~0.6 ms at T=4096 on H200, mostly this scatter).
    scratch = torch.arange(max_tokens, max_tokens + T, device=dev, dtype=slot.dtype)[:, None]
    col = torch.where(hit.bool(), slot, scratch).t().to(torch.int64)
    send_idx = torch.zeros((W, max_tokens + T), dtype=torch.int32, device=dev)
    send_idx.scatter_(1, col, torch.arange(T, dtype=torch.int32, device=dev).expand(W, T).contiguous())
    return SendLayout(
        topk_idx=torch.where(in_range, idx, torch.full_like(idx, -1)).to(torch.int32),
        pos=pos.to(torch.int32), slot=slot.contiguous(), send_idx=send_idx[:, :max_tokens].contiguous(),
        counts=counts, tokens_to=tokens_to, flags=flags)


@triton.jit
def ep_layout_kernel(
    counts_ptr,      # int32 (E,) pairs per expert on this rank
    tokens_to_ptr,   # int32 (W,) tokens this rank sends to each rank
    flags_ptr,       # int32 (1,) this rank's FLAG_* bits
    T,               # this rank's token count
    table_ptr,       # int64 (W,) arena bases
    sig_table_ptr,   # int64 (W,) signal bases
    layout_offset,   # bytes: symmetric int32 (W, E_local + LAYOUT_EXTRA) landing buffer
    sig_first,       # W signals: one per source rank
    num_recv_ptr,    # out int32 (E_local,) rows per local expert
    expert_off_ptr,  # out int32 (E_local + 1,) exclusive prefix of num_recv; last = total
    src_off_ptr,     # out int32 (W, E_local) row offset of source s inside expert e's segment
    tokens_from_ptr, # out int32 (W,) tokens each source sends here
    src_info_ptr,    # out int32 (W, 2): (FLAG_* bits, T) of every source rank
    rank, world, E_local, budget,
    BLOCK_W: tl.constexpr, BLOCK_E: tl.constexpr,
):
    epoch, ok = call_begin(table_ptr, rank, world, budget)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    row = E_local + 3
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E_local
    if ok:
        flags = tl.load(flags_ptr)
        for i in range(world):
            i_dst = (rank - i + world) % world
            p_dst = heap_ptr(table_ptr, i_dst, layout_offset, tl.int32) + rank * row
            b_cnt = tl.load(counts_ptr + i_dst * E_local + o_e, mask=m_e)  # [BLOCK_E]
            tl.store(p_dst + o_e, b_cnt, mask=m_e)
            tl.store(p_dst + E_local, tl.load(tokens_to_ptr + i_dst))
            tl.store(p_dst + E_local + 1, flags)
            tl.store(p_dst + E_local + 2, T)
            notify(heap_ptr(sig_table_ptr, i_dst, 0, tl.int32) + sig_first + rank, epoch)
        n_bad = 0
        for s in range(world):
            i_sig = sig_first + s
            ok_s = wait(heap_ptr(sig_table_ptr, rank, 0, tl.int32) + i_sig, epoch, my_ctrl, rank,
                        STAGE_LAYOUT, i_sig, budget)
            n_bad += (ok_s == 0).to(tl.int32)
        if n_bad == 0:
            p_in = heap_ptr(table_ptr, rank, layout_offset, tl.int32)
            o_w = tl.arange(0, BLOCK_W)
            m_w = o_w < world
            m = m_w[:, None] & m_e[None, :]
            b_n = tl.load(p_in + o_w[:, None] * row + o_e[None, :], mask=m, other=0)  # [BLOCK_W, BLOCK_E]
            b_src_off = tl.cumsum(b_n, axis=0) - b_n
            tl.store(src_off_ptr + o_w[:, None] * E_local + o_e[None, :], b_src_off, mask=m)
            b_num = tl.sum(b_n, axis=0)                                                # [BLOCK_E]
            b_incl = tl.cumsum(b_num, axis=0)
            tl.store(num_recv_ptr + o_e, b_num, mask=m_e)
            tl.store(expert_off_ptr + o_e, b_incl - b_num, mask=m_e)
            tl.store(expert_off_ptr + E_local, tl.sum(b_num, axis=0))
            tl.store(tokens_from_ptr + o_w, tl.load(p_in + o_w * row + E_local, mask=m_w, other=0), mask=m_w)
            tl.store(src_info_ptr + o_w * 2, tl.load(p_in + o_w * row + E_local + 1, mask=m_w), mask=m_w)
            tl.store(src_info_ptr + o_w * 2 + 1, tl.load(p_in + o_w * row + E_local + 2, mask=m_w), mask=m_w)
    call_end(table_ptr, rank)


register_kernel(
    ep_layout_kernel,
    {"counts_ptr": "*i32", "tokens_to_ptr": "*i32", "flags_ptr": "*i32", "T": "i32", "table_ptr": "*i64",
     "sig_table_ptr": "*i64", "layout_offset": "i64", "sig_first": "i32", "num_recv_ptr": "*i32",
     "expert_off_ptr": "*i32", "src_off_ptr": "*i32", "tokens_from_ptr": "*i32", "src_info_ptr": "*i32",
     "rank": "i32", "world": "i32", "E_local": "i32", "budget": "i32"},
    {"BLOCK_W": 8, "BLOCK_E": 64}, label="W8-E64")


@dataclass
class RecvLayout:
    """This rank's receive side, on the device.

    num_recv:    int32 [E_local]      rows per local expert
    expert_off:  int32 [E_local + 1]  start row of each local expert; [-1] = total rows
    src_off:     int32 [W, E_local]   start of source s inside expert e's rows
    tokens_from: int32 [W]            tokens each source stages here
    src_info:    int32 [W, 2]         (FLAG_* bits, T) of every source rank
    """

    num_recv: torch.Tensor
    expert_off: torch.Tensor
    src_off: torch.Tensor
    tokens_from: torch.Tensor
    src_info: torch.Tensor


def exchange_layout(heap: SymmetricHeap, send: SendLayout, num_experts: int,
                    layout_name: str, sig_first: int) -> RecvLayout:
    """Launch the counts exchange (one program); returns the receive layout (no host sync)."""
    W = heap.world_size
    e_local = num_experts // W
    dev = heap.device
    out = RecvLayout(
        num_recv=torch.empty(e_local, dtype=torch.int32, device=dev),
        expert_off=torch.empty(e_local + 1, dtype=torch.int32, device=dev),
        src_off=torch.empty((W, e_local), dtype=torch.int32, device=dev),
        tokens_from=torch.empty(W, dtype=torch.int32, device=dev),
        src_info=torch.empty((W, 2), dtype=torch.int32, device=dev))
    ep_layout_kernel[(1,)](
        send.counts, send.tokens_to, send.flags, send.topk_idx.shape[0], heap.ptr_table, heap.signal_table,
        heap.offset_of(layout_name), sig_first, out.num_recv, out.expert_off, out.src_off,
        out.tokens_from, out.src_info, heap.rank, W, e_local, heap.wait_budget,
        BLOCK_W=triton.next_power_of_2(W), BLOCK_E=triton.next_power_of_2(e_local))
    return out
