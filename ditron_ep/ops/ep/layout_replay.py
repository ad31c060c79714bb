"""EPBuffer's layout launches replayed from CUDA graphs, each replay's layout handed to the call.

Why: an eager dispatch at small T is bound by host time. Its layout stage is four Triton launches
and about a dozen allocations: ~190 µs per call on a lent H200 host at T=128 (`layout`), against
~22 µs when the same launches replay from a CUDA graph (`graph layout`;
bench/results/dispatch_combine_H200x2_20261122_s10_*). FusedMoE replays its layout the same way,
and runtime/call_graphs.py says when a call signature is captured.

Unlike the layer's, a dispatch's layout outlives the call: its handle keeps it for `combine` and
the backward passes, while the next replay rewrites the graph's buffers. So every layout tensor
the graph writes is a view of one flat int32 arena, and a signature keeps a few captured copies
of its launches (`LayoutReplays`), each with its own arena: a replay runs one no live handle (nor
any tensor taken from one) still holds, and hands that copy's layout to the call as it is.
Whether anything still holds a copy is read off reference counts (`CapturedLayout.idle`), so a
dispatch -> combine -> next dispatch loop replays the same copy every call and pays no copy-out.
When every copy is held (a training step keeps each layer's handle until its backward), one more
shared copy is replayed and its arena cloned (one copy of a few KiB to ~1 MiB; the views rebuilt
with as_strided, ~3 µs a tensor on a lent host). Default mode only: capturing synchronises the
device, which graph mode (sync=False) promises never to do.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from ditron_ep.ops.ep.layout_kernels import RecvLayout, SendLayout, recv_layout_shapes, send_layout_shapes
from ditron_ep.runtime.fast_launch import current_stream

__all__ = ["Int32Arena", "CapturedLayout", "LayoutReplays", "call_tokens", "layout_arena_words", "layout_rows",
           "padded_routing", "rebuild_layout", "route_nowhere_past", "view_recipe"]

# Every arena tensor starts on a 64-byte boundary. Triton specialises a pointer argument on
# 16-byte alignment, so the views compile to the same kernels as torch.empty's tensors (which the
# first, direct call of a signature compiled) and keep their vector loads.
ARENA_ALIGN_WORDS = 16


def _aligned(words: int) -> int:
    return -(-words // ARENA_ALIGN_WORDS) * ARENA_ALIGN_WORDS


def layout_arena_words(num_tokens: int, topk: int, num_experts: int, world_size: int, max_tokens: int) -> int:
    """int32 words an `Int32Arena` needs for one dispatch's send and receive layouts."""
    shapes = [*send_layout_shapes(num_tokens, topk, num_experts, world_size, max_tokens).values(),
              *recv_layout_shapes(world_size, num_experts // world_size).values()]
    return sum(_aligned(math.prod(s)) for s in shapes)


class Int32Arena:
    """Bump allocator of int32 tensors, each a view of one flat buffer (`flat`).

    Passed as `alloc` to build_send_layout / exchange_layout. Asking for more words than it was
    sized for raises: the arena's size and the layout's shapes come from the same functions.
    """

    def __init__(self, words: int, device: torch.device) -> None:
        self.flat = torch.empty(words, dtype=torch.int32, device=device)
        self.used = 0

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        end = self.used + n
        if end > self.flat.numel():  # a bug, not a capture problem: not a RuntimeError
            raise ValueError(f"Int32Arena of {self.flat.numel()} words cannot hold {tuple(shape)} after "
                               f"{self.used} words; size it with layout_arena_words")
        view = self.flat[self.used:end].view(shape)
        self.used = _aligned(end)
        return view


def view_recipe(layout: SendLayout | RecvLayout, flat: torch.Tensor) -> tuple[type, list[tuple[str, object]]]:
    """How to rebuild `layout` on a copy of `flat` (an arena's buffer): per field, (name, (shape,
    strides, offset)) for a view of `flat`, or (name, value) for anything else (kept as is).
    Worked out once per capture: a replay then only calls as_strided (~1 µs per tensor)."""
    store = flat.untyped_storage().data_ptr()
    recipe: list[tuple[str, object]] = []
    for f in dataclasses.fields(layout):
        t = getattr(layout, f.name)
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == store:
            recipe.append((f.name, (tuple(t.shape), t.stride(), t.storage_offset() - flat.storage_offset())))
        else:
            recipe.append((f.name, t))
    return type(layout), recipe


def rebuild_layout(recipe: tuple[type, list[tuple[str, object]]], copy: torch.Tensor):
    """The layout `view_recipe` described, its arena views taken of `copy` instead."""
    cls, fields = recipe
    return cls(**{name: (copy.as_strided(*how) if isinstance(how, tuple) else how) for name, how in fields})


def layout_rows(num_tokens: int, max_tokens: int) -> int:
    """Routing rows of the captured layout that serves a call of `num_tokens` tokens: the next
    power of two from 16 (0 stays 0), at most max_tokens. A call of fewer tokens replays it with
    the rows past its own routed nowhere (-1, a dropped slot): the send layout of its tokens, its
    counts and every rank's received rows are those of its own launches, bit for bit (each is a
    count of earlier pairs, and the extra rows add none). So calls whose token count varies
    (serving) replay one of a few captures instead of launching the layout directly (~270 µs of
    host time at T=128 on a lent H200 host against ~45 for a replay,
    bench/results/dispatch_combine_uniform_H200x1_20261128_s33_*). The rows differ in one place:
    the T that every rank's exchange record carries (`RecvLayout.src_info`), which only bounds
    the staging chunks the data kernels walk (task_queue.call_chunks)."""
    if num_tokens == 0:
        return 0
    return min(max_tokens, max(16, 1 << (num_tokens - 1).bit_length()))


def padded_routing(topk_idx: torch.Tensor, rows: int) -> torch.Tensor:
    """topk_idx [T, K] as `rows` routing rows, the rows past T routed nowhere (-1)."""
    padded = torch.full((rows, topk_idx.shape[1]), -1, dtype=topk_idx.dtype, device=topk_idx.device)
    padded[:topk_idx.shape[0]].copy_(topk_idx)
    return padded


def route_nowhere_past(static_topk: torch.Tensor, num_tokens: int, routed: int) -> int:
    """Before a replay of a call of num_tokens tokens: set the rows of a capture's static routing
    that an earlier call left routed (up to `routed`; -1: any row) past num_tokens to -1. Returns
    the rows that may now hold routing (num_tokens), the next call's `routed`."""
    rows = static_topk.shape[0]
    if num_tokens < rows and (routed == -1 or routed > num_tokens):
        static_topk[num_tokens:rows if routed == -1 else routed].fill_(-1)
    return num_tokens


def call_tokens(send: SendLayout, num_tokens: int) -> SendLayout:
    """`send` (of a capture's routing rows) as the layout of the call's first num_tokens rows."""
    if send.topk_idx.shape[0] == num_tokens:
        return send
    return dataclasses.replace(send, topk_idx=send.topk_idx[:num_tokens], pos=send.pos[:num_tokens],
                               slot=send.slot[:num_tokens])


# How many copies of a signature's launches may be held by live handles at once (beside the shared
# one that is copied out): a few in-flight dispatches (micro-batches, a layer's forward and its
# recomputation); a training step's dozens of held handles take the shared copy.
LENDABLE_COPIES = 3

# The reference count of a storage (its tensors and views); None where torch lacks it: then no
# copy is ever handed out, every replay is copied out of the shared one. Before torch 2.10 a
# reference held only by C++ (a tensor autograd saved) did not show in a tensor's Python reference
# count: copies are lent from 2.10 on.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10):
    _storage_use_count = None


@dataclass
class CapturedLayout:
    """One default-mode dispatch signature's layout launches as a CUDA graph, and the static
    tensors it reads and writes (EPBuffer._layout_statics / _layout_launches)."""

    topk_idx: torch.Tensor         # static input: each replay copies the call's routing in
    graph: torch.cuda.CUDAGraph    # the layout launches, then the status copy
    arena: Int32Arena              # every layout tensor the graph writes
    status: torch.Tensor           # pinned host copy of the layout status words
    ready: torch.cuda.Event        # recorded after the replay: wait on it before reading `status`
    recv_rows: torch.Tensor | None = None  # the handle's int32 [W, MAXT, K] / [W, MAXT], which the
    recv_tok: torch.Tensor | None = None   # dispatch kernel writes, handed out with the layout
    inputs: tuple = ()             # a whole call's other static inputs (x, weights, scales): copied in too
    outputs: dict | None = None    # a whole call's data-kernel outputs (EPBuffer._capture_call), handed out
    send: SendLayout | None = None  # views of the arena (set by the launches)
    recv: RecvLayout | None = None
    recipes: tuple | None = None   # (send, recv) view recipes, worked out at the first copied replay
    _watch: tuple = ()             # what `idle` watches (`arm`), and its counts when idle
    _storages: tuple = ()
    _base: tuple | None = None     # None: not lent yet (`replay_in_place` arms it)
    _stream: object = None         # the stream of the last replay
    _routed: int = -1              # rows of `topk_idx` that may hold a call's routing (-1: all)

    def _queue(self, topk_idx: torch.Tensor, values: tuple = ()) -> None:
        """Copy the call's routing (and a whole call's other inputs, `values` for `inputs`) in and
        replay the graph on the current stream."""
        stream = current_stream() if self.topk_idx.is_cuda else None
        if stream is not None and self._stream is not None and self._stream is not stream:
            # the last call's kernels (its combine, the caller's own reads) may still read the
            # layout on the other stream: a host reference count says nothing about them
            stream.wait_stream(self._stream)
        self._stream = stream
        T = topk_idx.shape[0]
        # a call of fewer tokens than the capture's: the rows past it route nowhere (-1), and its
        # other inputs' rows past it are never read
        if not values:
            (self.topk_idx if T == self.topk_idx.shape[0] else self.topk_idx[:T]).copy_(topk_idx)
        else:  # one host call for every copy
            statics = [self.topk_idx, *self.inputs]
            torch._foreach_copy_(statics if T == self.topk_idx.shape[0] else [t[:T] for t in statics],
                                 [topk_idx, *values])
        self._routed = route_nowhere_past(self.topk_idx, T, self._routed)
        self.graph.replay()
        self.ready.record(stream)

    def replay(self, topk_idx: torch.Tensor) -> tuple[SendLayout, RecvLayout]:
        """Queue this call's layout on the current stream; return it, copied out of the graph's
        memory (the handle keeps it past the next replay). No host sync: wait on `ready` before
        reading `status`. (Layout-only copies: a whole call's copies are never shared.)"""
        self._queue(topk_idx)
        flat = self.arena.flat
        if self.recipes is None:
            self.recipes = (view_recipe(self.send, flat), view_recipe(self.recv, flat))
        snap = flat[:self.arena.used].clone()
        return (call_tokens(rebuild_layout(self.recipes[0], snap), topk_idx.shape[0]),
                rebuild_layout(self.recipes[1], snap))

    def replay_in_place(self, topk_idx: torch.Tensor, values: tuple = ()) -> tuple[SendLayout, RecvLayout]:
        """`replay`, returning the graph's own layout (only when `idle`: nothing else holds it)."""
        self._queue(topk_idx, values)
        if self._base is None:
            self.arm()
        return call_tokens(self.send, topk_idx.shape[0]), self.recv

    def arm(self) -> None:
        """Take the reference counts of an idle copy (at its first lending): of every object a caller can
        be handed (the layouts, each of their tensors, recv_rows / recv_tok) and of every storage
        behind them (a view taken of any of them counts there). `idle` counts the same way."""
        tensors = [t for lay in (self.send, self.recv) for f in dataclasses.fields(lay)
                   for t in [getattr(lay, f.name)] if isinstance(t, torch.Tensor)]
        # the arena itself too (every view's `_base`). Not seen: a caller keeping only a storage
        # object (`untyped_storage()`) of these tensors, whose Python references the interpreter's
        # launches also take and drop at times.
        tensors += [t for t in (self.recv_rows, self.recv_tok, self.arena.flat, *(self.outputs or {}).values())
                    if t is not None]
        by_storage = {t.untyped_storage().data_ptr(): t for t in tensors}
        self._watch = (self.send, self.recv, *tensors)
        # each storage as its C++ address, which lives as long as this object holds its tensors
        # (`untyped_storage()` builds a Python object per call: it took half of `idle`'s time)
        self._storages = tuple(t.untyped_storage()._cdata for t in by_storage.values())
        del tensors, by_storage  # (their references would count now and not in `idle`)
        self._base = (self._object_refs(), self._storage_refs())

    def _object_refs(self) -> list[int]:
        return list(map(sys.getrefcount, self._watch))

    def _storage_refs(self) -> list[int]:
        return list(map(_storage_use_count, self._storages))

    def idle(self) -> bool:
        """Nothing outside this object holds its layout, tensors or a view of their memory."""
        if self._base is None:
            return True
        objs, stores = self._base
        return self._object_refs() == objs and self._storage_refs() == stores


class LayoutReplays:
    """A signature's captured layout launches: up to LENDABLE_COPIES copies handed to calls as
    they are, and a shared copy replayed and copied out while all of them are held (module
    docstring). `capture()` builds a copy (nothing queued); it is called again as more copies
    are needed, and a copy it could not build (it raised RuntimeError: a CUDA capture problem,
    out of memory) stops the growth (`replay` then returns None while it has nothing to run).
    Copies are replayed on the caller's stream; one replayed on another stream than before first
    waits for the work queued on that one."""

    def __init__(self, capture: Callable[[bool], CapturedLayout], shared: bool = True) -> None:
        """capture(lent): a new copy; lent: it will be handed to calls (it then also holds the
        handle's recv_rows / recv_tok). shared=False (whole calls, whose outputs would need copying
        out too): no shared copy; `replay` returns None while every copy is held, or always where
        torch cannot count references (nothing is captured then)."""
        self._capture = capture
        self.lendable = LENDABLE_COPIES if _storage_use_count is not None else 0
        self.copies: list[CapturedLayout] = []  # the lendable ones
        self.shared: CapturedLayout | None = None
        self._shared_failed = not shared
        if self.lendable or shared:
            first = capture(bool(self.lendable))
            if self.lendable:
                self.copies.append(first)
            else:
                self.shared = first

    @property
    def replays(self) -> int:
        """Replays of every copy (tests)."""
        return sum(c.graph.replays for c in self.copies + ([self.shared] if self.shared else []))

    def _grow(self, lent: bool) -> CapturedLayout | None:
        try:
            return self._capture(lent)
        except RuntimeError as err:  # as CallGraphCache.lookup_or_give_up: never fail the call
            warnings.warn(f"EPBuffer: capturing another copy of a dispatch's layout launches failed ({err}); "
                          f"this signature keeps the {len(self.copies)} it has", RuntimeWarning, stacklevel=4)
            self.lendable = len(self.copies)
            return None

    def replay(self, topk_idx: torch.Tensor, values: tuple = ()
               ) -> tuple[SendLayout, RecvLayout, CapturedLayout, bool] | None:
        """Queue this call's layout (a whole call's: `values` for the copies' `inputs`): (send,
        recv, the copy that ran, whether its layout is lent to the call as it is), or None (launch
        directly: no copy could be captured, or no copy is free and none is shared)."""
        for c in self.copies:
            if c.idle():
                return (*c.replay_in_place(topk_idx, values), c, True)
        if len(self.copies) < self.lendable:
            c = self._grow(True)
            if c is not None:
                self.copies.append(c)
                return (*c.replay_in_place(topk_idx, values), c, True)
        if self.shared is None:
            if self._shared_failed:  # (a capture that failed is not retried every call)
                return None
            self.shared = self._grow(False)
            if self.shared is None:
                self._shared_failed = True
                return None
        return (*self.shared.replay(topk_idx), self.shared, False)
