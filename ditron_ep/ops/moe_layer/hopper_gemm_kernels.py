"""Hopper (sm_90) fast path of the expert GEMMs, in Gluon (`triton.experimental.gluon`).

The same GEMMs as `grouped_gemm_kernels.py` (forward first GEMM with the activation in the
epilogue, second GEMM, the activation-gradient GEMM, dgrad, wgrad; a dense GEMM is the grouped
one with one expert), written with the levers `tl` does not expose:

* TMA loads of A and B tiles into NVMMA-swizzled shared memory, completion tracked per stage by
  an mbarrier (`expect` + transaction bytes);
* asynchronous `warpgroup_mma` with one MMA group in flight while the next stage's TMA is
  issued: stage s is refilled only after the MMA that read it retired
  (`warpgroup_mma_wait(num_outstanding=1)`);
* persistent programs with a fixed tile order (program p takes tiles p, p + P, ...) and one
  software pipeline that runs across tile boundaries: the loads of the next tile are in flight
  while the current tile finishes and stores its epilogue.

Determinism: every output element is one fp32 accumulation over its whole reduction, K-blocks in
order (no split-K, no atomics), so a tile's bits do not depend on which program computes it, on
the grid or on the tile order: each kernel is bitwise equal run to run and to its own sequential
schedule. The bits differ from the portable `tl` path's (wgmma's instruction shape and K order
within an instruction differ from `tl.dot`'s lowering); the two paths are not mixed in one plan.

Requirements (checked by `hopper_path.py` before a launch picks this path): bf16/fp16 operands,
K a multiple of BK (a K-block never crosses experts in the flattened weights), rows contiguous
with 16-byte aligned strides, weights whose [E, K, N] view flattens to [E*K, N] (or [E*N, K]
for the transposed reads). Rows of an M-tile past its expert's last row belong to the next
expert: the TMA reads them (a row-independent GEMM), the epilogue masks them out of every store.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ditron_ep.compiler.core_config import GemmTileConfig
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import act_fwd, act_grad, grouped_tile

__all__ = ["EPI_ACT_GRAD", "EPI_STORE", "EPI_UP", "hopper_rows_gemm_kernel", "hopper_wgrad_kernel", "mma_layout"]

EPI_STORE = gl.constexpr(0)     # out = acc (second GEMM, dgrad, dense)
EPI_UP = gl.constexpr(1)        # h = act(z) (gated: act(gate) * up), z saved when SAVE_Z
EPI_ACT_GRAD = gl.constexpr(2)  # dz = activation backward of dh = acc, h recomputed from z

_NO_TILE = gl.constexpr(2**31 - 1)


@gluon.constexpr_function
def mma_layout(BM, BN, num_warps):
    """The wgmma accumulator layout of a [BM, BN] tile: warps stacked along M first (4 warps, a
    warpgroup, per 64 rows), the widest instruction N (<= 256) that divides a warp's columns."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if BM > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n_reps = triton.cdiv(num_warps, triton.cdiv(BM, 16))
    max_n = max(BN // n_reps, 8)
    n = 256
    while n > max_n or BN % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.constexpr_function
def _vector_layout(num_warps):
    return gl.BlockedLayout([1], [32], [num_warps], [0])


@gluon.constexpr_function
def _rows_layout(BN, num_warps):
    """A blocked [rows, BN] layout for plain loads/stores: 8 contiguous elements a thread."""
    tpw_n = min(32, max(BN // 8, 1))
    return gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [num_warps, 1], [1, 0])


@register_device_function
@gluon.jit
def _tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM: gl.constexpr, BLOCK_E: gl.constexpr,
                 num_warps: gl.constexpr):
    """M-tile t_m -> (expert e, first row, rows <= BM): grouped_gemm_kernels.tile_coords in Gluon."""
    o_e = gl.arange(0, BLOCK_E, layout=_vector_layout(num_warps))
    b_ts = gl.load(tile_start_ptr + 1 + o_e, mask=o_e < E_local, other=_NO_TILE)
    e = gl.minimum(gl.sum((b_ts <= t_m).to(gl.int32), axis=0), E_local - 1)  # past-the-end tiles stay in bounds
    row0 = gl.load(expert_off_ptr + e) + (t_m - gl.load(tile_start_ptr + e)) * BM
    row_end = gl.minimum(gl.load(expert_off_ptr + e + 1), rows_cap)
    return e, row0, gl.where(row0 >= 0, gl.minimum(row_end - row0, BM), 0)


@register_device_function
@gluon.jit
def _rows_tile(q, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr, expert_off_ptr, E_local, rows_cap,
               BM: gl.constexpr, BN: gl.constexpr, BLOCK_E: gl.constexpr, num_warps: gl.constexpr):
    """The output tile of pipeline step q of this program: (expert, first row, rows, first column).
    Steps past the program's last tile (asked for by the look-ahead) give its last valid tile."""
    t = gl.maximum(gl.minimum(pid + (q // KS) * nprog, n_m * n_n - 1), 0)
    t_m, t_n = grouped_tile(t, gl.maximum(n_m, 1), n_n, group_rows)
    e, row0, n_rows = _tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E, num_warps)
    return e, row0, n_rows, t_n * BN


@register_device_function
@gluon.jit
def _issue_rows_load(a_desc, b_desc, bars, a_bufs, b_bufs, q, k, e, row0, n0, K, N, pred,
                     B_T: gl.constexpr, NJ: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of step q (K-block k of the tile at row0 / n0 of expert e) into stage q % STAGES.
    B_T: B is W[e]^T, W flattened [E*N, K], tile [BN, BK]; else W flattened [E*K, NJ*N], tile
    [BK, BN] (NJ = 2: the gate and up column blocks, N apart)."""
    s = q % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + NJ * b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_bufs.index(s), pred)
    if B_T:
        tma.async_copy_global_to_shared(b_desc, [e * N + n0, k], bar, b_bufs.index(s * NJ), pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [e * K + k, n0], bar, b_bufs.index(s * NJ), pred)
        if NJ == 2:
            tma.async_copy_global_to_shared(b_desc, [e * K + k, N + n0], bar, b_bufs.index(s * NJ + 1), pred)


@register_device_function
@gluon.jit
def _mma_step(a_bufs, b_bufs, s, acc, acc_u, use_acc, B_T: gl.constexpr, NJ: gl.constexpr):
    """Issue stage s's MMAs (A tile x B tile, read transposed when B_T; NJ = 2: the up columns into
    acc_u too) and wait until only they are in flight: the previous step's MMAs have retired."""
    if B_T:
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=use_acc, is_async=True)
    else:
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s * NJ), acc, use_acc=use_acc, is_async=True)
    if NJ == 2:
        acc_u = warpgroup_mma(a_bufs.index(s), b_bufs.index(s * NJ + 1), acc_u, use_acc=use_acc, is_async=True)
        acc, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_u))
    else:
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return acc, acc_u


