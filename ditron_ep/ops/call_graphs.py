"""Eager calls replayed from CUDA graphs: which call signatures get a captured launch sequence.

Why: at small T an eager fused-MoE call is bound by host time, not by the GPU: issuing its five
Triton launches (the megakernel takes ~75 arguments) and ~14 allocations cost 350-650 µs of host
time against 588 µs of GPU work (bench/diag/host_overhead.py, 4xH200, T=128), and the GPU idles
while the host issues. A replayed graph costs a few µs of host time per call.

Policy (the layer supplies the capture): a signature (token count, dtypes, weight addresses ...)
is captured on its SECOND call; its first call runs the launches directly, so it compiles the
kernels outside any capture and a shape seen once never pays for one. At most `capacity` captured
signatures are kept, the least recently used evicted (each holds its static inputs, output and
layout buffers in its own graph memory pool). capacity 0 disables capture.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

from ..compiler.plan import is_nonnegative_int

__all__ = ["CallGraphCache"]

Captured = TypeVar("Captured")


class CallGraphCache(Generic[Captured]):
    """Captured launch sequences by call signature, captured on a signature's second call.

    `lookup(key, capture)` returns the entry to replay, or None when the caller must launch
    directly (first sight of the key, or capacity 0). `capture()` builds the entry; if it raises,
    the key is forgotten and the error propagates.
    """

    def __init__(self, capacity: int) -> None:
        if not is_nonnegative_int(capacity):
            raise ValueError(f"graph cache capacity must be an int >= 0 (0 disables it), got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Captured] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()  # keys called once, not captured

    def lookup(self, key: Hashable, capture: Callable[[], Captured]) -> Captured | None:
        if self.capacity == 0:
            return None
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        if key not in self._seen:
            self._seen[key] = None
            while len(self._seen) > 4 * self.capacity:  # bounded: a stream of one-off shapes
                self._seen.popitem(last=False)
            return None
        del self._seen[key]
        while len(self._entries) >= self.capacity:
            self._entries.popitem(last=False)  # frees its graphs and their memory pool
        entry = self._entries[key] = capture()
        return entry

    def clear(self) -> None:
        """Drop every captured entry (their graphs point into buffers about to be freed)."""
        self._entries.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries
