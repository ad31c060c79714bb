"""Public ops: EP dispatch/combine (buffer object and functional forms), the grouped SwiGLU
expert FFN, and the MoE layer forward."""
from .ep_buffer import CapacityError, DispatchHandle, EPBuffer, RoutingError
from .functional import clear_cache, combine, dispatch, get_buffer
from .grouped_ffn import grouped_swiglu_ffn
from .moe import moe

__all__ = ["CapacityError", "DispatchHandle", "EPBuffer", "RoutingError", "clear_cache", "combine",
           "dispatch", "get_buffer", "grouped_swiglu_ffn", "moe"]
