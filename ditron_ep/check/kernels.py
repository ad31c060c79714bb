"""The heap self-test's kernels: a tile exchange and a peer read.

Tile exchange: every rank pushes one [R, C] tile to every rank (itself included).

The smallest kernel that uses every primitive the megakernels use — call barrier, ordered task
queue, remote puts, call-number-stamped signals, bounded waits — so it doubles as the heap and signal
self-test (`python -m ditron_ep check`, tests/runtime). `peer_get_kernel` reads bytes of every
rank's arena (the heap's peer-visibility check).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditron_ep.language.nvshmem import nvshmem_launcher, put_signal, quiet
from ditron_ep.language.primitives import call_begin, call_end, copy_rows, ctrl_ptr, heap_ptr, next_task, notify, wait
from ditron_ep.language.registry import register_kernel
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.heap import SymmetricHeap, register_stage
from ditron_ep.runtime.transport import kernel_signals, put_peer_mask

STAGE_EXCHANGE_RECV = tl.constexpr(register_stage(1, "tile exchange: receive"))


@triton.jit(do_not_specialize=["rank", "put_peers"])
def exchange_tiles_kernel(
    x_ptr,          # (R, C) this rank's tile, sent to every rank
    out_ptr,        # (W, R, C) out[s] = the tile rank s sent
    table_ptr,      # int64 (W,) arena base of every rank
    sig_table_ptr,  # int64 (W,) signal-area base of every rank
    recv_offset,    # bytes: symmetric (W, R, C) landing buffer
    sig_first,      # first of W * cdiv(R, BLOCK_R) signals: one per (source, row block)
    rank, world, R, C,
    budget,         # polls per bounded wait
    put_peers,      # bit p set: reach rank p by NVSHMEM put-with-signal (runtime/transport.py)
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    PUTS: tl.constexpr = False,  # the put transport is compiled in (then every signal is a uint64)
):
    SIG_STRIDE: tl.constexpr = 2 if PUTS else 1
    call_no, ok = call_begin(table_ptr, rank, world, budget)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    n_blocks = tl.cdiv(R, BLOCK_R)
    n_push = world * n_blocks
    # Queue: all pushes (peers in order rank+1, rank+2, ... , rank), then all receives.
    t = next_task(my_ctrl)
    while t < 2 * n_push:
        if ok:
            if t < n_push:
                i_dst = (rank + 1 + t // n_blocks) % world
                i_b = t % n_blocks
                # int64: W * R * C may pass 2^31 (tl.cast: Triton may have specialised rank == 1)
                row0 = tl.cast(rank, tl.int64) * R + i_b * BLOCK_R
                p_x = x_ptr + (i_b * BLOCK_R).to(tl.int64) * C
                n_rows = tl.minimum(BLOCK_R, R - i_b * BLOCK_R)
                i_sig = sig_first + (rank * n_blocks + i_b) * SIG_STRIDE
                by_put = False
                if PUTS:
                    by_put = ((put_peers >> i_dst) & 1) != 0
                if by_put:  # the rows are contiguous: one put, then the signal
                    put_signal(table_ptr, sig_table_ptr, rank, i_dst,
                               recv_offset + row0 * C * (x_ptr.dtype.element_ty.primitive_bitwidth // 8),
                               p_x, n_rows * C, i_sig, call_no)
                else:
                    p_dst = heap_ptr(table_ptr, i_dst, recv_offset, x_ptr.dtype.element_ty) + row0 * C
                    copy_rows(p_x, C, p_dst, C, n_rows, C, BLOCK_R, BLOCK_C)
                    notify(heap_ptr(sig_table_ptr, i_dst, 0, tl.int32) + i_sig, call_no)
            else:
                i_src = (t - n_push) // n_blocks
                i_b = (t - n_push) % n_blocks
                i_sig = sig_first + (i_src * n_blocks + i_b) * SIG_STRIDE
                p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32) + i_sig
                if wait(p_sig, call_no, my_ctrl, rank, STAGE_EXCHANGE_RECV, i_sig, budget):
                    row0 = i_src.to(tl.int64) * R + i_b * BLOCK_R
                    p_src = heap_ptr(table_ptr, rank, recv_offset, x_ptr.dtype.element_ty) + row0 * C
                    copy_rows(p_src, C, out_ptr + row0 * C, C, tl.minimum(BLOCK_R, R - i_b * BLOCK_R), C,
                              BLOCK_R, BLOCK_C)
        t = next_task(my_ctrl)
    if PUTS:
        quiet()  # this program's puts delivered before the call ends
    call_end(table_ptr, rank, call_no)


for _dt in ("fp32", "bf16", "fp16"):
    register_kernel(
        exchange_tiles_kernel,
        {"x_ptr": f"*{_dt}", "out_ptr": f"*{_dt}", "table_ptr": "*i64", "sig_table_ptr": "*i64",
         "recv_offset": "i64", "sig_first": "i32", "rank": "i32", "world": "i32", "R": "i32",
         "C": "i32", "budget": "i32", "put_peers": "i32"},
        {"BLOCK_R": 16, "BLOCK_C": 128}, label=_dt)

EXCHANGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8)


def exchange_tiles(heap: SymmetricHeap, x: torch.Tensor, *, num_programs: int | None = None,
                   block_r: int = 16, block_c: int = 128, check: bool = True,
                   transport: str = "auto") -> torch.Tensor:
    """Send this rank's tile `x` [R, C] to every rank; returns `out` [W, R, C] with out[s] = x of rank s.

    `transport` (runtime/transport.py): "pointer" stores, "put" NVSHMEM put-with-signal to every
    peer (nvshmem heaps only), "auto" pointers wherever the heap maps the peer.
    Collective over `heap`'s group; every rank passes the same shape and dtype. With
    `check=True` the host reads the error slot after the launch and raises DitronTimeoutError
    if a wait timed out (one device-to-host read); `check=False` never synchronises.
    """
    if not isinstance(x, torch.Tensor):
        raise DitronConfigError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise DitronConfigError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise DitronConfigError("x must be contiguous; call x.contiguous() first")
    if x.dtype not in EXCHANGE_DTYPES:
        raise DitronConfigError(f"x dtype {x.dtype} unsupported; use one of {EXCHANGE_DTYPES}")
    if x.device != heap.device:
        raise DitronConfigError(f"x is on {x.device} but the heap lives on {heap.device}; move x there")
    R, C = x.shape
    W = heap.world_size
    name = f"exchange/{R}x{C}/{x.dtype}"
    if not heap.has_buffer(name):
        heap.alloc(name, (W, R, C), x.dtype)
    n_blocks = triton.cdiv(R, block_r) if R else 0
    put_peers = put_peer_mask(heap, transport)
    sig_first = kernel_signals(heap, name + ("/put" if put_peers else ""), max(1, W * n_blocks), put_peers)
    out = torch.empty((W, R, C), dtype=x.dtype, device=x.device)
    programs = num_programs or max(1, min(2 * W * max(n_blocks, 1), 132))
    launch = nvshmem_launcher(exchange_tiles_kernel) if put_peers else exchange_tiles_kernel
    launch[(programs,)](
        x, out, heap.ptr_table, heap.signal_table, heap.offset_of(name), sig_first,
        heap.rank, W, R, C, heap.wait_budget, put_peers, BLOCK_R=block_r, BLOCK_C=block_c, PUTS=bool(put_peers))
    if check:
        heap.check_error()
    return out


@triton.jit
def peer_get_kernel(
    table_ptr,   # int64 (W,) arena base of every rank
    out_ptr,     # uint8 (W, n_bytes): out[p] = bytes [offset, offset + n_bytes) of rank p's arena
    offset,      # bytes from the arena base
    n_bytes,
    BLOCK: tl.constexpr,
):
    i_p = tl.program_id(0)
    o_b = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_b = o_b < n_bytes
    p_src = heap_ptr(table_ptr, i_p, offset, tl.uint8)
    b_x = tl.load(p_src + o_b, mask=m_b)  # [BLOCK]
    tl.store(out_ptr + i_p * n_bytes + o_b, b_x, mask=m_b)


register_kernel(peer_get_kernel, {"table_ptr": "*i64", "out_ptr": "*u8", "offset": "i64",
                                  "n_bytes": "i32"}, {"BLOCK": 1024})


def read_peer_bytes(heap: SymmetricHeap, offset: int, n_bytes: int) -> torch.Tensor:
    """uint8 [W, n_bytes]: row p holds bytes [offset, offset + n_bytes) of rank p's arena."""
    out = torch.empty(heap.world_size, n_bytes, dtype=torch.uint8, device=heap.device)
    block = 1024
    peer_get_kernel[(heap.world_size, triton.cdiv(n_bytes, block))](heap.ptr_table, out, offset, n_bytes, BLOCK=block)
    return out
