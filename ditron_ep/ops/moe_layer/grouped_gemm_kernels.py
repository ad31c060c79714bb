"""Grouped GEMM tiles of the MoE expert MLPs (experts.py: SwiGLU, GeGLU, GELU, ReLU, SiLU, with
optional biases), Core level, forward and backward.

Rows are expert-major: the rows of local expert e are expert_off[e]:expert_off[e+1]. The MLP is
two grouped GEMMs with the activation fused into the first one's epilogue:

    z[r] = a[r] @ W1[e] (+ b1[e]);  h[r] = act(gate) * up (gated) or act(z)    W1: [E_local, H, n*I]
    y[r] = h[r] @ W2[e] (+ b2[e])                                              W2: [E_local, I, H]

`up_tile` and `down_tile` compute one output tile each; a persistent megakernel calls them
per task. `grouped_up_kernel` / `grouped_down_kernel` are the standalone persistent kernels:
P programs, program p takes tiles p, p + P, ...; the tile map (expert, first row, row count of
every M-tile) is read from device memory, so a launch never waits on the host. The backward is
three more: `grouped_act_grad_kernel` (dh = dy @ W2^T with the activation's backward in the
epilogue), `grouped_dgrad_kernel` (dx = dz @ W1^T) and `grouped_wgrad_kernel` (a^T @ b per
expert over its rows in order, for both weights and the biases).

Tile ids walk the M-tiles in groups of `group_rows` (`grouped_tile`; plan.GEMM_TILE_ORDERS):
within a group one N-tile over the group's M-tiles, then the next N-tile. group_rows=1 is M-tile
major (consecutive tiles share one M-tile's A rows and walk one expert's weight columns): the
standalone kernels' order (program p takes tiles p, p + P, ...) unless a kernel's column tiles
fill half the grid, then groups of 8 (grouped.auto_group_rows says why); the megakernel hands
tiles out as programs free up and walks them in groups of 8 (lowering.py).
No split-K: every output element is one fp32 dot over the whole K, so a tile's result does not
depend on which program computes it, on the grid size or on the tile order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditron_ep.compiler.core_config import GemmTileConfig, default_backward_configs, default_gemm_configs
from ditron_ep.language.registry import register_device_function, register_kernel
from ditron_ep.runtime.fast_launch import fast

__all__ = ["act_fwd", "act_grad", "act_grad_parts", "build_tile_map", "down_acc", "down_tile", "grouped_act_grad_kernel", "grouped_dgrad_kernel",
           "grouped_down_kernel", "grouped_tile", "grouped_up_kernel", "grouped_wgrad_kernel",
           "max_m_tiles", "tile_map_kernel",
           "register_ffn_configs", "rows_gemm_acc", "tile_coords", "up_tile", "zero_tile"]

_NO_TILE = tl.constexpr(2**31 - 1)  # tile_start padding: larger than any tile id


@triton.jit
def tile_map_kernel(expert_off_ptr, tile_start_ptr, E_local, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """build_tile_map in one launch (one program): tile_start[0] = 0, tile_start[e + 1] = the
    M-tiles of experts 0..e, an expert's cdiv(max(rows, 0), BM)."""
    o_e = tl.arange(0, BLOCK_E)
    m = o_e < E_local
    rows = tl.load(expert_off_ptr + o_e + 1, mask=m, other=0) - tl.load(expert_off_ptr + o_e, mask=m, other=0)
    tiles = tl.where(m, (tl.maximum(rows, 0) + BM - 1) // BM, 0)
    tl.store(tile_start_ptr + o_e + 1, tl.cumsum(tiles, axis=0), mask=m)
    tl.store(tile_start_ptr, 0)


def build_tile_map(expert_offsets: torch.Tensor, block_m: int) -> torch.Tensor:
    """tile_start int32 [E_local + 1]: exclusive prefix sum of cdiv(rows of expert e, block_m).

    Device ops only (no host sync), on expert_offsets' device: on a GPU one launch
    (`tile_map_kernel`; the torch ops below are ~7 launches, host time a training step pays per
    map and tile height), on the CPU torch ops (an interpreted launch costs more there).
    tile_start[E_local] is the number of M-tiles; an expert without rows owns no tile.
    """
    if expert_offsets.is_cuda and expert_offsets.dtype == torch.int32:
        tile_start = torch.empty_like(expert_offsets)
        num_local = expert_offsets.shape[0] - 1
        fast(tile_map_kernel)[(1,)](expert_offsets, tile_start, num_local, BM=block_m,
                                    BLOCK_E=max(16, triton.next_power_of_2(num_local)))
        return tile_start
    counts = (expert_offsets[1:] - expert_offsets[:-1]).clamp_min(0)
    tile_start = torch.zeros_like(expert_offsets, dtype=torch.int32)
    torch.cumsum(torch.div(counts + (block_m - 1), block_m, rounding_mode="floor"), 0, dtype=torch.int32,
                 out=tile_start[1:])
    return tile_start


def max_m_tiles(rows_cap: int, num_local_experts: int, block_m: int) -> int:
    """Host bound on the M-tiles of any routing into rows_cap rows: each expert wastes < 1 tile."""
    return triton.cdiv(rows_cap, block_m) + num_local_experts


@register_device_function
@triton.jit
def tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap,
                BM: tl.constexpr, BLOCK_E: tl.constexpr):
    """M-tile t_m (< tile_start[E_local]) -> (expert e, first row row0, rows n_rows <= BM).

    e = #{j in 1..E_local : tile_start[j] <= t_m}: the expert whose tile range holds t_m (empty
    experts have empty ranges and are passed over). Rows are clamped to [0, rows_cap), so bad
    offsets cannot make a tile write out of bounds.
    """
    o_e = tl.arange(0, BLOCK_E)
    b_ts = tl.load(tile_start_ptr + 1 + o_e, mask=o_e < E_local, other=_NO_TILE)  # [BLOCK_E]
    e = tl.sum((b_ts <= t_m).to(tl.int32), axis=0)
    row0 = tl.load(expert_off_ptr + e) + (t_m - tl.load(tile_start_ptr + e)) * BM
    row_end = tl.minimum(tl.load(expert_off_ptr + e + 1), rows_cap)
    return e, row0, tl.where(row0 >= 0, tl.minimum(row_end - row0, BM), 0)


