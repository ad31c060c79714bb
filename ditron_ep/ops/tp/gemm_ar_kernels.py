"""GEMM+AllReduce in one persistent launch: each output tile has an owner (tile t: rank t % W);
every rank's fp32 partial of a tile lands in its owner's buffer as it is computed, the owner adds
the W partials once they are all there and writes the sum to every rank, and every rank copies
each tile out once its owner has stamped it (compiler/tp_plan.GemmARPlan).

    y = sum_s a_s @ b_s on every rank      a_s [M, K_s] on rank s, b_s [K_s, N], y [M, N]

Tasks, in queue order (`next_task`):
  - GEMM (tile (g + rank + 1) % n_tiles: the next ranks' tiles first): the fp32 tile
    (`rows_gemm_acc`, the code and tile of `gemm.matmul`) into the owner's landing rows
    [source * M + row], then (this rank, tile) stamped there with the call number;
  - reduce (the tiles this rank owns): wait for every source's partial, add them in rank order
    0, 1, ... in fp32, cast once to y's dtype — the sequential schedule's bits — and write that
    value (as fp32, exactly) into every rank's result rows [W * M + row], stamping (tile) there;
  - copy-out (every tile): wait for the tile's stamp, copy it into y.
GEMM tickets never wait, reduce tickets wait only on GEMM tickets and copy-outs only on reduces,
and each kind's tickets all precede the next kind's: every wait is on a task some program already
holds or will take (no deadlock for any grid). The entry barrier (`call_begin`) keeps a rank from
writing into a buffer a peer still reads from the previous call.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.primitives import call_begin, call_end, ctrl_ptr, heap_ptr, next_task, notify, wait
from ditron_ep.language.registry import register_kernel
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import rows_gemm_acc
from ditron_ep.ops.tp.gemm_rs_kernels import REDUCING_SIG, sum_partials
from ditron_ep.runtime.heap import register_stage

STAGE_GEMM_AR_PARTIAL = tl.constexpr(register_stage(5, "matmul_all_reduce: wait for a peer's partial"))
STAGE_GEMM_AR_RESULT = tl.constexpr(register_stage(6, "matmul_all_reduce: wait for a tile's owner"))


@triton.jit(do_not_specialize=["rank"])
def gemm_ar_kernel(
    a_ptr,          # (M, K) this rank's rows, contiguous
    b_ptr,          # (K, N) any strides
    y_ptr,          # out (M, N)
    table_ptr,      # int64 (W,) heap bases
    sig_table_ptr,  # int64 (W,) signal bases
    land_offset,    # bytes: symmetric ((W+1)*M_cap, N) fp32: partials [s*M + row], results [W*M + row]
    sig_first,      # (W + 1) * n_tiles signals: (source, tile), then (tile)
    M, K, N, rank, world, budget, s_bk, s_bn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    call_no, ok = call_begin(table_ptr, rank, world, budget)
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32)
    land = heap_ptr(table_ptr, rank, land_offset, tl.float32)
    n_n = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * n_n
    n_own = (n_tiles - rank + world - 1) // world      # tiles rank, rank + W, ... below n_tiles
    o_m = tl.arange(0, BM)
    t = next_task(my_ctrl)
    while t < 2 * n_tiles + n_own:
        if ok:
            if t < n_tiles:
                tile = (t + rank + 1) % n_tiles
            elif t < n_tiles + n_own:
                tile = rank + (t - n_tiles) * world
            else:
                tile = t - n_tiles - n_own
            row0 = tile // n_n * BM
            o_n = tile % n_n * BN + tl.arange(0, BN)
            m = ((row0 + o_m) < M)[:, None] & (o_n < N)[None, :]
            at = (row0 + o_m).to(tl.int64)[:, None] * N + o_n[None, :]
            if t < n_tiles:
                acc = rows_gemm_acc(a_ptr, b_ptr, row0, tl.minimum(BM, M - row0), tile % n_n * BN, K, N, s_bk, s_bn,
                                    BM, BN, BK, INPUT_PRECISION)
                owner = tile % world
                dst = heap_ptr(table_ptr, owner, land_offset, tl.float32) + (rank * M).to(tl.int64) * N
                tl.store(dst + at, acc, mask=m)
                notify(heap_ptr(sig_table_ptr, owner, 0, tl.int32) + sig_first + rank * n_tiles + tile, call_no)
            elif t < n_tiles + n_own:
                n_bad = 0
                for s in range(world):
                    i_sig = sig_first + s * n_tiles + tile
                    n_bad += (wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_GEMM_AR_PARTIAL, i_sig, budget)
                              == 0).to(tl.int32)
                if n_bad == 0:
                    # rank order, fp32, one cast: the sequential schedule's bits
                    res = sum_partials(land, at, m, M, N, world).to(y_ptr.dtype.element_ty).to(tl.float32)
                    for d in range(world):
                        dst = heap_ptr(table_ptr, d, land_offset, tl.float32) + (world * M).to(tl.int64) * N
                        tl.store(dst + at, res, mask=m)
                        notify(heap_ptr(sig_table_ptr, d, 0, tl.int32) + sig_first + world * n_tiles + tile, call_no)
            else:
                i_sig = sig_first + world * n_tiles + tile
                if wait(p_sig + i_sig, call_no, my_ctrl, rank, STAGE_GEMM_AR_RESULT, i_sig, budget):
                    res = tl.load(land + (world * M).to(tl.int64) * N + at, mask=m, other=0.0)
                    tl.store(y_ptr + at, res.to(y_ptr.dtype.element_ty), mask=m)
        t = next_task(my_ctrl)
    call_end(table_ptr, rank, call_no)


register_kernel(gemm_ar_kernel, REDUCING_SIG, {"BM": 128, "BN": 128, "BK": 64, "INPUT_PRECISION": "tf32"},
                label="bf16", options={"num_warps": 8, "num_stages": 2},
                multiples_of_16=["K", "N", "land_offset", "s_bk"])
