"""Functional dispatch/combine over a cached `EPBuffer` per (group, E, H, K, dtype).

The buffer is created at first use, sized by one exchange through the process group's store with
a deadline (the largest T over the ranks; `runtime/sizing.py` says why not a collective), and
regrown when a later call exceeds it: every rank learns that from the layout exchange of the same
call (no extra collective), so all ranks regrow together and the call is retried.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.ops.ep.buffer import CapacityError, DispatchHandle, EPBuffer
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.input_checks import check_dims
from ditron_ep.runtime.sizing import agree_on_tokens, refuse_sizing

_CACHE: dict[tuple, EPBuffer] = {}


def _resolved(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.group.WORLD


def group_id(group: dist.ProcessGroup | None) -> object:
    """The group's part of a cache key (its name; None = the default group)."""
    g = _resolved(group)
    return g.group_name if hasattr(g, "group_name") else id(g)


def _key(group: dist.ProcessGroup | None, num_experts: int | None, hidden: int | None, topk: int | None,
         dtype: torch.dtype | None) -> tuple:
    """A cached buffer's key (None fields: unknown, for `refuse_through_match`)."""
    return (group_id(group), num_experts, hidden, topk, dtype)


def get_buffer(group: dist.ProcessGroup | None, num_experts: int, hidden: int, topk: int,
               dtype: torch.dtype, num_tokens: int, **kwargs) -> EPBuffer:
    """The cached EPBuffer for these parameters, created collectively on first use."""
    key = _key(group, num_experts, hidden, topk, dtype)
    buf = _CACHE.get(key)
    if buf is None:
        need = agree_on_tokens(group, "ditron_ep.ops.dispatch", {
            "num_experts": num_experts, "hidden": hidden, "topk": topk, "dtype": dtype}, max(num_tokens, 1))
        buf = _CACHE[key] = EPBuffer(group, num_experts, hidden, need, topk, dtype, **kwargs)
    return buf


def refuse_dispatch(x: object, topk_idx: object, *, num_experts: int | None,
                    group: dist.ProcessGroup | None = None, reason: str = "") -> None:
    """This rank rejected its arguments (`reason`: its error) to a call whose peers go on to
    `dispatch`: join that dispatch flagged (`EPBuffer._refuse_call`) on a cached buffer, or their
    sizing of a new one (`refuse_sizing`), so that the peers raise at once instead of waiting for
    this rank until they time out. Never by building a buffer: the shapes were just rejected, so
    that (a collective) could wait for peers that use another buffer. Which buffer:
    `refuse_cached` on the key fields x and topk_idx still give (those with the right number of
    dimensions)."""
    refuse_cached(group, num_experts=num_experts, reason=reason, **key_fields(x=x, topk_idx=topk_idx))


def key_fields(*, x: object = None, topk_idx: object = None) -> dict:
    """The cache-key fields that x [T, H] and topk_idx [T, K] give when their number of
    dimensions is right (a refusal may come from a malformed argument)."""
    fields: dict = {}
    if isinstance(x, torch.Tensor) and x.ndim == 2:
        fields.update(hidden=x.shape[-1], dtype=x.dtype)
    if isinstance(topk_idx, torch.Tensor) and topk_idx.ndim == 2:
        fields["topk"] = topk_idx.shape[-1]
    return fields


def refuse_cached(group: dist.ProcessGroup | None, *, num_experts: int | None = None, hidden: int | None = None,
                  topk: int | None = None, dtype: torch.dtype | None = None, reason: str = "",
                  trusted_key: bool = False) -> None:
    """Join the peers' dispatch flagged through a cached buffer of the group: the one these
    fields key when all are given, else the group's only cached buffer if it matches the fields
    given (None: unknown) — the buffer the peers use in the common case of one shape. Where the
    peers must be sizing a new buffer instead, refuse that sizing (`refuse_through_match` says
    when). Anything else is a guess that could put an unrelated buffer out of step: then it does
    nothing, and the peers are left to their bounded wait."""
    refuse_through_match(_CACHE, _key(group, num_experts, hidden, topk, dtype), group, reason, trusted_key)


