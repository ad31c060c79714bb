"""`dispatched_weights`: the routing weight of every received row, with gradients back to the
sender's [T, K] weights — for frameworks whose experts scale their rows by the weight (Megatron's
experts apply `permuted_probs`), so the router learns through the dispatch instead of the combine.

Forward: `handle.recv_weights` (dispatch carried them with the rows). Backward, for the row
gradients g [rows] on each expert rank: G[s, j, k] = g[recv_rows[s, j, k]] (0 where no row) is
returned to source rank s with one all_to_all_single of W blocks of [max_tokens, K] fp32, and on
the source grad_w[t, k] = sum over ranks r, in rank order, of G_r[slot(t, r), k]: a slot (t, k)
goes to one rank, so one term is nonzero. Deterministic, no atomics; every rank of the group
takes part in the backward's exchange (it is collective, like dispatch).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.ops.ep.buffer import DispatchHandle
from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["dispatched_weights"]


def dispatched_weights(topk_weights: torch.Tensor, handle: DispatchHandle,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """fp32 [rows]: the weight of every row `dispatch` returned (in recv_x's row order),
    differentiable with respect to `topk_weights` [T, K] (the tensor given to that dispatch)."""
    if not isinstance(handle, DispatchHandle) or handle.recv_weights is None:
        raise DitronConfigError("dispatched_weights needs the handle of a dispatch that was given topk_weights")
    if not handle.sync:
        raise DitronConfigError("dispatched_weights needs a default-mode dispatch (sync=True): its gradient "
                                "exchange sizes itself on the host")
    if not isinstance(topk_weights, torch.Tensor) or tuple(topk_weights.shape) != tuple(handle.send.topk_idx.shape):
        raise DitronConfigError(f"topk_weights must be the [T, K] = {list(handle.send.topk_idx.shape)} weights given "
                                f"to dispatch, got {getattr(topk_weights, 'shape', type(topk_weights).__name__)}")
    return _DispatchedWeights.apply(topk_weights, handle, group)


class _DispatchedWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, topk_weights, handle, group):
        ctx.handle, ctx.group, ctx.dtype = handle, group, topk_weights.dtype
        return handle.recv_weights[:handle.num_rows].clone()

    @staticmethod
    def backward(ctx, grad_rows):
        h = ctx.handle
        rows = h.recv_rows.long()                                   # [W, MAXT, K] row index, -1 if none
        # entries of slots past a source's token count are not written by the dispatch
        received = torch.arange(rows.shape[1], device=rows.device)[None, :] < h.recv.tokens_from[:, None]
        g = torch.cat([grad_rows.to(torch.float32), grad_rows.new_zeros(1, dtype=torch.float32)])
        sent_back = g[torch.where(received[:, :, None] & (rows >= 0), rows, g.shape[0] - 1)]  # zeros where no row
        got = torch.empty_like(sent_back)
        dist.all_to_all_single(got, sent_back.contiguous(), group=ctx.group)  # got[r]: rank r's for our slots
        slot = h.send.slot.long()                                    # [T, W] staging slot on rank r, -1 if none
        T, W = slot.shape
        grad = torch.zeros(T, got.shape[2], dtype=torch.float32, device=got.device)
        for r in range(W):  # rank order: a fixed summation order (one term per slot is nonzero)
            s = slot[:, r]
            grad += torch.where((s >= 0)[:, None], got[r][s.clamp_min(0)], 0.0)
        return grad.to(ctx.dtype), None, None
