"""The dense GEMM of the tensor-parallel ops: the expert-MLP kernels with one expert.

`matmul(a, b)` runs the portable `grouped_gemm_kernels.grouped_down_kernel` on a single expert
holding every row: each output element one fp32 dot over K in order, one cast — deterministic,
and independent of the grid. b may be any strided view (an nn.Linear weight's transpose is read
in place). fp32 inputs are multiplied in full fp32 ("ieee"), as torch's default matmul does.
"""
from __future__ import annotations

import torch

from ditron_ep.compiler.core_config import GemmTileConfig, device_type_of
from ditron_ep.compiler.tp_plan import planned_tile

__all__ = ["matmul", "matmul_with_tile"]

# (rows, device, block_m) -> (expert offsets [0, rows], its tile map): a dense GEMM is one expert
# holding every row, so both are constants of the shape; building them per call cost ~100 µs of
# host time (five small launches, a cub scan among them) on H200.
_ONE_EXPERT: dict[tuple[int, torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _one_expert(rows: int, device: torch.device, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [0, rows], build_tile_map of it) on `device`, cached."""
    from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map

    key = (rows, device, block_m)
    got = _ONE_EXPERT.get(key)
    if got is None:
        if len(_ONE_EXPERT) > 256:
            _ONE_EXPERT.clear()
        off = torch.tensor([0, rows], dtype=torch.int32, device=device)
        got = _ONE_EXPERT[key] = (off, build_tile_map(off, block_m))
    return got


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] in fp32, cast once to out_dtype (default a's dtype). a and b must share
    dtype and device (the callers check); a is made contiguous, b is read with its strides. The
    tile is `tp_plan.planned_tile` of the shape: the tuner's when this machine's cache has one
    (bitwise the same result as the shape rule's), else the rule's; the overlapped kernels use
    the same one."""
    rows, k_dim = a.shape
    n_dim = b.shape[1]
    cfg, _ = planned_tile(str(a.dtype).removeprefix("torch."), device_type_of(a.device), rows, k_dim, n_dim)
    return matmul_with_tile(a, b, cfg, out_dtype=out_dtype)


def matmul_with_tile(a: torch.Tensor, b: torch.Tensor, cfg: GemmTileConfig, *, out_dtype: torch.dtype | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`matmul` with the given tile (the tuner's candidates); into `out` [M, N] when given."""
    from ditron_ep.ops.moe_layer.grouped import _Launches

    rows, k_dim = a.shape
    n_dim = b.shape[1]
    if out is None:
        out = torch.empty((rows, n_dim), dtype=out_dtype or a.dtype, device=a.device)
    if rows == 0 or n_dim == 0:
        return out
    if k_dim == 0:
        return out.zero_()
    on_gpu = a.device.type == "cuda"
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if on_gpu else 1
    run = _Launches({"down": ("portable", cfg)}, programs, "ieee", 1, 0)
    offsets, tiles = _one_expert(rows, a.device, cfg.block_m)
    run.launch_down(a.contiguous(), b[None], out, offsets, tiles)
    return out
