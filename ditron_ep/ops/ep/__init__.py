"""EP dispatch and combine.

* `buffer.py`      — `EPBuffer` (owns the heap; `dispatch` returns a `DispatchHandle` that
                     `combine` consumes), the launchers and the autograd Functions;
* `functional.py`  — `dispatch` / `combine` on one cached buffer per process group;
* `*_kernels.py`   — the Triton kernels: routing layout and counts exchange, dispatch, combine,
                     the refusal stamp;
* `layout_replay.py` — the layout's CUDA-graph replay arena.
"""
from ditron_ep.ops.ep.buffer import CapacityError, DispatchHandle, EPBuffer, RoutingError
from ditron_ep.ops.ep.functional import clear_cache, combine, dispatch, get_buffer

__all__ = ["CapacityError", "DispatchHandle", "EPBuffer", "RoutingError", "clear_cache", "combine", "dispatch",
           "get_buffer"]
