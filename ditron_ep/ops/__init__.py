"""Public ops, one folder per op: `ep/` (dispatch and combine) and `moe_layer/` (the MoE layer)."""
from ditron_ep.runtime.mode import decide_mode

decide_mode()  # before any module below imports triton (see ditron_ep.runtime.mode)

from ditron_ep.ops.ep import (CapacityError, DispatchHandle, EPBuffer, RoutingError, clear_cache, combine,  # noqa: E402
                              dispatch, get_buffer)
from ditron_ep.ops.moe_layer import EPMoE, FusedMoE, clear_layers, grouped_mlp, moe  # noqa: E402

__all__ = ["CapacityError", "DispatchHandle", "EPBuffer", "EPMoE", "FusedMoE", "RoutingError", "clear_cache",
           "clear_layers", "combine", "dispatch", "get_buffer", "grouped_mlp", "moe"]