@register_device_function
@gluon.jit
def _mma_drain(acc, acc_u, NJ: gl.constexpr):
    """Wait for every MMA in flight: the tile's accumulators are final."""
    if NJ == 2:
        acc, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_u))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return acc, acc_u


@gluon.jit
def hopper_rows_gemm_kernel(
    a_desc,          # A [rows_cap, K], block [BM, BK]
    b_desc,          # B_T: W [E*N, K], block [BN, BK]; else W [E*K, NJ*N], block [BK, BN]
    out_ptr,         # EPI_STORE: [rows_cap, N]; EPI_UP: h [rows_cap, N]; EPI_ACT_GRAD: dz [rows_cap, NJ*N]
    z_ptr,           # EPI_UP: z out [rows_cap, NJ*N] (SAVE_Z); EPI_ACT_GRAD: z in
    h_ptr,           # EPI_ACT_GRAD: h out [rows_cap, N]
    tile_start_ptr,  # int32 [E_local + 1] build_tile_map(expert_off, BM)
    expert_off_ptr,  # int32 [E_local + 1]
    rows_cap, m_tiles_cap, K, N, E_local, group_rows,
    B_T: gl.constexpr, EPI: gl.constexpr, ACT: gl.constexpr, SAVE_Z: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, BLOCK_E: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Row tiles [BM, BN] of every expert's rows times its weight (module docstring), K-blocks of
    all this program's tiles in one pipeline. NJ = 2 for the gated first GEMM (two accumulators:
    gate and up columns), else 1."""
    NJ: gl.constexpr = 2 if (EPI == EPI_UP) and (ACT < 2) else 1
    GATED: gl.constexpr = ACT < 2
    layout: gl.constexpr = mma_layout(BM, BN, num_warps)
    dtype: gl.constexpr = a_desc.dtype

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES * NJ] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_n = gl.cdiv(N, BN)
    n_m = gl.minimum(gl.load(tile_start_ptr + E_local), m_tiles_cap)
    n_tiles = n_m * n_n
    KS = gl.cdiv(K, BK)
    total = gl.cdiv(gl.maximum(n_tiles - pid, 0), nprog) * KS

    # load side: the tile of step ld_q, recomputed when ld_q enters a new tile
    ld_e, ld_row0, ld_rows, ld_n0 = _rows_tile(0, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr, expert_off_ptr,
                                               E_local, rows_cap, BM, BN, BLOCK_E, num_warps)
    for i in gl.static_range(STAGES - 1):
        _issue_rows_load(a_desc, b_desc, bars, a_bufs, b_bufs, i, (i % KS) * BK, ld_e, ld_row0, ld_n0, K, N,
                         i < total, B_T, NJ, STAGES)
        if (i + 1) % KS == 0:
            ld_e, ld_row0, ld_rows, ld_n0 = _rows_tile(i + 1, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr,
                                                       expert_off_ptr, E_local, rows_cap, BM, BN, BLOCK_E, num_warps)

    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    acc_u = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    q = 0
    # Tiles outer, K-blocks inner, the epilogue after the inner loop: ptxas then keeps one MMA
    # group in flight through the K loop (an epilogue branch inside it made ptxas wait for all
    # MMAs at every step)
    for _t in range(gl.cdiv(gl.maximum(n_tiles - pid, 0), nprog)):
        for kk in range(KS):
            s = q % STAGES
            mbarrier.wait(bars.index(s), (q // STAGES) & 1)
            acc, acc_u = _mma_step(a_bufs, b_bufs, s, acc, acc_u, kk > 0, B_T, NJ)
            # step q - 1's MMA has retired: its stage takes step q + STAGES - 1's loads
            lq = q + STAGES - 1
            if lq % KS == 0:
                ld_e, ld_row0, ld_rows, ld_n0 = _rows_tile(lq, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr,
                                                           expert_off_ptr, E_local, rows_cap, BM, BN, BLOCK_E,
                                                           num_warps)
            _issue_rows_load(a_desc, b_desc, bars, a_bufs, b_bufs, lq, (lq % KS) * BK, ld_e, ld_row0, ld_n0, K, N,
                             lq < total, B_T, NJ, STAGES)
            q += 1
        acc, acc_u = _mma_drain(acc, acc_u, NJ)
        e, row0, n_rows, n0 = _rows_tile(q - 1, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr, expert_off_ptr,
                                         E_local, rows_cap, BM, BN, BLOCK_E, num_warps)
        _rows_epilogue(acc, acc_u, out_ptr, z_ptr, h_ptr, row0, n_rows, n0, N, layout, EPI, ACT, SAVE_Z, NJ, GATED,
                       BM, BN)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    if EPI == EPI_STORE:
        _zero_rows_past_experts(out_ptr, expert_off_ptr, rows_cap, N, E_local, BM, BN, num_warps)


@register_device_function
@gluon.jit
def _rows_load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_start_ptr, expert_off_ptr, rows_cap,
                         m_tiles_cap, K, N, E_local, group_rows, B_T: gl.constexpr, NJ: gl.constexpr,
                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                         BLOCK_E: gl.constexpr):
    """Producer warp: the TMA loads of every step, in the consumers' order, into the stage the
    consumers last released (`empty`), completion on `ready`."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_n = gl.cdiv(N, BN)
    n_m = gl.minimum(gl.load(tile_start_ptr + E_local), m_tiles_cap)
    KS = gl.cdiv(K, BK)
    total = gl.cdiv(gl.maximum(n_m * n_n - pid, 0), nprog) * KS
    e = 0
    row0 = 0
    n0 = 0
    kk = 0
    for q in range(total):
        if kk == 0:
            e, row0, _rows, n0 = _rows_tile(q, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr, expert_off_ptr,
                                            E_local, rows_cap, BM, BN, BLOCK_E, 1)
        s = q % STAGES
        mbarrier.wait(empty.index(s), ((q // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        _issue_rows_load(a_desc, b_desc, ready, a_bufs, b_bufs, q, kk * BK, e, row0, n0, K, N, True, B_T, NJ, STAGES)
        kk += 1
        if kk == KS:
            kk = 0


@register_device_function
@gluon.jit
def _rows_mma_partition(a_bufs, b_bufs, ready, empty, out_ptr, z_ptr, h_ptr, tile_start_ptr, expert_off_ptr, rows_cap,
                        m_tiles_cap, K, N, E_local, group_rows, B_T: gl.constexpr, EPI: gl.constexpr,
                        ACT: gl.constexpr, SAVE_Z: gl.constexpr, NJ: gl.constexpr, BM: gl.constexpr,
                        BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, BLOCK_E: gl.constexpr,
                        num_warps: gl.constexpr):
    """Consumer warpgroups: the MMAs of every step (one group in flight), a stage released to
    the producer once the MMA that read it retired, the epilogue at each tile's last step."""
    GATED: gl.constexpr = ACT < 2
    layout: gl.constexpr = mma_layout(BM, BN, num_warps)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_n = gl.cdiv(N, BN)
    n_m = gl.minimum(gl.load(tile_start_ptr + E_local), m_tiles_cap)
    KS = gl.cdiv(K, BK)
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    acc_u = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    q = 0
    for _t in range(gl.cdiv(gl.maximum(n_m * n_n - pid, 0), nprog)):  # tiles outer (see hopper_rows_gemm_kernel)
        for kk in range(KS):
            s = q % STAGES
            mbarrier.wait(ready.index(s), (q // STAGES) & 1)
            acc, acc_u = _mma_step(a_bufs, b_bufs, s, acc, acc_u, kk > 0, B_T, NJ)
            if kk > 0:  # step q - 1's MMAs retired in both warpgroups: its stage goes back to the producer
                gl.thread_barrier()
                mbarrier.arrive(empty.index((q - 1) % STAGES), count=1)
            q += 1
        acc, acc_u = _mma_drain(acc, acc_u, NJ)
        gl.thread_barrier()
        mbarrier.arrive(empty.index((q - 1) % STAGES), count=1)
        e, row0, n_rows, n0 = _rows_tile(q - 1, pid, nprog, KS, n_m, n_n, group_rows, tile_start_ptr, expert_off_ptr,
                                         E_local, rows_cap, BM, BN, BLOCK_E, num_warps)
        _rows_epilogue(acc, acc_u, out_ptr, z_ptr, h_ptr, row0, n_rows, n0, N, layout, EPI, ACT, SAVE_Z, NJ, GATED,
                       BM, BN)


@gluon.jit
def hopper_rows_gemm_ws_kernel(
    a_desc, b_desc, out_ptr, z_ptr, h_ptr, tile_start_ptr, expert_off_ptr,
    rows_cap, m_tiles_cap, K, N, E_local, group_rows,
    B_T: gl.constexpr, EPI: gl.constexpr, ACT: gl.constexpr, SAVE_Z: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, BLOCK_E: gl.constexpr,
    num_warps: gl.constexpr,
):
    """hopper_rows_gemm_kernel, warp-specialized: one producer warp issues every TMA load
    (`_rows_load_partition`), the num_warps consumer warps run the MMAs and the epilogues
    (`_rows_mma_partition`); stages handed over through `ready` / `empty` mbarriers, so the
    consumers never wait on a CTA-wide barrier to issue a load. Same tiles, same order, same
    bits as hopper_rows_gemm_kernel."""
    NJ: gl.constexpr = 2 if (EPI == EPI_UP) and (ACT < 2) else 1
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES * NJ] + b_desc.block_type.shape, b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_rows_mma_partition, (a_bufs, b_bufs, ready, empty, out_ptr, z_ptr, h_ptr, tile_start_ptr, expert_off_ptr,
                               rows_cap, m_tiles_cap, K, N, E_local, group_rows, B_T, EPI, ACT, SAVE_Z, NJ, BM, BN,
                               BK, STAGES, BLOCK_E, num_warps)),
        (_rows_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_start_ptr, expert_off_ptr,
                                rows_cap, m_tiles_cap, K, N, E_local, group_rows, B_T, NJ, BM, BN, BK, STAGES,
                                BLOCK_E)),
    ], [1], [40])
    if EPI == EPI_STORE:
        _zero_rows_past_experts(out_ptr, expert_off_ptr, rows_cap, N, E_local, BM, BN, num_warps)


