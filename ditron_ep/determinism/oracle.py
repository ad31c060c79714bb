"""Single-process float64 oracle of the expert-parallel MoE forward.

A plain loop over tokens and slots, on the whole cluster's inputs at once. It shares no layout,
permutation or combine code with `reference.py` (only input validation), so agreement between
the two is an independent check of the reference's ordering and communication.
"""
from __future__ import annotations

import torch

from .reference import validate_moe_inputs


def ep_moe_oracle(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    w1s: list[torch.Tensor],
    w2s: list[torch.Tensor],
) -> list[torch.Tensor]:
    """MoE outputs of every rank, computed in float64 in one process.

    W = len(xs) ranks; index r of every list is rank r's input of `ep_moe_reference`:

    Args:
        xs: W tensors [T_r, H], float16 / bfloat16 / float32 (T_r may differ, may be 0).
        topk_idxs: W tensors [T_r, K], integer — global expert ids, -1 = dropped slot.
        topk_weights: W tensors [T_r, K], float.
        w1s: W tensors [E_local, H, 2I], dtype of xs — gate ‖ up of rank r's experts.
        w2s: W tensors [E_local, I, H], dtype of xs.

    Expert e lives on rank e // E_local at local index e % E_local.

    Returns:
        W tensors [T_r, H], float64 (on each x's device):
        out[t] = sum_k w[t,k] * (silu(x[t] @ gate) * (x[t] @ up)) @ w2 over kept slots.
    """
    num_ranks = len(xs)
    if num_ranks == 0:
        raise ValueError("xs is empty; pass one tensor per rank")
    for name, seq in (("topk_idxs", topk_idxs), ("topk_weights", topk_weights), ("w1s", w1s),
                      ("w2s", w2s)):
        if len(seq) != num_ranks:
            raise ValueError(f"{name} has {len(seq)} entries but xs has {num_ranks}; "
                             f"pass one tensor per rank in every list")
    if not isinstance(w1s[0], torch.Tensor) or w1s[0].ndim != 3:
        raise ValueError("w1s[0] must be a 3-D tensor [E_local, H, 2I]")
    num_local = w1s[0].shape[0]
    num_experts = num_local * num_ranks
    for r in range(num_ranks):
        try:
            validate_moe_inputs(xs[r], topk_idxs[r], topk_weights[r], w1s[r], w2s[r],
                                num_experts=num_experts, world_size=num_ranks)
        except ValueError as exc:
            raise ValueError(f"rank {r}: {exc}") from exc
    for r in range(1, num_ranks):
        if w1s[r].shape != w1s[0].shape or xs[r].dtype != xs[0].dtype \
                or topk_idxs[r].shape[1] != topk_idxs[0].shape[1]:
            raise ValueError(
                f"rank {r} disagrees with rank 0 on w1 shape, dtype or topk: "
                f"{tuple(w1s[r].shape)}, {xs[r].dtype}, K={topk_idxs[r].shape[1]} vs "
                f"{tuple(w1s[0].shape)}, {xs[0].dtype}, K={topk_idxs[0].shape[1]}")

    gate_up = [w.to(torch.float64) for w in w1s]  # per rank [E_local, H, 2I]
    down = [w.to(torch.float64) for w in w2s]  # per rank [E_local, I, H]
    inter = w1s[0].shape[2] // 2
    outs = []
    for r in range(num_ranks):
        x = xs[r].to(torch.float64)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for t in range(x.shape[0]):
            for k in range(topk_idxs[r].shape[1]):
                expert = int(topk_idxs[r][t, k])
                if expert < 0:
                    continue
                owner, local = divmod(expert, num_local)
                h = x[t] @ gate_up[owner][local]  # [2I]
                gate, up = h[:inter], h[inter:]
                act = gate / (1.0 + torch.exp(-gate)) * up  # silu(gate) * up, [I]
                out[t] += float(topk_weights[r][t, k]) * (act @ down[owner][local])
        outs.append(out)
    return outs
