"""EP dispatch and combine.

* `buffer.py`      — `EPBuffer` (owns the heap; `dispatch` returns a `DispatchHandle` that
                     `combine` consumes), the launchers and the autograd Functions;
* `functional.py`  — `dispatch` / `combine` on one buffer per process group (`BufferSlot`);
* `*_kernels.py`   — the Triton kernels: routing layout and counts exchange (the call record),
                     dispatch, combine;
* `layout_replay.py` — the layout's CUDA-graph replay arena.
"""
from ditron_ep.ops.ep.buffer import CapacityError, DispatchHandle, EPBuffer, RoutingError
from ditron_ep.ops.ep.functional import clear_cache, combine, dispatch, get_buffer

__all__ = ["CapacityError", "DispatchHandle", "EPBuffer", "RoutingError", "clear_cache", "combine", "dispatch",
           "get_buffer"]
