"""Grouped GEMM tiles of the MoE expert FFN (SwiGLU), Core level.

Rows are expert-major: the rows of local expert e are expert_off[e]:expert_off[e+1]. The FFN is
two grouped GEMMs with the activation fused into the first one's epilogue:

    h[r] = silu(a[r] @ W1[e][:, :I]) * (a[r] @ W1[e][:, I:])     W1: [E_local, H, 2I] (gate ‖ up)
    y[r] = h[r] @ W2[e]                                           W2: [E_local, I, H]

`swiglu_tile` and `down_tile` compute one output tile each; a persistent megakernel calls them
per task. `grouped_swiglu_kernel` / `grouped_down_kernel` are the standalone persistent kernels:
P programs, program p takes tiles p, p + P, ...; the tile map (expert, first row, row count of
every M-tile) is read from device memory, so a launch never waits on the host.

Tile ids walk the M-tiles in groups of `group_rows` (`grouped_tile`; plan.GEMM_TILE_ORDERS):
within a group one N-tile over the group's M-tiles, then the next N-tile. group_rows=1 is M-tile
major (consecutive tiles share one M-tile's A rows and walk one expert's weight columns): the
fastest order for the standalone kernels, whose program p takes tiles p, p + P, ...; the
megakernel hands tiles out as programs free up and walks them in groups of 8 (lowering.py).
No split-K: every output element is one fp32 dot over the whole K, so a tile's result does not
depend on which program computes it, on the grid size or on the tile order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditron_ep.compiler.core_config import GemmTileConfig, default_gemm_configs
from ditron_ep.language.registry import register_device_function, register_kernel

__all__ = ["build_tile_map", "down_acc", "down_tile", "grouped_down_kernel", "grouped_swiglu_kernel", "grouped_tile",
           "max_m_tiles",
           "register_ffn_configs", "swiglu_tile", "tile_coords", "zero_tile"]

_NO_TILE = tl.constexpr(2**31 - 1)  # tile_start padding: larger than any tile id


def build_tile_map(expert_offsets: torch.Tensor, block_m: int) -> torch.Tensor:
    """tile_start int32 [E_local + 1]: exclusive prefix sum of cdiv(rows of expert e, block_m).

    Device ops only (no host sync), on expert_offsets' device. tile_start[E_local] is the number
    of M-tiles; an expert without rows owns no tile.
    """
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
def swiglu_tile(
    a_ptr,      # (N, H) activations
    a_idx_ptr,  # int32 (rows,) row of a for each row (read when HAS_IDX)
    w1_ptr,     # (E_local, H, 2I) gate ‖ up
    h_ptr,      # out (rows, I), a's dtype
    e, row0, n_rows, n0, H, I,
    HAS_IDX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, IDX_STRIDE: tl.constexpr = 1,
):
    """h[row0 + i, n0:n0+BN] = silu(A_i @ W1[e][:, n0:n0+BN]) * (A_i @ W1[e][:, I+n0:I+n0+BN]) for
    i < n_rows, where A_i = a[a_idx[row0 + i]] (HAS_IDX: gathered in place, no copy) or a[row0 + i].

    The gate and up column blocks are loaded as one [BK, 2*BN] weight tile and multiplied in one
    tl.dot of width 2*BN (fp32 accumulator), split into its halves in the epilogue; activation in
    fp32, one cast to h's dtype. One dot of twice the width reads the A tile from shared memory
    once per K step instead of twice: 11 % faster than two [BK, BN] dots on an H200 at the layer
    shape, bit for bit the same (bench/results/gate_up_variants_H200_20261122_s8_8d5310e.log)."""
    o_m = tl.arange(0, BM)
    o_j = tl.arange(0, 2 * BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < n_rows
    col = n0 + o_j % BN + (o_j // BN) * I  # [gate n0:n0+BN | up I+n0:I+n0+BN] of W1[e]'s 2I columns
    m_j = n0 + o_j % BN < I
    if HAS_IDX:
        i_a = tl.load(a_idx_ptr + (row0 + o_m) * IDX_STRIDE, mask=m_m, other=0).to(tl.int64)  # [BM]
    else:
        i_a = (row0 + o_m).to(tl.int64)
    p_a = a_ptr + i_a[:, None] * H + o_k[None, :]  # [BM, BK]
    p_w = w1_ptr + e.to(tl.int64) * H * (2 * I) + o_k[:, None] * (2 * I) + col[None, :]  # [BK, 2BN]
    acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
    for k0 in range(0, H, BK):
        m_k = o_k < H - k0
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_w = tl.load(p_w, mask=m_k[:, None] & m_j[None, :], other=0.0)  # [BK, 2BN]
        acc = tl.dot(b_a, b_w, acc, input_precision=INPUT_PRECISION)
        p_a += BK
        p_w += BK * (2 * I)
    acc_g, acc_u = acc.reshape(BM, 2, BN).permute(0, 2, 1).split()  # [BM, BN] each
    b_h = acc_g * tl.sigmoid(acc_g) * acc_u  # [BM, BN] fp32
    o_n = n0 + tl.arange(0, BN)
    p_h = h_ptr + (row0 + o_m).to(tl.int64)[:, None] * I + o_n[None, :]
    tl.store(p_h, b_h.to(h_ptr.dtype.element_ty), mask=m_m[:, None] & (o_n < I)[None, :])


@register_device_function
@triton.jit
def down_acc(
    h_ptr,   # (rows, I)
    w2_ptr,  # (E_local, I, H)
    e, row0, n_rows, n0, I, H,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """fp32 [BM, BN] tile h[row0 + i] @ W2[e][:, n0:n0+BN] (rows i >= n_rows are zero)."""
    o_m = tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < n_rows
    m_n = o_n < H
    r = (row0 + o_m).to(tl.int64)
    p_h = h_ptr + r[:, None] * I + o_k[None, :]  # [BM, BK]
    p_w = w2_ptr + e.to(tl.int64) * I * H + o_k[:, None] * H + o_n[None, :]  # [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        m_k = o_k < I - k0
        b_h = tl.load(p_h, mask=m_m[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(b_h, b_w, acc, input_precision=INPUT_PRECISION)
        p_h += BK
        p_w += BK * H
    return acc


@register_device_function
@triton.jit
def down_tile(
    h_ptr,   # (rows, I)
    w2_ptr,  # (E_local, I, H)
    y_ptr,   # out (rows, H)
    e, row0, n_rows, n0, I, H,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    """y[row0 + i, n0:n0+BN] = h[row0 + i] @ W2[e][:, n0:n0+BN] for i < n_rows; fp32, cast once."""
    acc = down_acc(h_ptr, w2_ptr, e, row0, n_rows, n0, I, H, BM, BN, BK, INPUT_PRECISION)
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
def grouped_swiglu_kernel(
    a_ptr,           # (N, H) activations
    a_idx_ptr,       # int32 (rows_cap,) row of a for each row (read when HAS_IDX)
    w1_ptr,          # (E_local, H, 2I)
    h_ptr,           # out (rows_cap, I); rows >= expert_off[E_local] are not written
    tile_start_ptr,  # int32 (E_local + 1,) build_tile_map(expert_off, BM)
    expert_off_ptr,  # int32 (E_local + 1,)
    rows_cap, m_tiles_cap, H, I, E_local,
    group_rows,      # M-tiles a group of the tile order (grouped_tile)
    HAS_IDX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    n_n = tl.cdiv(I, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(tl.program_id(0), n_m * n_n, tl.num_programs(0)):
        t_m, t_n = grouped_tile(t, n_m, n_n, group_rows)
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E)
        swiglu_tile(a_ptr, a_idx_ptr, w1_ptr, h_ptr, e, row0, n_rows, t_n * BN, H, I,
                    HAS_IDX, BM, BN, BK, INPUT_PRECISION)


@triton.jit(do_not_specialize=["group_rows"])
def grouped_down_kernel(
    h_ptr,           # (rows_cap, I)
    w2_ptr,          # (E_local, I, H)
    y_ptr,           # out (rows_cap, H); rows >= expert_off[E_local] are set to zero
    tile_start_ptr,  # int32 (E_local + 1,) build_tile_map(expert_off, BM)
    expert_off_ptr,  # int32 (E_local + 1,)
    rows_cap, m_tiles_cap, I, H, E_local,
    group_rows,      # M-tiles a group of the tile order (grouped_tile)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    n_n = tl.cdiv(H, BN)
    n_m = tl.minimum(tl.load(tile_start_ptr + E_local), m_tiles_cap)
    for t in range(pid, n_m * n_n, n_prog):
        t_m, t_n = grouped_tile(t, n_m, n_n, group_rows)
        e, row0, n_rows = tile_coords(tile_start_ptr, expert_off_ptr, t_m, E_local, rows_cap, BM, BLOCK_E)
        down_tile(h_ptr, w2_ptr, y_ptr, e, row0, n_rows, t_n * BN, I, H, BM, BN, BK, INPUT_PRECISION)
    # Rows past the last expert belong to no expert: zero them (a separate loop keeps the branch
    # out of the pipelined one above).
    n_valid = tl.minimum(tl.maximum(tl.load(expert_off_ptr + E_local), 0), rows_cap)
    for t in range(pid, tl.cdiv(rows_cap - n_valid, BM) * n_n, n_prog):
        row0 = n_valid + (t // n_n) * BM
        zero_tile(y_ptr, row0, rows_cap - row0, (t % n_n) * BN, H, BM, BN)


# ---- compile signatures
_TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def register_ffn_configs(dtype: torch.dtype, gate_up: GemmTileConfig, down: GemmTileConfig, *, label: str,
                         shape: tuple[int, int] | None = None, has_idx: bool = True,
                         input_precision: str = "tf32", num_local_experts: int = 16) -> None:
    """Register one compile signature of each FFN kernel for the portability check.

    shape=(H, I) compiles them as constants. Launches specialise H and I (multiples of 16 in real
    models) as divisible by 16, and without that knowledge Triton does not pipeline the K-loop:
    a constant shape makes the check see the real shared-memory footprint.
    """
    ptr = _TRITON_TYPES[dtype]
    dims = {} if shape is None else {"H": shape[0], "I": shape[1]}
    ints = {name: "i32" for name in ("rows_cap", "m_tiles_cap", "E_local", "H", "I") if name not in dims}
    ints["group_rows"] = "i32"
    block_e = triton.next_power_of_2(num_local_experts)
    mult16 = [n for n in ("H", "I") if n not in dims]  # real hidden sizes are multiples of 16
    register_kernel(grouped_swiglu_kernel,
                    {"a_ptr": ptr, "a_idx_ptr": "*i32", "w1_ptr": ptr, "h_ptr": ptr, "tile_start_ptr": "*i32",
                     "expert_off_ptr": "*i32", **ints},
                    {**dims, "HAS_IDX": has_idx, "BM": gate_up.block_m, "BN": gate_up.block_n,
                     "BK": gate_up.block_k, "BLOCK_E": block_e, "INPUT_PRECISION": input_precision},
                    label=f"{label}{'-gather' if has_idx else ''} {gate_up}", options=gate_up.launch_options(),
                    multiples_of_16=mult16)
    register_kernel(grouped_down_kernel,
                    {"h_ptr": ptr, "w2_ptr": ptr, "y_ptr": ptr, "tile_start_ptr": "*i32", "expert_off_ptr": "*i32",
                     **ints},
                    {**dims, "BM": down.block_m, "BN": down.block_n, "BK": down.block_k, "BLOCK_E": block_e,
                     "INPUT_PRECISION": input_precision},
                    label=f"{label} {down}", options=down.launch_options(), multiples_of_16=mult16)


# Every signature is compiled for sm_90 and gfx942, so these are AMD's defaults (64 KiB LDS);
# tests/ops/test_grouped_ffn.py compiles NVIDIA's larger defaults for sm_90 alone.
register_ffn_configs(torch.bfloat16, *default_gemm_configs(torch.bfloat16, "hip"), label="bf16",
                     shape=(7168, 2048))
register_ffn_configs(torch.float32, *default_gemm_configs(torch.float32, "hip"), label="fp32-ieee",
                     has_idx=False, input_precision="ieee", num_local_experts=256)
