"""Eager calls replayed from CUDA graphs: which call signatures get a captured launch sequence.

Why: at small T an eager fused-MoE call is bound by host time, not by the GPU: issuing its five
Triton launches (the megakernel takes ~75 arguments) and ~14 allocations cost 350-650 µs of host
time against 588 µs of GPU work (bench/results/HISTORY.md: host_overhead, 4xH200, T=128), and the GPU idles
while the host issues. A replayed call costs about 100 µs of host time (input copies, the
replays, the output clone, the status read; bench/results/replay_steps_H200x2_20261122_s6.log).

Policy (the layer supplies the capture): a signature (token count, dtypes, weight addresses ...)
is captured on its SECOND call; its first call runs the launches directly, so it compiles the
kernels outside any capture and a shape seen once never pays for one. At most `capacity` captured
signatures are kept (each holds its static inputs, output and layout buffers in its own graph
memory pool). A newcomer evicts the least recently used one only if that one sat unused for the
last 4 * capacity lookups; otherwise the newcomer launches directly. Why: a capture synchronises
the device and empties torch's allocator cache (torch.cuda.graph does both), so plain LRU over
more recurring signatures than `capacity` (say 5 decode batch sizes in turn, capacity 4) would
recapture on every call. capacity 0 disables capture.
"""
from __future__ import annotations

import contextlib
import gc
import warnings
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterator, TypeVar

import torch

from ditron_ep.compiler.plan import is_nonnegative_int
from ditron_ep.runtime.errors import DitronError

__all__ = ["CallGraphCache", "graph_capture"]

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
        self._last_use: dict[Hashable, int] = {}  # lookup count at each entry's last replay
        self._lookups = 0
        self._seen: OrderedDict[Hashable, None] = OrderedDict()  # keys called once, not captured

    def lookup(self, key: Hashable, capture: Callable[[], Captured]) -> Captured | None:
        if self.capacity == 0:
            return None
        self._lookups += 1
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._last_use[key] = self._lookups
            return entry
        if key not in self._seen:
            self._seen[key] = None
            while len(self._seen) > 4 * self.capacity:  # bounded: a stream of one-off shapes
                self._seen.popitem(last=False)
            return None
        if len(self._entries) >= self.capacity:
            lru = next(iter(self._entries))
            if self._lookups - self._last_use[lru] < 4 * self.capacity:
                return None  # every kept signature is still in use: no thrash (module docstring)
            del self._entries[lru], self._last_use[lru]  # frees its graphs and their memory pool
        del self._seen[key]
        entry = self._entries[key] = capture()
        self._last_use[key] = self._lookups
        return entry

    def lookup_or_give_up(self, key: Hashable, capture: Callable[[], Captured], owner: str) -> Captured | None:
        """`lookup`, except that a capture raising RuntimeError (a CUDA capture problem, including
        running out of memory) must not fail the call: warn once, disable the cache (capacity 0)
        and return None (launch directly). The library's own errors propagate."""
        try:
            return self.lookup(key, capture)
        except DitronError:
            raise
        except RuntimeError as err:
            warnings.warn(f"{owner}: capturing this call's launches in a CUDA graph failed ({err}); it launches "
                          f"every call directly from now on (graph_cache=0)", RuntimeWarning, stacklevel=3)
            self.clear()
            self.capacity = 0
            return None

    def clear(self) -> None:
        """Drop every captured entry (their graphs point into buffers about to be freed)."""
        self._entries.clear()
        self._last_use.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool=None) -> Iterator[None]:
    """Capture into `graph` (sharing `pool` if given) with the garbage collector off: collecting a
    symmetric-memory arena inside a capture would synchronise the device and break the capture.
    The collector's state is restored afterwards (a caller may keep it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()
