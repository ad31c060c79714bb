"""The top-2 capacity gate in torch ops (DeepSpeed 0.19.8's `top2gating` with drop_tokens and
sparse routes, on given logits): the reference `top2_capacity_gate` is tested against."""
from __future__ import annotations

import torch

EPS = torch.finfo(torch.float32).eps


def _token_positions(mask: torch.Tensor) -> torch.Tensor:
    """positions[s, e] = (tokens t <= s with mask[t, e] set) - 1."""
    return torch.cumsum(mask, dim=0) - 1


def top2_capacity_gate_reference(logits: torch.Tensor, capacity: int, noise: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(l_aux, topk_idx int32 [S, 2] (-1: dropped), topk_weights [S, 2], exp_counts int64 [E]),
    differentiable in logits; any float dtype (float64 for an oracle)."""
    probs = torch.softmax(logits, dim=1)
    num_experts = probs.shape[1]
    first = torch.argmax(probs, dim=1)
    mask1 = torch.nn.functional.one_hot(first, num_classes=num_experts)
    scores = logits.detach() if noise is None else logits.detach() + noise.to(logits.dtype)
    second = torch.argmax(scores.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = torch.nn.functional.one_hot(second, num_classes=num_experts)
    l_aux = torch.mean(torch.mean(probs, dim=0) * torch.mean(mask1.to(probs.dtype), dim=0)) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0)
    place1 = _token_positions(mask1).gather(1, first[:, None])[:, 0]
    place2 = (_token_positions(mask2) + torch.sum(mask1, dim=0, keepdim=True)).gather(1, second[:, None])[:, 0]
    kept1, kept2 = place1 < capacity, place2 < capacity
    g1 = torch.where(kept1, probs.gather(1, first[:, None])[:, 0], 0.0)
    g2 = torch.where(kept2, probs.gather(1, second[:, None])[:, 0], 0.0)
    denom = torch.clamp(g1 + g2, min=EPS)
    topk_idx = torch.stack([torch.where(kept1, first, -1), torch.where(kept2, second, -1)], dim=1).to(torch.int32)
    return l_aux, topk_idx, torch.stack([g1 / denom, g2 / denom], dim=1), exp_counts