@register_device_function
@triton.jit
def grouped_tile(q, n_m, n_n, group):
    """q-th tile (0 <= q < n_m * n_n) of n_m M-tiles x n_n N-tiles walked in groups of `group`
    M-tiles (the last group may be short): within a group, N-tile by N-tile over the group's
    M-tiles. Returns (M-tile, N-tile). The megakernel decodes its GEMM tickets with it
    (tests/ops/test_gemm_tile_order.py checks that against the plan's StagePlan.coords)."""
    g = q // (group * n_n)
    r = q - g * (group * n_n)
    rows = tl.minimum(group, n_m - g * group)
    return g * group + r % rows, r // rows


@register_device_function
@triton.jit
def act_fwd(g, ACT: tl.constexpr):
    """fp32 activation (experts.ACT_CODES) of the gate (gated codes 0, 1) or of z (plain)."""
    if (ACT == 0) or (ACT == 5):  # swiglu's gate, silu
        return g * tl.sigmoid(g)
    elif (ACT == 1) or (ACT == 2):  # geglu's gate, gelu: exact (erf)
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 3:  # gelu_tanh: 0.5 * (1 + tanh(y)) = sigmoid(2y), y = sqrt(2/pi) * (g + 0.044715 g^3)
        return g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    else:  # relu
        return tl.maximum(g, 0.0)


@register_device_function
@triton.jit
def act_grad(g, ACT: tl.constexpr):
    """fp32 derivative of act_fwd at g."""
    if (ACT == 0) or (ACT == 5):
        s = tl.sigmoid(g)
        return s * (1.0 + g * (1.0 - s))
    elif (ACT == 1) or (ACT == 2):  # Phi(g) + g * phi(g)
        return 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476)) + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    elif ACT == 3:
        s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        return s + g * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    else:
        return tl.where(g > 0.0, 1.0, 0.0)


