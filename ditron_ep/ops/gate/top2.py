"""`top2_capacity_gate(logits, capacity)`: the top-2 gate with expert capacity in one kernel
launch (forward, two passes over the tokens) and one (backward), where DeepSpeed's TopKGate runs
~40 torch ops a call — host-bound, the GPU idle ~1.7 ms a step of a 4096-token DeepSpeed block
(bench/results/HISTORY.md, session 27).

Semantics (DeepSpeed 0.19.8's `top2gating` with drop_tokens, sparse routes; `naive.py` is the
same in torch ops): probs = softmax(logits); first = argmax(probs); second = argmax(logits + noise
without the first); a route's place is its rank among the earlier tokens' routes to the same
expert, second choices after every first choice; routes placed at or past `capacity` are dropped;
the kept gates are divided by their sum (clamped at fp32 eps); l_aux = mean_e(mean_s probs *
mean_s first choices) * E * E; exp_counts = first + second choices per expert, before drops.
Indices and counts equal DeepSpeed's (up to near-ties of the logits, which the kernel's exp may
round differently from torch's); gates, l_aux and gradients agree to fp32 rounding (the
softmax's exp and the sums' order differ from torch's), deterministic run to run.
"""
from __future__ import annotations

import torch
import triton

from ditron_ep.ops.gate.top2_kernels import top2_gate_bwd_kernel, top2_gate_fwd_kernel
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.fast_launch import fast

__all__ = ["top2_capacity_gate"]

_TILE = 4096  # elements of a [BLOCK_S, BLOCK_E] tile


def _blocks(num_experts: int) -> tuple[int, int]:
    block_e = triton.next_power_of_2(num_experts)
    return max(1, _TILE // block_e), block_e


class _Top2Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, noise: torch.Tensor | None, capacity: int):
        S, E = logits.shape
        dev = logits.device
        topk = torch.empty((S, 2), dtype=torch.int32, device=dev)
        gates = torch.empty((S, 2), dtype=torch.float32, device=dev)
        place = torch.empty((S, 2), dtype=torch.int32, device=dev)
        counts = torch.empty(E, dtype=torch.int64, device=dev)
        first = torch.empty(E, dtype=torch.float32, device=dev)
        l_aux = torch.empty((), dtype=torch.float32, device=dev)
        block_s, block_e = _blocks(E)
        fast(top2_gate_fwd_kernel)[(1,)](logits, logits if noise is None else noise, topk, gates, place, counts, first,
                                         l_aux, S, E, capacity, HAS_NOISE=noise is not None, BLOCK_S=block_s,
                                         BLOCK_E=block_e)
        ctx.save_for_backward(logits, topk, first)
        ctx.mark_non_differentiable(topk, counts)
        return l_aux, topk, gates, counts

    @staticmethod
    def backward(ctx, d_l_aux, _d_topk, d_gates, _d_counts):
        logits, topk, first = ctx.saved_tensors
        S, E = logits.shape
        d_logits = torch.empty_like(logits)
        block_s, block_e = _blocks(E)
        block_s = min(block_s, 64)  # one program per block of rows: many programs
        if S == 0:
            return d_logits, None, None
        dummy = logits
        fast(top2_gate_bwd_kernel)[(triton.cdiv(S, block_s),)](
            logits, topk, dummy if d_gates is None else d_gates.contiguous(), first,
            dummy if d_l_aux is None else d_l_aux.reshape(1).contiguous(), d_logits, S, E,
            HAS_D_GATES=d_gates is not None, HAS_D_L_AUX=d_l_aux is not None, BLOCK_S=block_s, BLOCK_E=block_e)
        return d_logits, None, None


def top2_capacity_gate(logits: torch.Tensor, capacity: int, noise: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-2 routes with expert capacity (module docstring), differentiable in `logits`.

    Args:
        logits: fp32 [S, E] (E >= 2), the gate's scores.
        capacity: routes an expert keeps (a host int >= 0).
        noise: optional fp32 [S, E] added to the logits for the second choice only (DeepSpeed's
            Gumbel draw for top2_2nd_expert_sampling); probs and gates do not see it.
    Returns:
        l_aux: fp32 scalar; topk_idx: int32 [S, 2] (-1 where the capacity dropped the route);
        topk_weights: fp32 [S, 2]; exp_counts: int64 [E].
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        got = f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}"
        raise DitronConfigError(f"logits must be an fp32 [S, E] tensor, got {got}")
    if logits.shape[1] < 2:
        raise DitronConfigError(f"a top-2 gate needs at least 2 experts, got logits with {logits.shape[1]} columns")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise DitronConfigError(f"capacity must be an int >= 0, got {capacity!r}")
    if noise is not None and (not isinstance(noise, torch.Tensor) or noise.shape != logits.shape or
                              noise.dtype != torch.float32 or noise.device != logits.device):
        raise DitronConfigError(f"noise must be fp32 {tuple(logits.shape)} on {logits.device} like logits")
    capacity = min(capacity, 2 ** 31 - 1)
    return _Top2Gate.apply(logits.contiguous(), None if noise is None else noise.contiguous(), capacity)
