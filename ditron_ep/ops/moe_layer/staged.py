"""The staged MoE layer (dispatch, grouped expert MLP, combine as separate launches) and the
autograd of the fused layer built on it.

`staged_moe` is `moe(..., schedule="staged")` on checked arguments: autograd through each launch
(dispatch's backward is a combine, the experts' `grouped_mlp` backward, combine's a dispatch plus
grad_w[t, k] = <grad_out[t], y(t, k)>).

`FusedForwardStagedBackward`: the forward is the fused megakernel (`FusedMoE`); the backward
recomputes `staged_moe` on the saved inputs (activation-checkpointing style: one more dispatch,
MLP and combine) and takes its autograd. The gradients are a function of the inputs alone, so
"overlap" and "sequential" give the same gradient bits (those of schedule="staged").
"""
from __future__ import annotations

import torch

from ditron_ep.ops.ep.functional import BufferSlot
from ditron_ep.ops.moe_layer.grouped import grouped_mlp, main_grad_of

__all__ = ["FusedForwardStagedBackward", "staged_moe"]


def staged_moe(x, topk_idx, topk_weights, w1, w2, b1, b2, *, slot: BufferSlot, num_experts: int,
               activation: str, grad_dtype: torch.dtype | None = None, sync: bool = True,
               max_recv_rows: int | None = None) -> torch.Tensor:
    """Dispatch, grouped MLP, combine as separate launches on `slot`'s buffer; autograd through
    each. sync=False: graph mode, no host read forward or backward (the rows are the buffer's
    capacity; rows past the received ones are zero and get no gradient), so forward + backward
    can be captured; max_recv_rows: the rows graph mode keeps (EPBuffer.dispatch)."""
    recv_x, handle = slot.dispatch(x, topk_idx, num_experts=num_experts, sync=sync, max_recv_rows=max_recv_rows)
    # offsets built by dispatch; recv_x is read by nothing else, so the backward may write dx over it
    y = grouped_mlp(recv_x, handle.expert_offsets, w1, w2, b1=b1, b2=b2, activation=activation,
                    check=False, grad_dtype=grad_dtype, x_is_scratch=True)
    return slot.combine(y, handle, topk_weights)


class FusedForwardStagedBackward(torch.autograd.Function):
    """apply(layer, x, topk_idx, topk_weights, w1, w2, b1, b2, grad_dtype): `layer` is the FusedMoE
    (its experts, activation, and the buffer slot its backward dispatches on); collective, like
    every call of the layer."""

    @staticmethod
    def forward(ctx, layer, x, topk_idx, topk_weights, w1, w2, b1, b2, grad_dtype):
        ctx.save_for_backward(x, topk_idx, topk_weights, w1, w2, b1, b2)
        ctx.layer, ctx.grad_dtype = layer, grad_dtype
        ctx.weights = (w1, w2, b1, b2) if grad_dtype is not None else None
        return layer._forward(x, topk_idx, topk_weights, (w1, w2, b1, b2), True, False)

    @staticmethod
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        layer = ctx.layer
        needs = ctx.needs_input_grad[1:8]  # x, topk_idx, topk_weights, w1, w2, b1, b2
        with torch.enable_grad():
            leaves = [t if t is None or i == 1 else t.detach().requires_grad_(need)
                      for i, (t, need) in enumerate(zip(saved, needs))]
            if ctx.grad_dtype is not None and saved[3].dtype != ctx.grad_dtype:
                # fp32 weight gradients go to main_grad: let the recomputation's leaves share the
                # originals' (created here when missing)
                for orig, leaf in zip(ctx.weights, leaves[3:]):
                    if orig is not None and leaf is not None and leaf.requires_grad:
                        leaf.main_grad = main_grad_of(orig)
            out = staged_moe(*leaves, slot=layer.staged_slot, num_experts=layer.num_experts,
                             activation=layer.activation, grad_dtype=ctx.grad_dtype)
            wanted = [leaf for i, leaf in enumerate(leaves) if needs[i] and leaf is not None]
            grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))  # None: into main_grad
        return (None, *(next(grads) if needs[i] and leaf is not None else None for i, leaf in enumerate(leaves)),
                None)
