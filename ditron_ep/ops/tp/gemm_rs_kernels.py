"""GEMM+ReduceScatter in one persistent launch: each rank's partial product tile by tile, written
straight into the landing buffer of the rank whose rows it is, and each rank's rows reduced as
soon as every source's tile of them has landed (compiler/tp_plan.GemmRSPlan).

    y_r = rows [r*M, (r+1)*M) of sum_s a_s @ b_s      a_s [W*M, K] on rank s, b_s [K, N], y_r [M, N]

Tasks, in queue order (`next_task`):
  - GEMM (M-tile t_m, N-tile t_n) of a @ b, M-tiles in shard order from the next rank's shard
    (the own last): the fp32 tile (`rows_gemm_acc`, the code and tile of `gemm.matmul`) is stored
    into the landing buffer [source = this rank, row, N] of each rank whose shard holds its rows,
    then (this rank, t_m, t_n) is stamped there with the call number;
  - reduce (an M-tile meeting this rank's shard, N-tile): wait for that tile from every source,
    then y = the W partials added in rank order 0, 1, ... in fp32, cast once — what
    `functional.reduce_scatter_rows` computes, so y is bitwise the sequential schedule's.
GEMM tickets never wait and all precede the reduce tickets, so every wait is on a tile some
program of the source already holds or will take (no deadlock for any grid; under the
interpreter one program per rank runs them all). The call's entry barrier (`call_begin`) keeps a
source from writing into a landing buffer its owner still reads from the previous call.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.primitives import call_begin, call_end, ctrl_ptr, heap_ptr, next_task, notify, wait
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import rows_gemm_acc
from ditron_ep.ops.tp.ag_gemm_kernels import shard_tile
from ditron_ep.runtime.heap import register_stage

STAGE_GEMM_RS_WAIT = tl.constexpr(register_stage(9, "matmul_reduce_scatter: wait for a peer's partial"))


@register_device_function
@triton.jit
def sum_partials(land, at, m, M, N, world):
    """fp32 sum of the W partials landed at rows [s*M + row] (`at`: row * N + column offsets),
    added in rank order 0, 1, ...: the bits of functional.sum_in_rank_order."""
    acc = tl.load(land + at, mask=m, other=0.0)
    for s in range(1, world):
        acc += tl.load(land + (s * M).to(tl.int64) * N + at, mask=m, other=0.0)
    return acc


@triton.jit(do_not_specialize=["rank"])
def gemm_rs_kernel(
    a_ptr,          # (W*M, K) this rank's rows, contiguous
    b_ptr,          # (K, N) any strides
    y_ptr,          # out (M, N): this rank's rows of the sum
    table_ptr,      # int64 (W,) heap bases
    sig_table_ptr,  # int64 (W,) signal bases
    land_offset,    # bytes: symmetric (W*M_cap, N) fp32 landing buffer, rows [s*M, (s+1)*M) from source s
    sig_first,      # W * n_m * n_n signals: (source rank, M-tile, N-tile)
    M, K, N, rank, world, budget, s_bk, s_bn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    call_no, ok = call_begin(table_ptr, rank, world, budget)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    rows = world * M
    n_m = tl.cdiv(rows, BM)
    n_n = tl.cdiv(N, BN)
    n_gemm = n_m * n_n
    m_lo = rank * M // BM                      # the M-tiles meeting this rank's shard
    n_reduce = (((rank + 1) * M - 1) // BM - m_lo + 1) * n_n
    o_m = tl.arange(0, BM)
    t = next_task(my_ctrl)
    while t < n_gemm + n_reduce:
        if ok:
            if t < n_gemm:
                t_m = shard_tile(t // n_n, (rank + 1) % world, world, M, BM)
                t_n = t % n_n
                row0 = t_m * BM
                n_rows = tl.minimum(BM, rows - row0)
                acc = rows_gemm_acc(a_ptr, b_ptr, row0, n_rows, t_n * BN, K, N, s_bk, s_bn, BM, BN, BK,
                                    INPUT_PRECISION)
                o_n = t_n * BN + tl.arange(0, BN)
                for d in range(row0 // M, (row0 + n_rows - 1) // M + 1):  # the shards the tile's rows lie in
                    local = row0 + o_m - d * M
                    m_r = (local >= 0) & (local < M) & (o_m < n_rows)
                    dst = heap_ptr(table_ptr, d, land_offset, tl.float32) + (rank * M + local).to(tl.int64)[:, None] * N
                    tl.store(dst + o_n[None, :], acc, mask=m_r[:, None] & (o_n < N)[None, :])
                    notify(heap_ptr(sig_table_ptr, d, 0, tl.int32) + sig_first + (rank * n_m + t_m) * n_n + t_n,
                           call_no)
            else:
                j = t - n_gemm
                t_m = m_lo + j // n_n
                t_n = j % n_n
                n_bad = 0
                for s in range(world):
                    i_sig = sig_first + (s * n_m + t_m) * n_n + t_n
                    n_bad += (wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_GEMM_RS_WAIT, i_sig, budget)
                              == 0).to(tl.int32)
                if n_bad == 0:
                    local = t_m * BM + o_m - rank * M
                    m_r = (local >= 0) & (local < M)
                    o_n = t_n * BN + tl.arange(0, BN)
                    m = m_r[:, None] & (o_n < N)[None, :]
                    land = heap_ptr(table_ptr, rank, land_offset, tl.float32)
                    at = local.to(tl.int64)[:, None] * N + o_n[None, :]
                    acc = sum_partials(land, at, m, M, N, world)  # one cast after: the sequential bits
                    tl.store(y_ptr + at, acc.to(y_ptr.dtype.element_ty), mask=m)
        t = next_task(my_ctrl)
    call_end(table_ptr, rank, call_no)


# the reducing kernels' (this one's and gemm_ar_kernel's) signature
REDUCING_SIG = {"a_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "table_ptr": "*i64", "sig_table_ptr": "*i64",
        "land_offset": "i64", "sig_first": "i32", "M": "i32", "K": "i32", "N": "i32", "rank": "i32", "world": "i32",
        "budget": "i32", "s_bk": "i32", "s_bn": "i32"}
register_kernel(gemm_rs_kernel, REDUCING_SIG, {"BM": 128, "BN": 128, "BK": 64, "INPUT_PRECISION": "tf32"},
                label="bf16", options={"num_warps": 8, "num_stages": 2},
                multiples_of_16=["K", "N", "land_offset", "s_bk"])
