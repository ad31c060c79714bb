"""Functional dispatch/combine on one `EPBuffer` per process group (`BufferSlot`).

The buffer is built at first use (one collective, sized by the largest T over the ranks) and
rebuilt on every rank together when a call needs more tokens or other shapes: every rank
learns that from the call records of the same call's counts exchange (runtime/agreement.py).
Modules and integrations keep a `BufferSlot` of their own, so that their calls never rebuild
a buffer another layer's backward still needs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.ops.ep.buffer import DispatchHandle, EPBuffer, request_of
from ditron_ep.runtime.agreement import CallSlot, per_group
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.input_checks import check_dims


def _build(group: dist.ProcessGroup | None):
    return lambda fields, tokens: EPBuffer(group, fields["num_experts"], fields["hidden"], tokens, fields["topk"],
                                           fields["dtype"])


class BufferSlot:
    """`dispatch` / `combine` on an EPBuffer built at first use and rebuilt when a call needs it
    (collective: every rank of `group` calls, in the same order)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.slot: CallSlot[EPBuffer] = CallSlot(group, "ditron_ep dispatch", _build(group), EPBuffer.request)

    @property
    def buffer(self) -> EPBuffer | None:
        return self.slot.resource

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
                 num_experts: int, sync: bool = True, max_recv_rows: int | None = None,
                 error: Exception | None = None, layout: str = "expert_major") -> tuple[torch.Tensor, DispatchHandle]:
        """`EPBuffer.dispatch` (shapes there). Graph mode (sync=False) needs the buffer to exist
        at a sufficient size (call once with sync=True first). error: the caller rejected its
        arguments (this rank joins the dispatch flagged and raises it)."""
        try:
            check_dims((("x", x, 2), ("topk_idx", topk_idx, 2)), "x [T, hidden], topk_idx [T, topk]")
        except DitronConfigError as err:
            error = error or err
        return self.slot.run(request_of(x, topk_idx, num_experts), x.shape[0] if error is None else 0, error, sync,
                             lambda buf: buf.dispatch(x, topk_idx, topk_weights, sync=sync, max_recv_rows=max_recv_rows,
                                                      layout=layout),
                             lambda buf, flags, fields: buf.join_flagged(flags, fields, x.shape[0] if fields else 0))

    def combine(self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                **modes: object) -> torch.Tensor:
        """`EPBuffer.combine` on the buffer that produced `handle` (y is checked against it); modes:
        its topk_sum / partial_dtype."""
        buf = self.slot.resource
        if buf is None or buf.freed or getattr(handle, "buffer_id", None) != id(buf):
            if buf is not None and not buf.freed:
                buf._refuse_combine()  # its peers are entering the combine on this buffer
            raise DitronConfigError("handle does not come from the last dispatch of this buffer slot (ops.dispatch "
                                    "with the same group), or that buffer was rebuilt since: pass the handle of "
                                    "the matching dispatch")
        return buf.combine(y, handle, topk_weights, **modes)

    def free(self) -> None:
        """Free the buffer (collective: call on every rank)."""
        self.slot.free()


_SLOTS: dict[object, BufferSlot] = {}


def group_slot(group: dist.ProcessGroup | None) -> BufferSlot:
    """The process group's slot of the functional forms."""
    return per_group(_SLOTS, group, BufferSlot)


def get_buffer(group: dist.ProcessGroup | None = None) -> EPBuffer | None:
    """The functional forms' buffer of this group, if built."""
    return group_slot(group).buffer


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
             num_experts: int, group: dist.ProcessGroup | None = None, sync: bool = True,
             max_recv_rows: int | None = None, layout: str = "expert_major") -> tuple[torch.Tensor, DispatchHandle]:
    """`EPBuffer.dispatch` on the group's buffer (see there for shapes, max_recv_rows and layout).
    Graph mode (sync=False) needs the buffer to exist already at a sufficient size (call once with
    sync=True first)."""
    return group_slot(group).dispatch(x, topk_idx, topk_weights, num_experts=num_experts, sync=sync,
                                      max_recv_rows=max_recv_rows, layout=layout)


def combine(y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None, *,
            num_experts: int | None = None, group: dist.ProcessGroup | None = None, topk_sum: str = "token_rank",
            partial_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`EPBuffer.combine` on the group's buffer, which produced `handle` (num_experts: as passed
    to dispatch, or None; topk_sum, partial_dtype: the exact or the rank-reduced combine, see there)."""
    slot = group_slot(group)
    if num_experts is not None and slot.buffer is not None and slot.buffer.num_experts != num_experts:
        slot.buffer._refuse_combine()
        raise DitronConfigError(f"num_experts={num_experts} differs from the dispatch's "
                                f"({slot.buffer.num_experts}); pass the same num_experts as to dispatch")
    return slot.combine(y, handle, topk_weights, topk_sum=topk_sum, partial_dtype=partial_dtype)


def clear_cache() -> None:
    """Free every group's buffer (collective: call on every rank)."""
    for slot in _SLOTS.values():
        slot.free()
    _SLOTS.clear()