def refuse_through_match(cache: dict, want: tuple, group: dist.ProcessGroup | None, reason: str,
                         trusted_key: bool = False) -> None:
    """Refuse (`_refuse_call`) through the live entry of `cache` (keys start with the group id)
    that `want` names: exact when no field is None, else the group's only entry if it matches
    the fields given. Otherwise refuse the peers' sizing (`refuse_sizing`, with `reason`) where
    they must be sizing a new entry for this call: when the group has no entry at all (a first
    call), or when the exact key is not cached and `trusted_key` says the key is the peers'
    (an `EPMoE` keys its layer from its own fields). A key built from rejected arguments is not
    trusted: the rejected field (a dtype, a size) may be the very one that misses, while the
    peers use a cached entry; marking a sizing then would fail their next, valid one."""
    group_items = [(k, v) for k, v in cache.items() if k[0] == want[0]]
    assert all(len(k) == len(want) for k, _ in group_items), "refuse_through_match: want must name every key field"
    matches = [v for k, v in group_items if all(w is None or w == f for w, f in zip(want, k))]
    exact = all(w is not None for w in want)
    if len(matches) == 1 and (exact or len(group_items) == 1):
        if not matches[0].heap.freed:
            matches[0]._refuse_call()
    elif not group_items or (trusted_key and exact and not matches):
        refuse_sizing(group, reason or "it rejected its arguments")


def _regrow(key: tuple, buf: EPBuffer, needed: int) -> EPBuffer:
    new_max = max(needed, 2 * buf.max_tokens)  # geometric growth: few regrows
    group = buf.heap.group
    buf.free()
    _CACHE[key] = EPBuffer(group, buf.num_experts, buf.hidden, new_max, buf.topk, buf.dtype,
                           num_programs=buf.num_programs)
    return _CACHE[key]


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
             num_experts: int, group: dist.ProcessGroup | None = None,
             sync: bool = True) -> tuple[torch.Tensor, DispatchHandle]:
    """`EPBuffer.dispatch` on the cached buffer (see there for shapes). Graph mode (sync=False)
    needs the buffer to exist already at a sufficient size (call once with sync=True first)."""
    # the cached buffer is looked up by their shapes, so they are checked before the lookup
    try:
        check_dims((("x", x, 2), ("topk_idx", topk_idx, 2)), "x [T, hidden], topk_idx [T, topk]")
    except DitronConfigError as err:
        if sync:  # the peers raise at once too
            refuse_dispatch(x, topk_idx, num_experts=num_experts, group=group, reason=str(err))
        raise
    buf = get_buffer(group, num_experts, x.shape[-1], topk_idx.shape[-1], x.dtype, x.shape[0])
    try:
        return buf.dispatch(x, topk_idx, topk_weights, sync=sync)
    except CapacityError as err:
        if not sync or err.pending:  # a graph-mode call's recorded problem is the user's to see
            raise
        buf = _regrow(_key(group, num_experts, x.shape[-1], topk_idx.shape[-1], x.dtype), buf, err.needed)
        return buf.dispatch(x, topk_idx, topk_weights, sync=sync)


def combine(y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None, *,
            num_experts: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`EPBuffer.combine` on the buffer that produced `handle` (num_experts and group as passed
    to `dispatch`; y is checked against that buffer)."""
    buf = next((b for b in _CACHE.values() if id(b) == getattr(handle, "buffer_id", None)), None)
    if buf is None or buf.num_experts != num_experts or buf.heap.group is not _resolved(group):
        if buf is not None:
            buf._refuse_combine()  # its peers are entering the combine on the handle's buffer
        raise DitronConfigError("handle does not come from ditron_ep.ops.dispatch on the cached buffer for this "
                                "num_experts and group (or that buffer was regrown or cleared since): pass a "
                                "handle of ditron_ep.ops.dispatch called with the same num_experts and group")
    return buf.combine(y, handle, topk_weights)


def clear_cache() -> None:
    """Free every cached buffer (collective: call on every rank)."""
    for buf in _CACHE.values():
        buf.free()
    _CACHE.clear()
