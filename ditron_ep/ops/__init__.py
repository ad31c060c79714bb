"""Public ops: EP dispatch/combine (buffer object and functional forms)."""
from .ep_buffer import CapacityError, DispatchHandle, EPBuffer, RoutingError
from .functional import clear_cache, combine, dispatch, get_buffer

__all__ = ["CapacityError", "DispatchHandle", "EPBuffer", "RoutingError", "clear_cache", "combine",
           "dispatch", "get_buffer"]
