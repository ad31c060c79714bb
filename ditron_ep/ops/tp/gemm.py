"""The dense GEMM of the tensor-parallel ops: the expert-MLP kernels with one expert.

`matmul(a, b)` runs the portable `grouped_gemm_kernels.grouped_down_kernel` on a single expert
holding every row: each output element one fp32 dot over K in order, one cast — deterministic,
and independent of the grid. b may be any strided view (an nn.Linear weight's transpose is read
in place). fp32 inputs are multiplied in full fp32 ("ieee"), as torch's default matmul does.
"""
from __future__ import annotations

import torch

from ditron_ep.compiler.core_config import default_gemm_configs

__all__ = ["matmul"]

_OFFSETS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _one_expert(rows: int, device: torch.device) -> torch.Tensor:
    """int32 [0, rows] on `device` (cached: no host-to-device copy per call)."""
    key = (rows, device)
    off = _OFFSETS.get(key)
    if off is None:
        if len(_OFFSETS) > 256:
            _OFFSETS.clear()
        off = _OFFSETS[key] = torch.tensor([0, rows], dtype=torch.int32, device=device)
    return off


def matmul(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] in fp32, cast once to out_dtype (default a's dtype). a and b must share
    dtype and device (the callers check); a is made contiguous, b is read with its strides."""
    from ditron_ep.ops.moe_layer.grouped import _Launches
    from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map

    rows, k_dim = a.shape
    n_dim = b.shape[1]
    out = torch.empty((rows, n_dim), dtype=out_dtype or a.dtype, device=a.device)
    if rows == 0 or n_dim == 0:
        return out
    if k_dim == 0:
        return out.zero_()
    on_gpu = a.device.type == "cuda"
    cfg = default_gemm_configs(a.dtype, "hip" if on_gpu and torch.version.hip else a.device.type)[1]
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if on_gpu else 1
    run = _Launches({"down": ("portable", cfg)}, programs, "ieee", 1, 0)

    offsets = _one_expert(rows, a.device)
    run.launch_down(a.contiguous(), b[None], out, offsets, build_tile_map(offsets, cfg.block_m))
    return out
