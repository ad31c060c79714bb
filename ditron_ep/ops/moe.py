"""`moe`: the EP MoE layer forward — dispatch, grouped SwiGLU experts, combine.

schedule="staged" runs the three stages as separate launches on the cached EPBuffer (dispatch
and combine kernels, the grouped GEMM between them); it is the building block the fused
megakernel (schedule "overlap" / "sequential") must match.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.errors import DitronConfigError
from .functional import combine, dispatch
from .grouped_ffn import grouped_swiglu_ffn

SCHEDULES = ("staged",)


def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
        w2: torch.Tensor, *, group: dist.ProcessGroup | None = None, schedule: str = "staged") -> torch.Tensor:
    """Expert-parallel MoE forward: out[t] = sum_k w[t,k] * FFN_{e(t,k)}(x[t]).

    Args:
        x: [T, H] tokens of this rank (bf16/fp16 on GPU; fp32 under the interpreter).
        topk_idx: [T, K] int global expert ids (-1 = dropped); rank r owns experts
            [r*E_local, (r+1)*E_local) with E_local = w1.shape[0].
        topk_weights: [T, K] float routing weights.
        w1: [E_local, H, 2I] gate ‖ up of this rank's experts; w2: [E_local, I, H].
        group: EP process group (None = default).
        schedule: "staged" (dispatch, expert GEMMs and combine as three launches).
    Returns:
        [T, H] in x's dtype; top-k terms summed in k order in fp32, cast once.
    """
    if schedule not in SCHEDULES:
        raise DitronConfigError(f"unknown schedule {schedule!r}; available: {SCHEDULES}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, topk_weights, w1, w2)):
        raise NotImplementedError("backward through the MoE experts is not implemented yet: run moe() under "
                                  "torch.no_grad() / inference_mode, or detach its inputs")
    if w1.dim() != 3 or w2.dim() != 3:
        raise DitronConfigError(f"w1 must be [E_local, H, 2I] and w2 [E_local, I, H]; got {tuple(w1.shape)}, "
                                f"{tuple(w2.shape)}")
    world = dist.get_world_size(group)
    num_experts = w1.shape[0] * world
    recv_x, handle = dispatch(x, topk_idx, num_experts=num_experts, group=group)
    y = grouped_swiglu_ffn(recv_x, handle.expert_offsets, w1, w2)
    return combine(y, handle, topk_weights, num_experts=num_experts, group=group)
