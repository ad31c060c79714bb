"""AllGather+GEMM in one persistent launch: the gather's copies and the GEMM's tiles in one ordered
task queue (language/task_queue's producer-before-consumer rule), communication overlapped with
compute at the granularity of a chunk of rows.

    y = cat_r(a_r) @ b      a_r [M, K] on rank r, b [K, N] (this rank's), y [W*M, N]

Tasks, in queue order (every program takes the next ticket, `next_task_split`):
  - copy (chunk c, destination d), d = rank, rank+1, ... (the own shard first): rows
    c*CHUNK .. of this rank's a are written into rank d's landing buffer at rows rank*M + c*CHUNK
    (their place in the gathered matrix), then (source rank, chunk) is stamped with the call number
    in d's signals;
  - GEMM (M-tile t_m of the gathered rows, N-tile t_n), M-tiles taken in shard order starting from
    the own shard (each tile is assigned to the shard of its first row): wait for exactly the
    chunks holding the tile's rows (they may span shards), then the tile with
    `grouped_gemm_kernels.rows_gemm_acc` — the code and tile config of `gemm.matmul`, so y is
    bitwise the sequential schedule's (all-gather, then matmul of the gathered rows).
Role split (comm_programs > 0): the first comm_programs programs to arrive take the copy
tickets, the others the GEMM tickets from a second counter, so the own shard's tiles start while
the peers' rows are still being copied; a copy program that drains its queue turns to GEMM tiles.
comm_programs = 0: every program takes the copies first. Copies wait on nothing and come first in
their queue, so every wait is on a task some program already holds (no deadlock for any grid;
under the interpreter one program runs them all).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.primitives import (call_begin, call_end, copy_rows, ctrl_ptr, heap_ptr, next_task_split, notify,
                                          take_role, wait)
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import rows_gemm_acc
from ditron_ep.runtime.heap import register_stage

STAGE_AG_GEMM_WAIT = tl.constexpr(register_stage(8, "all_gather_matmul: wait for a peer's rows"))


@register_device_function
@triton.jit
def shard_tile(g, rank, world, M, BM: tl.constexpr):
    """GEMM M-tile number g (0 <= g < cdiv(W*M, BM)) in shard order from `rank`'s shard: the
    M-tiles whose first row lies in shard (rank + i) % W come i-th. Returns the M-tile."""
    t_m = 0
    before = 0
    for i in range(world):
        s = (rank + i) % world
        lo = tl.cdiv(s * M, BM)
        n = tl.cdiv((s + 1) * M, BM) - lo
        t_m = tl.where((g >= before) & (g < before + n), lo + g - before, t_m)
        before += n
    return t_m


@triton.jit(do_not_specialize=["rank"])
def ag_gemm_kernel(
    a_ptr,          # (M, K) this rank's rows, contiguous
    b_ptr,          # (K, N) any strides
    y_ptr,          # out (W*M, N)
    table_ptr,      # int64 (W,) heap bases
    sig_table_ptr,  # int64 (W,) signal bases
    land_offset,    # bytes: symmetric (W*M_cap, K) landing buffer, a's dtype
    sig_first,      # W * n_chunks signals: (source rank, chunk) of this call's shapes
    M, K, N, rank, world, budget, s_bk, s_bn, comm_programs,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    call_no, ok = call_begin(table_ptr, rank, world, budget)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    land = heap_ptr(table_ptr, rank, land_offset, y_ptr.dtype.element_ty)
    n_chunks = tl.cdiv(M, CHUNK)
    n_copy = n_chunks * world
    rows = world * M
    n_n = tl.cdiv(N, BN)
    n_gemm = tl.cdiv(rows, BM) * n_n
    split_at = tl.where(comm_programs > 0, n_copy, 0)
    on_comm = take_role(my_ctrl, comm_programs)
    t, on_comm = next_task_split(my_ctrl, on_comm, split_at)
    while t < n_copy + n_gemm:
        if ok & (t >= 0):  # -1: a copy program found its queue drained; no task this turn
            if t < n_copy:
                c = t // world
                d = (rank + t % world) % world
                r0 = c * CHUNK
                dst = heap_ptr(table_ptr, d, land_offset, y_ptr.dtype.element_ty) + (rank * M + r0).to(tl.int64) * K
                copy_rows(a_ptr + r0.to(tl.int64) * K, K, dst, K, tl.minimum(CHUNK, M - r0), K, CHUNK, BLOCK_C)
                notify(heap_ptr(sig_table_ptr, d, 0, tl.int32) + sig_first + rank * n_chunks + c, call_no)
            else:
                g = t - n_copy
                t_m = shard_tile(g // n_n, rank, world, M, BM)
                t_n = g % n_n
                row0 = t_m * BM
                n_rows = tl.minimum(BM, rows - row0)
                n_bad = 0
                for s in range(row0 // M, (row0 + n_rows - 1) // M + 1):  # the shards the tile's rows lie in
                    lo = tl.maximum(row0 - s * M, 0) // CHUNK
                    hi = (tl.minimum(row0 + n_rows - s * M, M) - 1) // CHUNK
                    for c in range(lo, hi + 1):
                        i_sig = sig_first + s * n_chunks + c
                        n_bad += (wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_AG_GEMM_WAIT, i_sig, budget)
                                  == 0).to(tl.int32)
                if n_bad == 0:
                    acc = rows_gemm_acc(land, b_ptr, row0, n_rows, t_n * BN, K, N, s_bk, s_bn, BM, BN, BK,
                                        INPUT_PRECISION)
                    o_m = tl.arange(0, BM)
                    o_n = t_n * BN + tl.arange(0, BN)
                    r = (row0 + o_m).to(tl.int64)
                    tl.store(y_ptr + r[:, None] * N + o_n[None, :], acc.to(y_ptr.dtype.element_ty),
                             mask=(o_m < n_rows)[:, None] & (o_n < N)[None, :])
        t, on_comm = next_task_split(my_ctrl, on_comm, split_at)
    call_end(table_ptr, rank, call_no)


_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "table_ptr": "*i64", "sig_table_ptr": "*i64",
        "land_offset": "i64", "sig_first": "i32", "M": "i32", "K": "i32", "N": "i32", "rank": "i32", "world": "i32",
        "budget": "i32", "s_bk": "i32", "s_bn": "i32", "comm_programs": "i32"}
register_kernel(ag_gemm_kernel, _SIG, {"CHUNK": 128, "BLOCK_C": 256, "BM": 128, "BN": 128, "BK": 64,
                                       "INPUT_PRECISION": "tf32"},
                label="bf16", options={"num_warps": 8, "num_stages": 2},
                multiples_of_16=["K", "N", "land_offset", "s_bk"])
