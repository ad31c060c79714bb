"""EPBuffer's layout launches replayed from a CUDA graph, each replay's layout copied out in one piece.

Why: an eager dispatch at small T is bound by host time. Its layout stage is four Triton launches
and about a dozen allocations: ~190 µs per call on a lent H200 host at T=128 (`layout`), against
~22 µs when the same launches replay from a CUDA graph (`graph layout`;
bench/results/dispatch_combine_H200x2_20261122_s10_*). FusedMoE replays its layout the same way,
and runtime/call_graphs.py says when a call signature is captured.

Unlike the layer's, a dispatch's layout outlives the call: its handle keeps it for `combine` and
the backward passes, while the next replay rewrites the graph's buffers. So every layout tensor
the graph writes is a view of one flat int32 arena. Each replay clones the arena (one copy of a
few KiB to ~1 MiB) and re-points the layout at the clone. Default mode only: capturing
synchronises the device, which graph mode (sync=False) promises never to do.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ditron_ep.ops.ep.layout_kernels import RecvLayout, SendLayout, recv_layout_shapes, send_layout_shapes
from ditron_ep.runtime.fast_launch import current_stream

__all__ = ["Int32Arena", "CapturedLayout", "layout_arena_words", "rebuild_layout", "view_recipe"]

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


@dataclass
class CapturedLayout:
    """One default-mode dispatch signature's layout launches as a CUDA graph, and the static
    tensors it reads and writes (EPBuffer._layout_statics / _layout_launches)."""

    topk_idx: torch.Tensor         # static input: each replay copies the call's routing in
    graph: torch.cuda.CUDAGraph    # the layout launches, then the status copy
    arena: Int32Arena              # every layout tensor the graph writes
    status: torch.Tensor           # pinned host copy of the layout status words
    ready: torch.cuda.Event        # recorded after the replay: wait on it before reading `status`
    send: SendLayout | None = None  # views of the arena (set by the launches)
    recv: RecvLayout | None = None
    recipes: tuple | None = None   # (send, recv) view recipes, worked out at the first replay

    def replay(self, topk_idx: torch.Tensor) -> tuple[SendLayout, RecvLayout]:
        """Queue this call's layout on the current stream; return it, copied out of the graph's
        memory (the handle keeps it past the next replay). No host sync: wait on `ready` before
        reading `status`."""
        self.topk_idx.copy_(topk_idx)
        self.graph.replay()
        self.ready.record(current_stream() if self.topk_idx.is_cuda else None)
        flat = self.arena.flat
        if self.recipes is None:
            self.recipes = (view_recipe(self.send, flat), view_recipe(self.recv, flat))
        snap = flat[:self.arena.used].clone()
        return rebuild_layout(self.recipes[0], snap), rebuild_layout(self.recipes[1], snap)