@register_device_function
@triton.jit
def up_tile(
    a_ptr,      # (N, H) activations
    a_idx_ptr,  # int32 (rows,) row of a for each row (read when HAS_IDX)
    w1_ptr,     # (E_local, H, NJ*I): gate ‖ up (gated, NJ = 2) or z's weights (plain, NJ = 1), any strides
    h_ptr,      # out (rows, I), a's dtype
    e, row0, n_rows, n0, H, I,
    s1e, s1k, s1n,  # w1's strides (elements): expert, H, NJ*I (a stride of 1 specialises to a constant)
    HAS_IDX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, IDX_STRIDE: tl.constexpr = 1, ACT: tl.constexpr = 0,
    b1_ptr=None,  # (E_local, NJ*I) bias (HAS_B1)
    z_ptr=None,   # out (rows, NJ*I): the pre-activation, a's dtype (SAVE_Z, for the backward)
    HAS_B1: tl.constexpr = False, SAVE_Z: tl.constexpr = False,
    s_ptr=None,   # fp32 (N, n_sc): per-128-column scales of an FP8 a (A_SCALES)
    n_sc=0,
    A_SCALES: tl.constexpr = False,
):
    """h[row0 + i, n0:n0+BN] = act(z) for i < n_rows, z = A_i @ W1[e] (+ b1[e]) over the tile's
    columns, where A_i = a[a_idx[row0 + i]] (HAS_IDX: gathered in place, no copy) or a[row0 + i].
    A_SCALES: a is FP8 (e4m3) with a fp32 scale per 128 columns, dequantised in the load — a * scale
    in fp32, cast once to W1's dtype, what the EP dispatch's dequantize-on-receipt writes — so the
    dot sees the same values (BK divides 128: one scale per row and K step).
    Gated activations (ACT 0, 1): h = act(gate) * up, the gate and up column blocks of W1 loaded
    as one [BK, 2*BN] weight tile and multiplied in one tl.dot of width 2*BN (fp32 accumulator),
    split into its halves in the epilogue. One dot of twice the width reads the A tile from
    shared memory once per K step instead of twice: 11 % faster than two [BK, BN] dots on an
    H200 at the layer shape, bit for bit the same (bench/results/gate_up_variants_H200_20261122_s8_8d5310e.log).
    Activation in fp32, one cast to h's dtype."""
    NJ: tl.constexpr = 2 if ACT < 2 else 1
    o_m = tl.arange(0, BM)
    o_j = tl.arange(0, NJ * BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < n_rows
    col = n0 + o_j % BN + (o_j // BN) * I  # gated: [gate n0:n0+BN | up I+n0:I+n0+BN] of W1[e]'s 2I columns
    m_j = n0 + o_j % BN < I
    if HAS_IDX:
        i_a = tl.load(a_idx_ptr + (row0 + o_m) * IDX_STRIDE, mask=m_m, other=0).to(tl.int64)  # [BM]
    else:
        i_a = (row0 + o_m).to(tl.int64)
    p_a = a_ptr + i_a[:, None] * H + o_k[None, :]  # [BM, BK]
    p_w = w1_ptr + e.to(tl.int64) * s1e + o_k[:, None] * s1k + col[None, :] * s1n  # [BK, NJ*BN]
    acc = tl.zeros((BM, NJ * BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        m_k = o_k < H - k0
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        if A_SCALES:
            b_s = tl.load(s_ptr + i_a * n_sc + k0 // 128, mask=m_m, other=0.0)  # [BM]
            b_a = (b_a.to(tl.float32) * b_s[:, None]).to(w1_ptr.dtype.element_ty)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_j[None, :], other=0.0)  # [BK, NJ*BN]
        acc = tl.dot(b_a, b_w, acc, input_precision=INPUT_PRECISION)
        p_a += BK
        p_w += BK * s1k
    if HAS_B1:
        acc += tl.load(b1_ptr + e.to(tl.int64) * (NJ * I) + col, mask=m_j, other=0.0).to(tl.float32)[None, :]
    r = (row0 + o_m).to(tl.int64)
    if SAVE_Z:
        tl.store(z_ptr + r[:, None] * (NJ * I) + col[None, :], acc.to(z_ptr.dtype.element_ty),
                 mask=m_m[:, None] & m_j[None, :])
    if NJ == 2:
        acc_g, acc_u = acc.reshape(BM, 2, BN).permute(0, 2, 1).split()  # [BM, BN] each
        b_h = act_fwd(acc_g, ACT) * acc_u  # [BM, BN] fp32
    else:
        b_h = act_fwd(acc, ACT)
    o_n = n0 + tl.arange(0, BN)
    tl.store(h_ptr + r[:, None] * I + o_n[None, :], b_h.to(h_ptr.dtype.element_ty),
             mask=m_m[:, None] & (o_n < I)[None, :])


@register_device_function
@triton.jit
def rows_gemm_acc(
    a_ptr,  # (rows, K) row-major
    b_ptr,  # B (K, N): element [k, n] at b_ptr + k * stride_bk + n * stride_bn
    row0, n_rows, n0, K, N, stride_bk, stride_bn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """fp32 [BM, BN] tile a[row0 + i, :K] @ B[:, n0:n0+BN] (rows i >= n_rows are zero): one fp32
    dot over the whole K, K-blocks in order. B may be any strided view (a transposed weight:
    stride_bk = 1), a stride of 1 specialising to a constant."""
    o_m = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < n_rows
    m_n = o_n < N
    r = (row0 + o_m).to(tl.int64)
    p_a = a_ptr + r[:, None] * K + o_k[None, :]  # [BM, BK]
    p_b = b_ptr + o_k[:, None] * stride_bk + o_n[None, :].to(tl.int64) * stride_bn  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = o_k < K - k0
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_b = tl.load(p_b, mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(b_a, b_b, acc, input_precision=INPUT_PRECISION)
        p_a += BK
        p_b += BK * stride_bk
    return acc


@register_device_function
@triton.jit
def down_acc(
    h_ptr,   # (rows, I)
    w2_ptr,  # (E_local, I, H), any strides
    e, row0, n_rows, n0, I, H,
    s2e, s2k, s2n,  # w2's strides (elements): expert, I, H
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    b2_ptr=None, HAS_B2: tl.constexpr = False,  # (E_local, H) bias
):
    """fp32 [BM, BN] tile h[row0 + i] @ W2[e][:, n0:n0+BN] (+ b2[e]); rows i >= n_rows are not
    meaningful (zero before the bias)."""
    acc = rows_gemm_acc(h_ptr, w2_ptr + e.to(tl.int64) * s2e, row0, n_rows, n0, I, H, s2k, s2n, BM, BN, BK,
                        INPUT_PRECISION)
    if HAS_B2:
        o_n = n0 + tl.arange(0, BN)
        acc += tl.load(b2_ptr + e.to(tl.int64) * H + o_n, mask=o_n < H, other=0.0).to(tl.float32)[None, :]
    return acc


@register_device_function
@triton.jit
def down_tile(
    h_ptr,   # (rows, I)
    w2_ptr,  # (E_local, I, H), any strides
    y_ptr,   # out (rows, H)
    e, row0, n_rows, n0, I, H, s2e, s2k, s2n,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    b2_ptr=None, HAS_B2: tl.constexpr = False,
):
    """y[row0 + i, n0:n0+BN] = h[row0 + i] @ W2[e][:, n0:n0+BN] (+ b2[e]) for i < n_rows; fp32, cast once."""
    acc = down_acc(h_ptr, w2_ptr, e, row0, n_rows, n0, I, H, s2e, s2k, s2n, BM, BN, BK, INPUT_PRECISION, b2_ptr,
                   HAS_B2)
    o_m = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BN)
    r = (row0 + o_m).to(tl.int64)
    tl.store(y_ptr + r[:, None] * H + o_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(o_m < n_rows)[:, None] & (o_n < H)[None, :])


@register_device_function
@triton.jit
def zero_tile(y_ptr, row0, n_rows, n0, N, BM: tl.constexpr, BN: tl.constexpr):
    """y[row0 + i, n0:n0+BN] = 0 for i < n_rows (y: (rows, N))."""
    o_m = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BN)
    r = (row0 + o_m).to(tl.int64)
    tl.store(y_ptr + r[:, None] * N + o_n[None, :], tl.zeros((BM, BN), dtype=y_ptr.dtype.element_ty),
             mask=(o_m < n_rows)[:, None] & (o_n < N)[None, :])


# group_rows stays an argument even when 1 (no recompile per order)
@triton.jit(do_not_specialize=["group_rows"])
def grouped_up_kernel(
    a_ptr,           # (N, H) activations
    a_idx_ptr,       # int32 (rows_cap,) row of a for each row (read when HAS_IDX)
    w1_ptr,          # (E_local, H, NJ*I)
    b1_ptr,          # (E_local, NJ*I) (read when HAS_B1)
    h_ptr,           # out (rows_cap, I); rows >= expert_off[E_local] are not written
    z_ptr,           # out (rows_cap, NJ*I) pre-activation (written when SAVE_Z)
    s_ptr,           # fp32 (N, H / 128) scales of an FP8 a (read when A_SCALES)
    tile_start_ptr,  # int32 (E_local + 1,) build_tile_map(expert_off, BM)
    expert_off_ptr,  # int32 (E_local + 1,)
    rows_cap, m_tiles_cap, H, I, E_local,
    group_rows,      # M-tiles a group of the tile order (grouped_tile)
    s1e, s1k, s1n,   # w1's strides
    HAS_IDX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, ACT: tl.constexpr = 0, HAS_B1: tl.constexpr = False,
    SAVE_Z: tl.constexpr = False, A_SCALES: tl.constexpr = False,
):
    n_n = tl.cdiv(I, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
        t_m, t_n = grouped_tile(t, n_m, n_n, group_rows)
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E)
        up_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, t_n * BN, H, I, s1e, s1k, s1n,
                HAS_IDX, BM, BN, BK, INPUT_PRECISION, 1, ACT, b1_ptr, z_ptr, HAS_B1, SAVE_Z, s_ptr, H // 128,
                A_SCALES)


@triton.jit(do_not_specialize=["group_rows"])
def grouped_down_kernel(
    h_ptr,           # (rows_cap, I)
    w2_ptr,          # (E_local, I, H)
    b2_ptr,          # (E_local, H) (read when HAS_B2)
    y_ptr,           # out (rows_cap, H); rows >= expert_off[E_local] are set to zero
    tile_start_ptr,  # int32 (E_local + 1,) build_tile_map(expert_off, BM)
    expert_off_ptr,  # int32 (E_local + 1,)
    rows_cap, m_tiles_cap, I, H, E_local,
    group_rows,      # M-tiles a group of the tile order (grouped_tile)
    s2e, s2k, s2n,   # w2's strides
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, HAS_B2: tl.constexpr = False,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_n = tl.cdiv(H, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(pid, n_m * n_n, n_prog):
        t_m, t_n = grouped_tile(t, n_m, n_n, group_rows)
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E)
        down_tile(h_ptr, w2_ptr, y_ptr, e, row0, n_rows, t_n * BN, I, H, s2e, s2k, s2n, BM, BN, BK,
                  INPUT_PRECISION, b2_ptr, HAS_B2)
    # Rows past the last expert belong to no expert: zero them (a separate loop keeps the branch
    # out of the pipelined one above).
    _zero_rows_past_experts(y_ptr, expert_off_ptr, rows_cap, H, E_local, BM, BN)


@register_device_function
@triton.jit
def _zero_rows_past_experts(y_ptr, expert_off_ptr, rows_cap, N, E_local, BM: tl.constexpr, BN: tl.constexpr):
    """y[r] = 0 for expert_off[E_local] <= r < rows_cap (y: (rows_cap, N)), tiles spread over the grid."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_n = tl.cdiv(N, BN)
    n_valid = tl.minimum(tl.maximum(tl.load(expert_off_ptr + E_local), 0), rows_cap)
    for t in range(pid, tl.cdiv(rows_cap - n_valid, BM) * n_n, n_prog):
        row0 = n_valid + (t // n_n) * BM
        zero_tile(y_ptr, row0, rows_cap - row0, (t % n_n) * BN, N, BM, BN)


# ---- backward (dgrad and wgrad of both expert GEMMs): staged launches, each output tile one
# fp32 dot over its whole reduction in a fixed order, so bitwise equal for any grid size.

@register_device_function
@triton.jit
def act_grad_epilogue(dh, z_ptr, dz_ptr, h_ptr, r, n0, n_rows, I, BM: tl.constexpr, BN: tl.constexpr,
                      ACT: tl.constexpr):
    """The activation's backward on a [BM, BN] tile of dh (fp32) at columns n0..n0+BN of rows r:
    gated: dgate = dh * up * act'(gate), dup = dh * act(gate); plain: dz = dh * act'(z); and h
    recomputed from z."""
    NJ: tl.constexpr = 2 if ACT < 2 else 1
    o_m = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BN)
    m = (o_m < n_rows)[:, None] & (o_n < I)[None, :]
    p_z = z_ptr + r[:, None] * (NJ * I) + o_n[None, :]
    p_dz = dz_ptr + r[:, None] * (NJ * I) + o_n[None, :]
    g = tl.load(p_z, mask=m, other=0.0).to(tl.float32)
    a = act_fwd(g, ACT)
    if NJ == 2:
        u = tl.load(p_z + I, mask=m, other=0.0).to(tl.float32)
        tl.store(p_dz, (dh * u * act_grad(g, ACT)).to(dz_ptr.dtype.element_ty), mask=m)
        tl.store(p_dz + I, (dh * a).to(dz_ptr.dtype.element_ty), mask=m)
        b_h = a * u
    else:
        tl.store(p_dz, (dh * act_grad(g, ACT)).to(dz_ptr.dtype.element_ty), mask=m)
        b_h = a
    tl.store(h_ptr + r[:, None] * I + o_n[None, :], b_h.to(h_ptr.dtype.element_ty), mask=m)


@register_device_function
@triton.jit
def act_grad_epilogue_halves(dh, z_ptr, dz_ptr, h_ptr, r, n0, n_rows, I, BM: tl.constexpr, BN: tl.constexpr,
                             ACT: tl.constexpr):
    """act_grad_epilogue on the left, then the right half of dh's BN columns (fewer fp32 values
    live at once: the whole tile's spilled registers)."""
    HALF: tl.constexpr = BN // 2
    lo, hi = dh.reshape(BM, 2, HALF).permute(0, 2, 1).split()
    act_grad_epilogue(lo, z_ptr, dz_ptr, h_ptr, r, n0, n_rows, I, BM, HALF, ACT)
    act_grad_epilogue(hi, z_ptr, dz_ptr, h_ptr, r, n0 + HALF, n_rows, I, BM, HALF, ACT)


def act_grad_parts(block_n: int) -> int:
    """grouped_act_grad_kernel's EPILOGUE_PARTS for a tile of block_n columns: quarters from 256 up.
    A 128 x 256 tile's dh, gate, up and their products in fp32 at once spilled 3,776 bytes a
    thread (sm_90), halves 472, quarters 8: 4,525 / 2,157 / 1,838 us at the layer shape on an H100,
    bitwise equal (its GEMM alone 1,718; bench/results/act_grad_parts_H100_20261127_s24_96260f9.log)."""
    return 4 if block_n >= 256 else 1


@triton.jit(do_not_specialize=["group_rows"])
def grouped_act_grad_kernel(
    dy_ptr,          # (rows_cap, H) gradient of the expert outputs
    w2_ptr,          # (E_local, I, H)
    z_ptr,           # (rows_cap, NJ*I) pre-activation saved (or recomputed) by the forward
    dz_ptr,          # out (rows_cap, NJ*I): gradient of the pre-activation
    h_ptr,           # out (rows_cap, I): the activation recomputed from z (wgrad of W2 reads it)
    tile_start_ptr, expert_off_ptr,
    rows_cap, m_tiles_cap, H, I, E_local,
    group_rows,
    s2e, s2k, s2n,   # w2's strides
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, ACT: tl.constexpr = 0, EPILOGUE_PARTS: tl.constexpr = 1,
):
    """dh = dy @ W2[e]^T per row tile (K = H), the activation's backward fused in the epilogue
    (act_grad_epilogue) on EPILOGUE_PARTS (1, 2 or 4) column blocks of the tile in turn."""
    tl.static_assert((EPILOGUE_PARTS == 1) or (EPILOGUE_PARTS == 2) or (EPILOGUE_PARTS == 4))
    n_n = tl.cdiv(I, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
        t_m, t_n = grouped_tile(t, n_m, n_n, group_rows)
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E)
        n0 = t_n * BN
        dh = rows_gemm_acc(dy_ptr, w2_ptr + e.to(tl.int64) * s2e, row0, n_rows, n0, H, I, s2n, s2k, BM, BN, BK,
                           INPUT_PRECISION)  # [BM, BN] fp32: W2[e] read transposed
        r = (row0 + tl.arange(0, BM)).to(tl.int64)
        if EPILOGUE_PARTS == 1:
            act_grad_epilogue(dh, z_ptr, dz_ptr, h_ptr, r, n0, n_rows, I, BM, BN, ACT)
        elif EPILOGUE_PARTS == 2:
            act_grad_epilogue_halves(dh, z_ptr, dz_ptr, h_ptr, r, n0, n_rows, I, BM, BN, ACT)
        else:  # quarters: each half in halves
            HALF: tl.constexpr = BN // 2
            lo, hi = dh.reshape(BM, 2, HALF).permute(0, 2, 1).split()
            act_grad_epilogue_halves(lo, z_ptr, dz_ptr, h_ptr, r, n0, n_rows, I, BM, HALF, ACT)
            act_grad_epilogue_halves(hi, z_ptr, dz_ptr, h_ptr, r, n0 + HALF, n_rows, I, BM, HALF, ACT)


@triton.jit(do_not_specialize=["group_rows"])
def grouped_dgrad_kernel(
    dz_ptr,          # (rows_cap, K) gradient of the pre-activation
    w_ptr,           # (E_local, N, K): W1, read transposed
    dx_ptr,          # out (rows_cap, N); rows >= expert_off[E_local] are set to zero
    tile_start_ptr, expert_off_ptr,
    rows_cap, m_tiles_cap, K, N, E_local,
    group_rows,
    s1e, s1k, s1n,   # W1's strides (its [N, K] element [n, k] at e*s1e + n*s1k + k*s1n)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    """dx[r] = dz[r] @ W1[e]^T for the rows of every expert (gathered-row gradients)."""
    n_n = tl.cdiv(N, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
        t_m, t_n = grouped_tile(t, n_m, n_n, group_rows)
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E)
        n0 = t_n * BN
        acc = rows_gemm_acc(dz_ptr, w_ptr + e.to(tl.int64) * s1e, row0, n_rows, n0, K, N, s1n, s1k, BM, BN, BK,
                            INPUT_PRECISION)
        o_m = tl.arange(0, BM)
        o_n = n0 + tl.arange(0, BN)
        r = (row0 + o_m).to(tl.int64)
        tl.store(dx_ptr + r[:, None] * N + o_n[None, :], acc.to(dx_ptr.dtype.element_ty),
                 mask=(o_m < n_rows)[:, None] & (o_n < N)[None, :])
    _zero_rows_past_experts(dx_ptr, expert_off_ptr, rows_cap, N, E_local, BM, BN)


@triton.jit
def grouped_wgrad_kernel(
    a_ptr,           # (rows_cap, M) the GEMM's input rows (x for W1, h for W2)
    b_ptr,           # (rows_cap, N) the gradient of its output rows (dz for W1, dy for W2)
    g_ptr,           # out (E_local, M, N): g[e] = a[R_e]^T @ b[R_e]
    gb_ptr,          # out fp32-or-g's dtype (E_local, N): gb[e] = sum over R_e of b (HAS_BIAS)
    expert_off_ptr,  # int32 (E_local + 1,): R_e = expert_off[e]:expert_off[e+1]
    rows_cap, M, N, E_local,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
    """Weight (and bias) gradients, one [BM, BN] tile of one expert per task: the expert's rows
    walked BK at a time in row order, i.e. in the dispatch's fixed (source rank, source token)
    order, into one fp32 accumulator. No atomics, no split of the rows: bitwise run to run and
    for every grid size. An expert without rows gets zeros."""
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    o_i = tl.arange(0, BM)
    o_j = tl.arange(0, BN)
    o_r = tl.arange(0, BK)
    for t in range(tl.program_id(0), E_local * n_m * n_n, tl.num_programs(0)):
        e = t // (n_m * n_n)
        t_m = (t // n_n) % n_m
        t_n = t % n_n
        lo = tl.minimum(tl.maximum(tl.load(expert_off_ptr + e), 0), rows_cap)
        hi = tl.minimum(tl.maximum(tl.load(expert_off_ptr + e + 1), lo), rows_cap)
        i = t_m * BM + o_i
        j = t_n * BN + o_j
        m_i = i < M
        m_j = j < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        b_sum = tl.zeros((BN,), dtype=tl.float32)
        for r0 in range(lo, hi, BK):
            r = (r0 + o_r).to(tl.int64)
            m_r = r < hi
            b_a = tl.load(a_ptr + r[:, None] * M + i[None, :], mask=m_r[:, None] & m_i[None, :], other=0.0)  # [BK, BM]
            b_b = tl.load(b_ptr + r[:, None] * N + j[None, :], mask=m_r[:, None] & m_j[None, :], other=0.0)  # [BK, BN]
            acc = tl.dot(tl.trans(b_a), b_b, acc, input_precision=INPUT_PRECISION)
            if HAS_BIAS:
                if t_m == 0:  # one row of tiles sums the bias gradient (uniform branch)
                    b_sum += tl.sum(b_b.to(tl.float32), axis=0)
        e64 = e.to(tl.int64)
        tl.store(g_ptr + e64 * M * N + i.to(tl.int64)[:, None] * N + j[None, :], acc.to(g_ptr.dtype.element_ty),
                 mask=m_i[:, None] & m_j[None, :])
        if HAS_BIAS:
            tl.store(gb_ptr + e64 * N + j, b_sum.to(gb_ptr.dtype.element_ty), mask=m_j & (t_m == 0))


# ---- compile signatures
_TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def register_ffn_configs(dtype: torch.dtype, gate_up: GemmTileConfig, down: GemmTileConfig, *, label: str,
                         shape: tuple[int, int] | None = None, has_idx: bool = True,
                         input_precision: str = "tf32", num_local_experts: int = 16, activation: int = 0,
                         biases: bool = False, backward: dict[str, GemmTileConfig] | None = None,
                         fp8_a: bool = False, targets: tuple[str, ...] | None = None) -> None:
    """Register one compile signature of each FFN kernel (and, `backward`, of each backward
    kernel, with these tiles: core_config.default_backward_configs) for the portability check.
    activation: an experts.ACT_CODES code; biases: b1 / b2 read (forward) and bias gradients
    written (wgrad); the forward saves z when `backward`; fp8_a: the first GEMM reads e4m3 rows
    with their scales (grouped_mlp(x_scales=)); targets: the portability targets (default all).

    shape=(H, I) compiles them as constants. Launches specialise H and I (multiples of 16 in real
    models) as divisible by 16, and without that knowledge Triton does not pipeline the K-loop:
    a constant shape makes the check see the real shared-memory footprint.
    """
    ptr = _TRITON_TYPES[dtype]
    dims = {} if shape is None else {"H": shape[0], "I": shape[1]}
    ints = {name: "i32" for name in ("rows_cap", "m_tiles_cap", "E_local", "H", "I") if name not in dims}
    ints["group_rows"] = "i32"
    w1s = {"s1e": "i32", "s1k": "i32"}   # s1n = 1 (contiguous weights): a constant, as launches specialise it
    w2s = {"s2e": "i32", "s2k": "i32"}
    block_e = triton.next_power_of_2(num_local_experts)
    mult16 = [n for n in ("H", "I") if n not in dims]  # real hidden sizes are multiples of 16
    w1_16, w2_16 = [*mult16, "s1e", "s1k"], [*mult16, "s2e", "s2k"]  # so are the weights' strides
    maps = {"tile_start_ptr": "*i32", "expert_off_ptr": "*i32"}
    tiles = {"BLOCK_E": block_e, "INPUT_PRECISION": input_precision}
    act = f"-act{activation}{'-bias' if biases else ''}"

    def blocks(cfg: GemmTileConfig) -> dict:
        return {"BM": cfg.block_m, "BN": cfg.block_n, "BK": cfg.block_k}

    where = {} if targets is None else {"targets": targets}
    register_kernel(grouped_up_kernel,
                    {"a_ptr": "*fp8e4nv" if fp8_a else ptr, "a_idx_ptr": "*i32", "w1_ptr": ptr, "b1_ptr": ptr,
                     "h_ptr": ptr, "z_ptr": ptr, "s_ptr": "*fp32", **maps, **ints, **w1s},
                    {**dims, "s1n": 1, "HAS_IDX": has_idx, **blocks(gate_up), **tiles, "ACT": activation, "HAS_B1": biases,
                     "SAVE_Z": backward is not None, "A_SCALES": fp8_a},
                    label=f"{label}{'-gather' if has_idx else ''}{act} {gate_up}", options=gate_up.launch_options(),
                    multiples_of_16=w1_16, **where)
    if fp8_a:  # the rest reads h, z and gradients in the weights' dtype: registered with it
        return
    register_kernel(grouped_down_kernel,
                    {"h_ptr": ptr, "w2_ptr": ptr, "b2_ptr": ptr, "y_ptr": ptr, **maps, **ints, **w2s},
                    {**dims, "s2n": 1, **blocks(down), **tiles, "HAS_B2": biases},
                    label=f"{label}{act} {down}", options=down.launch_options(), multiples_of_16=w2_16, **where)
    if backward is None:
        return
    ag, dg, wg = backward["act_grad"], backward["dgrad"], backward["wgrad"]
    register_kernel(grouped_act_grad_kernel,
                    {"dy_ptr": ptr, "w2_ptr": ptr, "z_ptr": ptr, "dz_ptr": ptr, "h_ptr": ptr, **maps, **ints, **w2s},
                    {**dims, "s2n": 1, **blocks(ag), **tiles, "ACT": activation,
                     "EPILOGUE_PARTS": act_grad_parts(ag.block_n)},
                    label=f"{label}{act} act-grad {ag}", options=ag.launch_options(), multiples_of_16=w2_16)
    dgrad_ints = {n: "i32" for n in ("rows_cap", "m_tiles_cap", "K", "N", "E_local", "group_rows")}
    register_kernel(grouped_dgrad_kernel, {"dz_ptr": ptr, "w_ptr": ptr, "dx_ptr": ptr, **maps, **dgrad_ints, **w1s},
                    {"s1n": 1, **blocks(dg), **tiles},
                    label=f"{label} dgrad {dg}", options=dg.launch_options(),
                    multiples_of_16=["K", "N", "s1e", "s1k"])
    register_kernel(grouped_wgrad_kernel,
                    {"a_ptr": ptr, "b_ptr": ptr, "g_ptr": ptr, "gb_ptr": ptr, "expert_off_ptr": "*i32",
                     **{n: "i32" for n in ("rows_cap", "M", "N", "E_local")}},
                    {**blocks(wg), "INPUT_PRECISION": input_precision, "HAS_BIAS": biases},
                    label=f"{label}{act} wgrad {wg}", options=wg.launch_options(), multiples_of_16=["M", "N"])


# Every signature is compiled for sm_90 and gfx942, so these are AMD's defaults (64 KiB LDS);
# tests/ops/test_grouped_mlp.py compiles NVIDIA's larger defaults for sm_90 alone.
register_ffn_configs(torch.bfloat16, *default_gemm_configs(torch.bfloat16, "hip"), label="bf16",
                     shape=(7168, 2048), backward=default_backward_configs(torch.bfloat16, "hip"))
register_ffn_configs(torch.float32, *default_gemm_configs(torch.float32, "hip"), label="fp32-ieee",
                     has_idx=False, input_precision="ieee", num_local_experts=256, activation=3, biases=True,
                     backward=default_backward_configs(torch.float32, "hip"))
# FP8 rows as the EP dispatch delivers them (token-major, gathered by row_index), e4m3 + scales:
# NVIDIA's e4m3 (AMD's gfx942 has the fnuz variants)
register_ffn_configs(torch.bfloat16, *default_gemm_configs(torch.bfloat16, "hip"), label="fp8-bf16",
                     shape=(7168, 2048), fp8_a=True, targets=("cuda:90",))
register_kernel(tile_map_kernel, {"expert_off_ptr": "*i32", "tile_start_ptr": "*i32", "E_local": "i32"},
                {"BM": 128, "BLOCK_E": 32}, label="tile-map")
