"""Public ops: EP dispatch/combine (buffer object and functional forms), the grouped SwiGLU
expert FFN, the MoE layer forward (fused megakernel) and the EPMoE module."""
from .ep_buffer import CapacityError, DispatchHandle, EPBuffer, RoutingError
from .functional import clear_cache, combine, dispatch, get_buffer
from .fused_moe import FusedMoE
from .grouped_ffn import grouped_swiglu_ffn
from .moe import clear_layers, moe
from .moe_module import EPMoE

__all__ = ["CapacityError", "DispatchHandle", "EPBuffer", "EPMoE", "FusedMoE", "RoutingError", "clear_cache",
           "clear_layers", "combine", "dispatch", "get_buffer", "grouped_swiglu_ffn", "moe"]
