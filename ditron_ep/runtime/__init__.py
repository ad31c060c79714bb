"""Runtime: execution mode, symmetric heap and its backends, emulated-rank launcher."""
from ditron_ep.runtime.errors import DitronConfigError, DitronError, DitronTimeoutError, RankError
from ditron_ep.runtime.heap import SymmetricBuffer, SymmetricHeap, register_stage
from ditron_ep.runtime.launcher import EmulatedCluster, run_emulated
from ditron_ep.runtime.mode import kernels_interpreted, mode_source, resolve_backend, use_interpreter

__all__ = [
    "DitronConfigError", "DitronError", "DitronTimeoutError", "RankError", "SymmetricBuffer",
    "SymmetricHeap", "register_stage", "EmulatedCluster", "run_emulated", "kernels_interpreted",
    "resolve_backend", "mode_source", "use_interpreter",
]
