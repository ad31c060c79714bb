"""Launchers of the Hopper fast path (`hopper_gemm_kernels.py`) and the rule that picks it.

A call runs on the Hopper path when `path_problem` finds nothing against it: a compiled (not
interpreted) sm_90 device, bf16/fp16, rows read in place (no row_index), weights whose last
dimension is contiguous and whose [E, K, N] view flattens to [E*K, N] (torch.stack of
contiguous weights, or a slice of one), 16-byte aligned, and every reduction dimension a
multiple of the tile's BK. Anything else runs on the portable `tl` kernels; `path="hopper"`
then raises saying what stands in the way. The choice depends on shapes, dtypes and the device
only, so every rank of a homogeneous job takes the same path (and gets the same bits).
"""
from __future__ import annotations

import torch
import triton

from ditron_ep.compiler.core_config import EXPERT_GEMMS, GemmTileConfig
from ditron_ep.runtime.mode import kernels_interpreted

__all__ = ["HOPPER_KERNELS", "PATHS", "default_hopper_configs", "device_problem", "launch_act_grad", "launch_dgrad",
           "launch_down", "launch_up", "launch_wgrad", "path_problem", "weight_problem"]

PATHS = ("auto", "portable", "hopper")
HOPPER_KERNELS = EXPERT_GEMMS  # the Hopper path has a kernel for each
WARP_SPECIALIZED = True  # row GEMMs: one producer warp + consumer warpgroups (else all warps do both)

# Starting tiles (the tuner, compiler/tuner.py, may replace them per shape): 128-row tiles over
# two warpgroups, 64-wide K-blocks (128 B rows: the 128-byte swizzle), as many stages as 227 KiB
# of shared memory holds. The gated first GEMM keeps two [128, 128] accumulators (gate, up);
# plain activations and act_grad use 128 columns too (erf/tanh epilogues spill at 256).
_HOPPER_DEFAULTS = {
    "up": GemmTileConfig(128, 128, 64, 8, 4),
    "down": GemmTileConfig(128, 256, 64, 8, 4),
    "act_grad": GemmTileConfig(128, 128, 64, 8, 4),
    "dgrad": GemmTileConfig(128, 256, 64, 8, 4),
    "wgrad": GemmTileConfig(128, 256, 64, 8, 3),
}


def default_hopper_configs() -> dict[str, GemmTileConfig]:
    """Tile config of each Hopper kernel (HOPPER_KERNELS) when no tuned choice applies."""
    return dict(_HOPPER_DEFAULTS)


def device_problem(device: torch.device) -> str | None:
    """Why this device cannot run the Hopper kernels (None: it can)."""
    if device.type != "cuda" or kernels_interpreted():
        return "the Hopper path needs a CUDA device with compiled kernels (not the Triton interpreter)"
    if torch.version.hip is not None:
        return "the Hopper path is NVIDIA-only (wgmma/TMA); ROCm runs the portable path"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the Hopper path needs an sm_90 GPU (H100/H200), this one is sm_{major}{minor}"
    return None


def weight_problem(name: str, w: torch.Tensor) -> str | None:
    """Why the [E, K, N] weight `w` cannot be read by TMA as one [E*K, N] matrix (None: it can)."""
    e, k, n = w.shape
    if w.stride(2) != 1:
        return f"{name}'s last dimension is not contiguous (strides {tuple(w.stride())})"
    if e > 1 and w.stride(0) != k * w.stride(1):
        return (f"{name}'s experts are not back to back (strides {tuple(w.stride())}, shape {tuple(w.shape)}): "
                f"stack them into one tensor")
    if (w.stride(1) * w.element_size()) % 16 or w.data_ptr() % 16:
        return f"{name} is not 16-byte aligned (TMA): its row stride {w.stride(1)} or its address"
    return None


def path_problem(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, row_index: torch.Tensor | None,
                 configs: dict[str, GemmTileConfig]) -> str | None:
    """Why the grouped MLP on these inputs cannot take the Hopper path (None: it can)."""
    problem = device_problem(x.device)
    if problem:
        return problem
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"the Hopper path computes bf16/fp16 (wgmma), got {x.dtype}"
    if row_index is not None:
        return "rows gathered through row_index are read by the portable path; gather them first"
    hidden, width, inter = w1.shape[1], w1.shape[2], w2.shape[1]
    for name, w in (("w1", w1), ("w2", w2)):
        problem = weight_problem(name, w)
        if problem:
            return problem
    for kernel, k_dim, what in (("up", hidden, "H"), ("act_grad", hidden, "H"), ("down", inter, "I"),
                                ("dgrad", width, "the first GEMM's width")):
        bk = configs[kernel].block_k
        if k_dim % bk:
            return f"{what} = {k_dim} is not a multiple of the {kernel} tile's BK = {bk}"
    if (hidden * x.element_size()) % 16 or x.data_ptr() % 16:
        return "x's rows are not 16-byte aligned (TMA)"
    return None


