"""MoE forwards for `python -m ditron_ep check --against cli_broken_impls:FN` (tests/test_cli.py).

Every function has the signature of `ditron_ep.ops.moe_layer.functional` and is built from ditron_ep's staged
pieces (dispatch -> grouped_mlp -> combine) plus torch. `staged_moe` is correct; each of
the others is broken in one way that exactly one check of `--against` must catch:

* `overlap_ulp_moe`     — overlap output off by one ulp in one element: overlap vs sequential;
* `swapped_rows_moe`    — two rows of one expert swapped before the FFN and never swapped back,
                          so two tokens get each other's expert output: vs oracle;
* `index_add_combine_moe` — combine accumulates the (t, k) terms with `index_add_` in a random
                          order per call, in fp32: run vs run (needs K >= 3: with two terms
                          added to zero, a + b == b + a, so the order cannot show).

Broken in their backward only (`check --backward`; the forward rows pass):

* `grad_ulp_moe`        — one element of w1's gradient one ulp off in overlap mode: backward
                          overlap vs sequential;
* `atomic_wgrad_moe`    — weight gradients accumulated over the rows in a random order per call:
                          backward run vs run.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.ops import combine, dispatch, grouped_mlp


def _num_experts(w1: torch.Tensor, group) -> int:
    return w1.shape[0] * dist.get_world_size(group)


def staged_moe(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap"):
    """Correct: the unfused pieces, the same for every schedule."""
    E = _num_experts(w1, group)
    recv_x, handle = dispatch(x, topk_idx, num_experts=E, group=group)
    y = grouped_mlp(recv_x, handle.expert_offsets, w1, w2)
    return combine(y, handle, topk_weights, num_experts=E, group=group)


def overlap_ulp_moe(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap"):
    """Broken: in overlap mode, element [0, 0] moves one ulp up (within any tolerance)."""
    out = staged_moe(x, topk_idx, topk_weights, w1, w2, group=group, schedule=schedule)
    if schedule == "overlap" and out.numel():
        out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(float("inf"), dtype=out.dtype))
    return out


def swapped_rows_moe(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap"):
    """Broken: the first two rows of the first local expert with >= 2 rows trade places before
    the FFN; combine then returns each one's output to the other's token."""
    E = _num_experts(w1, group)
    recv_x, handle = dispatch(x, topk_idx, num_experts=E, group=group)
    offsets = handle.expert_offsets.tolist()
    for lo, hi in zip(offsets[:-1], offsets[1:]):
        if hi - lo >= 2:
            recv_x[[lo, lo + 1]] = recv_x[[lo + 1, lo]]
            break
    y = grouped_mlp(recv_x, handle.expert_offsets, w1, w2)
    return combine(y, handle, topk_weights, num_experts=E, group=group)


def index_add_combine_moe(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap"):
    """Broken: each (t, k) term w[t,k] * y(t,k) comes back on its own (a combine with one-hot
    weights: exact), then the terms are summed with `index_add_` over the (t, k) pairs in a fresh
    random order per call, in fp32 — what unordered atomics do."""
    E = _num_experts(w1, group)
    T, K = topk_idx.shape
    recv_x, handle = dispatch(x, topk_idx, num_experts=E, group=group)
    y = grouped_mlp(recv_x, handle.expert_offsets, w1, w2)
    w32 = topk_weights.to(torch.float32)
    terms = []
    for k in range(K):
        one_hot = torch.zeros_like(w32)
        one_hot[:, k] = w32[:, k]
        terms.append(combine(y, handle, one_hot, num_experts=E, group=group).to(torch.float32))
    terms = torch.stack(terms, dim=1).reshape(T * K, -1)  # row t * K + k
    token = torch.arange(T, device=x.device).repeat_interleave(K)
    order = torch.randperm(T * K, device=x.device)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token[order], terms[order])
    return out.to(x.dtype)


class _NudgeGradInOverlap(torch.autograd.Function):
    """Identity forward; in backward, one element of the gradient moves one ulp up."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        flat = grad.view(-1)
        if flat.numel():
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=grad.dtype))
        return grad


def grad_ulp_moe(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap"):
    """Broken in backward only: in overlap mode, w1's gradient is off by one ulp in one element;
    the forward is staged_moe's, bit for bit: backward overlap vs sequential."""
    if schedule == "overlap" and torch.is_grad_enabled():
        w1 = _NudgeGradInOverlap.apply(w1)
    return staged_moe(x, topk_idx, topk_weights, w1, w2, group=group, schedule=schedule)


def atomic_wgrad_moe(x, topk_idx, topk_weights, w1, w2, *, group=None, schedule="overlap"):
    """Broken in backward only: the experts run row by row on weights gathered per row
    (w1[expert of row]), the rows in a fresh random order per call, so each weight gradient is
    accumulated over the rows in that order — what atomics do. Each row's forward is computed
    alone, so the outputs do not depend on the order: backward run vs run (and overlap vs
    sequential, two calls)."""
    E = _num_experts(w1, group)
    recv_x, handle = dispatch(x, topk_idx, num_experts=E, group=group)
    counts = (handle.expert_offsets[1:] - handle.expert_offsets[:-1]).long()
    rows = recv_x.shape[0]
    expert = torch.repeat_interleave(torch.arange(w1.shape[0], device=x.device), counts, output_size=rows)
    order = torch.randperm(rows, device=x.device)
    inter = w2.shape[1]
    z = torch.bmm(recv_x[order][:, None, :], w1[expert[order]])[:, 0]          # [rows, 2I]
    h = torch.nn.functional.silu(z[:, :inter]) * z[:, inter:]
    y_ordered = torch.bmm(h[:, None, :], w2[expert[order]])[:, 0]              # [rows, H]
    y = torch.empty_like(y_ordered).index_copy(0, order, y_ordered)
    return combine(y, handle, topk_weights, num_experts=E, group=group)