@register_device_function
@gluon.jit
def _rows_epilogue(acc, acc_u, out_ptr, z_ptr, h_ptr, row0, n_rows, n0, N, layout: gl.constexpr, EPI: gl.constexpr,
                   ACT: gl.constexpr, SAVE_Z: gl.constexpr, NJ: gl.constexpr, GATED: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr):
    """Masked stores of one finished tile (rows < n_rows, columns < N), fp32 math, one cast."""
    o_m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    o_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    r = (row0 + o_m).to(gl.int64)
    mask = (o_m < n_rows)[:, None] & (o_n < N)[None, :]
    if EPI == EPI_STORE:
        gl.store(out_ptr + r[:, None] * N + o_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif EPI == EPI_UP:
        zw = NJ * N
        if SAVE_Z:
            gl.store(z_ptr + r[:, None] * zw + o_n[None, :], acc.to(z_ptr.dtype.element_ty), mask=mask)
            if NJ == 2:
                gl.store(z_ptr + r[:, None] * zw + N + o_n[None, :], acc_u.to(z_ptr.dtype.element_ty), mask=mask)
        if NJ == 2:
            h = act_fwd(acc, ACT) * acc_u
        else:
            h = act_fwd(acc, ACT)
        gl.store(out_ptr + r[:, None] * N + o_n[None, :], h.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # EPI_ACT_GRAD: acc = dh over the N = I columns
        if GATED:
            zw = 2 * N
        else:
            zw = N
        p_z = z_ptr + r[:, None] * zw + o_n[None, :]
        p_dz = out_ptr + r[:, None] * zw + o_n[None, :]
        g = gl.load(p_z, mask=mask, other=0.0).to(gl.float32)
        a = act_fwd(g, ACT)
        if GATED:
            u = gl.load(p_z + N, mask=mask, other=0.0).to(gl.float32)
            gl.store(p_dz, (acc * u * act_grad(g, ACT)).to(out_ptr.dtype.element_ty), mask=mask)
            gl.store(p_dz + N, (acc * a).to(out_ptr.dtype.element_ty), mask=mask)
            h = a * u
        else:
            gl.store(p_dz, (acc * act_grad(g, ACT)).to(out_ptr.dtype.element_ty), mask=mask)
            h = a
        gl.store(h_ptr + r[:, None] * N + o_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@register_device_function
@gluon.jit
def _zero_rows_past_experts(y_ptr, expert_off_ptr, rows_cap, N, E_local, BM: gl.constexpr, BN: gl.constexpr,
                            num_warps: gl.constexpr):
    """y[r] = 0 for expert_off[E_local] <= r < rows_cap, tiles spread over the grid."""
    lay: gl.constexpr = _rows_layout(BN, num_warps)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_n = gl.cdiv(N, BN)
    n_valid = gl.minimum(gl.maximum(gl.load(expert_off_ptr + E_local), 0), rows_cap)
    o_m = gl.arange(0, BM, layout=gl.SliceLayout(1, lay))
    o_n = gl.arange(0, BN, layout=gl.SliceLayout(0, lay))
    zeros = gl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty, layout=lay)
    for t in range(pid, gl.cdiv(rows_cap - n_valid, BM) * n_n, nprog):
        r = n_valid + (t // n_n) * BM + o_m
        c = (t % n_n) * BN + o_n
        gl.store(y_ptr + r.to(gl.int64)[:, None] * N + c[None, :], zeros,
                 mask=(r < rows_cap)[:, None] & (c < N)[None, :])


# ---- wgrad: g[e] = a[R_e]^T @ b[R_e] per expert, its rows BK at a time in row order

@register_device_function
@gluon.jit
def _wgrad_tile(t, n_m, n_n, expert_off_ptr, rows_cap, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """Tile t (expert-major, as grouped_wgrad_kernel) -> (e, i0, j0, first row, end row, row blocks)."""
    e = t // (n_m * n_n)
    t_m = (t // n_n) % n_m
    t_n = t % n_n
    lo = gl.minimum(gl.maximum(gl.load(expert_off_ptr + e), 0), rows_cap)
    hi = gl.minimum(gl.maximum(gl.load(expert_off_ptr + e + 1), lo), rows_cap)
    return e, t_m * BM, t_n * BN, lo, hi, gl.cdiv(hi - lo, BK)


@register_device_function
@gluon.jit
def _wgrad_next(lt, lc, l_i0, l_j0, l_lo, l_nc, n_tiles, nprog, n_m, n_n, expert_off_ptr, rows_cap,
                BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """Advance the load side by one row block, passing over tiles without rows (empty experts)."""
    lc += 1
    while (lc >= l_nc) & (lt < n_tiles):  # no branch inside: a branch here made the loop irreducible
        lt += nprog
        lc = 0
        _e, l_i0, l_j0, l_lo, _hi, l_nc = _wgrad_tile(gl.minimum(lt, n_tiles - 1), n_m, n_n, expert_off_ptr, rows_cap,
                                                      BM, BN, BK)
    return lt, lc, l_i0, l_j0, l_lo, l_nc


@gluon.jit
def hopper_wgrad_kernel(
    a_desc,          # a [rows_cap, M], block [BK, BM]: the GEMM's input rows (x for W1, h for W2)
    b_desc,          # b [rows_cap, N], block [BK, BN]: the gradient of its output rows
    g_ptr,           # out [E_local, M, N]
    expert_off_ptr,  # int32 [E_local + 1]
    rows_cap, M, N, E_local,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """grouped_wgrad_kernel's weight gradients on Hopper: A^T read from shared memory through a
    transposed view. The last row block of an expert holds rows of the next one (or rows past
    the experts): its two tiles are masked to zero in shared memory before the MMA. An expert
    without rows gets zeros."""
    layout: gl.constexpr = mma_layout(BM, BN, num_warps)
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    a_lay: gl.constexpr = _rows_layout(BM, num_warps)
    b_lay: gl.constexpr = _rows_layout(BN, num_warps)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    n_m = gl.cdiv(M, BM)
    n_n = gl.cdiv(N, BN)
    n_tiles = E_local * n_m * n_n

    # load side: (tile lt, row block lc); starts one block before this program's first tile
    lt = pid
    lc = -1
    l_i0 = 0
    l_j0 = 0
    l_lo = 0
    l_nc = 0
    if lt < n_tiles:
        _e, l_i0, l_j0, l_lo, _hi, l_nc = _wgrad_tile(lt, n_m, n_n, expert_off_ptr, rows_cap, BM, BN, BK)
    lt, lc, l_i0, l_j0, l_lo, l_nc = _wgrad_next(lt, lc, l_i0, l_j0, l_lo, l_nc, n_tiles, nprog, n_m, n_n,
                                                 expert_off_ptr, rows_cap, BM, BN, BK)
    lq = 0
    for _p in gl.static_range(STAGES - 1):
        s = lq % STAGES
        pred = lt < n_tiles
        mbarrier.expect(bars.index(s), nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [l_lo + lc * BK, l_i0], bars.index(s), a_bufs.index(s), pred)
        tma.async_copy_global_to_shared(b_desc, [l_lo + lc * BK, l_j0], bars.index(s), b_bufs.index(s), pred)
        lq += 1
        lt, lc, l_i0, l_j0, l_lo, l_nc = _wgrad_next(lt, lc, l_i0, l_j0, l_lo, l_nc, n_tiles, nprog, n_m, n_n,
                                                     expert_off_ptr, rows_cap, BM, BN, BK)

    o_i = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    o_j = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    ka = gl.arange(0, BK, layout=gl.SliceLayout(1, a_lay))
    kb = gl.arange(0, BK, layout=gl.SliceLayout(1, b_lay))
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
    q = 0
    for t in range(pid, n_tiles, nprog):
        e, i0, j0, lo, hi, nc = _wgrad_tile(t, n_m, n_n, expert_off_ptr, rows_cap, BM, BN, BK)
        for c in range(nc):
            s = q % STAGES
            mbarrier.wait(bars.index(s), (q // STAGES) & 1)
            r_end = hi - (lo + c * BK)
            if r_end < BK:  # rows past the expert's last: zero them in both tiles
                a_s = a_bufs.index(s)
                b_s = b_bufs.index(s)
                va = a_s.load(a_lay)
                vb = b_s.load(b_lay)
                a_s.store(gl.where((ka < r_end)[:, None], va, gl.zeros_like(va)))
                b_s.store(gl.where((kb < r_end)[:, None], vb, gl.zeros_like(vb)))
                gl.thread_barrier()
                fence_async_shared()
            acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc, use_acc=c > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            ls = lq % STAGES
            pred = lt < n_tiles
            mbarrier.expect(bars.index(ls), nbytes, pred=pred)
            tma.async_copy_global_to_shared(a_desc, [l_lo + lc * BK, l_i0], bars.index(ls), a_bufs.index(ls), pred)
            tma.async_copy_global_to_shared(b_desc, [l_lo + lc * BK, l_j0], bars.index(ls), b_bufs.index(ls), pred)
            lq += 1
            lt, lc, l_i0, l_j0, l_lo, l_nc = _wgrad_next(lt, lc, l_i0, l_j0, l_lo, l_nc, n_tiles, nprog, n_m, n_n,
                                                         expert_off_ptr, rows_cap, BM, BN, BK)
            q += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if nc == 0:
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=layout)
        gi = i0 + o_i
        gj = j0 + o_j
        gl.store(g_ptr + e.to(gl.int64) * M * N + gi.to(gl.int64)[:, None] * N + gj[None, :],
                 acc.to(g_ptr.dtype.element_ty), mask=(gi < M)[:, None] & (gj < N)[None, :])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


# ---- compile signatures (portability check: sm_90 only, these kernels are Hopper's)

def tensordesc_type(dtype: str, block: list[int]) -> str:
    """The signature type of a TMA descriptor argument: `dtype` ("bf16") tiles of `block`."""
    elem = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{gl.NVMMASharedLayout.get_default_for(block, elem)!r}>"


def register_hopper_configs(dtype: str, configs: dict[str, GemmTileConfig], *, label: str,
                            num_local_experts: int = 32, warp_specialized: bool = False) -> None:
    """Register one compile signature of each Hopper kernel (hopper_path.HOPPER_KERNELS) with these
    tiles: the gated and a plain first GEMM, the second, act_grad, dgrad, wgrad."""
    rows_kernel = hopper_rows_gemm_ws_kernel if warp_specialized else hopper_rows_gemm_kernel
    ints = {n: "i32" for n in ("rows_cap", "m_tiles_cap", "K", "N", "E_local", "group_rows")}
    ptrs = {"out_ptr": f"*{dtype}", "z_ptr": f"*{dtype}", "h_ptr": f"*{dtype}", "tile_start_ptr": "*i32",
            "expert_off_ptr": "*i32"}
    block_e = triton.next_power_of_2(num_local_experts)
    for kernel, epi, act, b_t in (("up", 1, 0, False), ("up", 1, 2, False), ("down", 0, 0, False),
                                  ("act_grad", 2, 0, True), ("dgrad", 0, 0, True)):
        cfg = configs[kernel]
        bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
        register_kernel(rows_kernel,
                        {"a_desc": tensordesc_type(dtype, [bm, bk]),
                         "b_desc": tensordesc_type(dtype, [bn, bk] if b_t else [bk, bn]), **ptrs, **ints},
                        {"B_T": b_t, "EPI": epi, "ACT": act, "SAVE_Z": True, "BM": bm, "BN": bn, "BK": bk,
                         "STAGES": cfg.num_stages, "BLOCK_E": block_e, "num_warps": cfg.num_warps},
                        label=f"{label} {kernel}-act{act}{'-ws' if warp_specialized else ''} {cfg}",
                        options={"num_warps": cfg.num_warps}, multiples_of_16=["K", "N"], targets=("cuda:90",))
    cfg = configs["wgrad"]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    register_kernel(hopper_wgrad_kernel,
                    {"a_desc": tensordesc_type(dtype, [bk, bm]), "b_desc": tensordesc_type(dtype, [bk, bn]),
                     "g_ptr": f"*{dtype}", "expert_off_ptr": "*i32",
                     **{n: "i32" for n in ("rows_cap", "M", "N", "E_local")}},
                    {"BM": bm, "BN": bn, "BK": bk, "STAGES": cfg.num_stages, "num_warps": cfg.num_warps},
                    label=f"{label} wgrad {cfg}", options={"num_warps": cfg.num_warps}, multiples_of_16=["M", "N"],
                    targets=("cuda:90",))


def _hopper_defaults() -> dict[str, GemmTileConfig]:
    from ditron_ep.ops.moe_layer.hopper_path import default_hopper_configs
    return default_hopper_configs()


register_hopper_configs("bf16", _hopper_defaults(), label="bf16")
register_hopper_configs("bf16", _hopper_defaults(), label="bf16", warp_specialized=True)