def _desc(t: torch.Tensor, block: list[int]):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _flat(w: torch.Tensor) -> torch.Tensor:
    """[E, K, N] weight (weight_problem passed) as the [E*K, N] matrix it is in memory."""
    e, k, n = w.shape
    return w.as_strided((e * k, n), (w.stride(1), 1))


def _rows_launch(a, w_flat, out, z, h, expert_offsets, tile_start, cfg: GemmTileConfig, num_programs, *, k_dim, n_dim,
                 b_t, epi, act, save_z):
    from ditron_ep.ops.moe_layer import hopper_gemm_kernels as kernels

    kernel = kernels.hopper_rows_gemm_ws_kernel if WARP_SPECIALIZED else kernels.hopper_rows_gemm_kernel
    rows = a.shape[0]
    num_local = expert_offsets.shape[0] - 1
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m_cap = triton.cdiv(rows, bm) + num_local
    grid = (max(1, min(num_programs, m_cap * triton.cdiv(n_dim, bn))),)
    kernel[grid](
        _desc(a, [bm, bk]), _desc(w_flat, [bn, bk] if b_t else [bk, bn]), out, z if z is not None else out,
        h if h is not None else out, tile_start, expert_offsets, rows, m_cap, k_dim, n_dim, num_local, 1,
        B_T=b_t, EPI=epi, ACT=act, SAVE_Z=save_z, BM=bm, BN=bn, BK=bk, STAGES=cfg.num_stages,
        BLOCK_E=triton.next_power_of_2(num_local), num_warps=cfg.num_warps)


def launch_up(x, w1, h, z, expert_offsets, tile_start, cfg, num_programs, act):
    """h = act(x @ W1[e]) per expert's rows (gated: act(gate) * up); z: the pre-activation too."""
    _rows_launch(x, _flat(w1), h, z, None, expert_offsets, tile_start, cfg, num_programs, k_dim=w1.shape[1],
                 n_dim=h.shape[1], b_t=False, epi=1, act=act, save_z=z is not None)


def launch_down(h, w2, y, expert_offsets, tile_start, cfg, num_programs):
    """y = h @ W2[e] per expert's rows, rows past the last expert zero."""
    _rows_launch(h, _flat(w2), y, None, None, expert_offsets, tile_start, cfg, num_programs, k_dim=w2.shape[1],
                 n_dim=w2.shape[2], b_t=False, epi=0, act=0, save_z=False)


def launch_act_grad(dy, w2, z, dz, h, expert_offsets, tile_start, cfg, num_programs, act):
    """dh = dy @ W2[e]^T with the activation's backward: dz, and h recomputed from z."""
    _rows_launch(dy, _flat(w2), dz, z, h, expert_offsets, tile_start, cfg, num_programs, k_dim=w2.shape[2],
                 n_dim=w2.shape[1], b_t=True, epi=2, act=act, save_z=False)


def launch_dgrad(dz, w1, dx, expert_offsets, tile_start, cfg, num_programs):
    """dx = dz @ W1[e]^T per expert's rows, rows past the last expert zero."""
    _rows_launch(dz, _flat(w1), dx, None, None, expert_offsets, tile_start, cfg, num_programs, k_dim=w1.shape[2],
                 n_dim=w1.shape[1], b_t=True, epi=0, act=0, save_z=False)


def launch_wgrad(a, b, g, expert_offsets, cfg, num_programs):
    """g[e] = a[R_e]^T @ b[R_e] per expert (R_e its rows, in order); zeros for an expert without rows."""
    from ditron_ep.ops.moe_layer.hopper_gemm_kernels import hopper_wgrad_kernel

    rows, m_dim = a.shape
    n_dim = b.shape[1]
    num_local = expert_offsets.shape[0] - 1
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    n_tiles = num_local * triton.cdiv(m_dim, bm) * triton.cdiv(n_dim, bn)
    hopper_wgrad_kernel[(max(1, min(num_programs, n_tiles)),)](
        _desc(a, [bk, bm]), _desc(b, [bk, bn]), g, expert_offsets, rows, m_dim, n_dim, num_local,
        BM=bm, BN=bn, BK=bk, STAGES=cfg.num_stages, num_warps=cfg.num_warps)
