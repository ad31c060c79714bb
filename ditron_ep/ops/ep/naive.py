"""Naive references of EP dispatch and combine: plain loops over every rank's inputs in one process,
sharing no code with the kernels or their layout.

Dispatch is a copy, so its reference is exact: rank r receives one row per (source rank s,
token t, slot k) routed to one of its experts, expert-major, then ordered by (s, t, k).
Combine returns every row to its token: out[t] = sum_k w[t, k] * y(t, k), added in k order in
float64 (the library adds in fp32 and casts once, so compare within the dtype's tolerance).
The distributed, all_to_all_single-based reference of the whole layer is
`ditron_ep.ops.moe_layer.naive.ep_moe_reference`; the bench baseline is `ditron_ep.bench.alltoall`.
"""
from __future__ import annotations

import torch


def recv_order(topk_idxs: list[torch.Tensor], rank: int, num_experts: int) -> list[tuple[int, int, int]]:
    """(source rank, token, k) of every row `rank` receives, in receive order.

    Args:
        topk_idxs: every rank's [T_s, K] global expert ids (-1 = dropped slot), index s = rank s.
        rank: the receiving rank; it owns experts [rank * E_local, (rank + 1) * E_local).
        num_experts: E, a multiple of the number of ranks.
    """
    world = len(topk_idxs)
    e_local = num_experts // world
    order = []
    for e in range(rank * e_local, (rank + 1) * e_local):
        for src in range(world):
            idx = topk_idxs[src]
            for t in range(idx.shape[0]):
                for k in range(idx.shape[1]):
                    if int(idx[t, k]) == e:
                        order.append((src, t, k))
    return order


def naive_dispatch(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], rank: int,
                   num_experts: int) -> tuple[torch.Tensor, list[int], list[tuple[int, int, int]]]:
    """What `rank` receives: rows [N, H] in x's dtype, expert offsets [E_local + 1] (rows of local
    expert e are rows[offsets[e]:offsets[e + 1]]), and the (source, token, k) of every row."""
    order = recv_order(topk_idxs, rank, num_experts)
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    rows = torch.stack([xs[s][t] for s, t, _ in order]) if order else torch.empty(0, hidden, dtype=dtype)
    e_local = num_experts // len(xs)
    experts = [int(topk_idxs[s][t, k]) - rank * e_local for s, t, k in order]
    offsets = [0]
    for e in range(e_local):
        offsets.append(offsets[-1] + experts.count(e))
    return rows, offsets, order


def naive_combine(ys: list[torch.Tensor], orders: list[list[tuple[int, int, int]]],
                  topk_weights: list[torch.Tensor], num_tokens: list[int]) -> list[torch.Tensor]:
    """Every source rank's float64 [T_s, H] output: out[t] = sum_k w[t, k] * y(t, k), in k order.

    Args:
        ys: per receiving rank r, the expert outputs [N_r, H] of its received rows.
        orders: per receiving rank r, the (source, token, k) of each row (`recv_order`).
        topk_weights: every source rank's [T_s, K] weights.
        num_tokens: T_s of every source rank.
    """
    hidden = next((y.shape[1] for y in ys if y.dim() == 2), 0)
    terms: list[dict[tuple[int, int], torch.Tensor]] = [{} for _ in num_tokens]
    for y, order in zip(ys, orders):
        for row, (s, t, k) in enumerate(order):
            terms[s][(t, k)] = float(topk_weights[s][t, k]) * y[row].to(torch.float64)
    outs = []
    for s, n in enumerate(num_tokens):
        out = torch.zeros(n, hidden, dtype=torch.float64)
        for t in range(n):
            for k in range(topk_weights[s].shape[1]):  # fixed k order
                if (t, k) in terms[s]:
                    out[t] += terms[s][(t, k)]
        outs.append(out)
    return outs
