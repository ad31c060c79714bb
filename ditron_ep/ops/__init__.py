"""Public ops, one folder per op: `ep/` (dispatch and combine), `moe_layer/` (the MoE layer) and
`tp/` (tensor parallelism: GEMM + collective ops and linear layers)."""
from ditron_ep.runtime.mode import decide_mode

decide_mode()  # before any module below imports triton (see ditron_ep.runtime.mode)

from ditron_ep.ops.ep import (CapacityError, DispatchHandle, EPBuffer, RoutingError, clear_cache, combine,  # noqa: E402
                              dispatch, get_buffer)
from ditron_ep.ops.moe_layer import EPMoE, FusedMoE, clear_layers, grouped_mlp, moe  # noqa: E402
from ditron_ep.ops.tp import (ColumnParallelLinear, RowParallelLinear, all_gather_matmul,  # noqa: E402
                              matmul_all_reduce, matmul_reduce_scatter)

__all__ = ["CapacityError", "ColumnParallelLinear", "DispatchHandle", "EPBuffer", "EPMoE", "FusedMoE", "RoutingError",
           "RowParallelLinear", "all_gather_matmul", "clear_cache", "clear_layers", "combine", "dispatch", "get_buffer",
           "grouped_mlp", "matmul_all_reduce", "matmul_reduce_scatter", "moe"]
