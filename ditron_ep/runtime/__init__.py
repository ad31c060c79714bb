"""Runtime: execution mode, symmetric heap and its backends, emulated-rank launcher."""
from .errors import DitronConfigError, DitronError, DitronTimeoutError, RankError
from .heap import SymmetricBuffer, SymmetricHeap, register_stage
from .launcher import EmulatedCluster, run_emulated
from .mode import kernels_interpreted, resolve_backend

__all__ = [
    "DitronConfigError", "DitronError", "DitronTimeoutError", "RankError", "SymmetricBuffer",
    "SymmetricHeap", "register_stage", "EmulatedCluster", "run_emulated", "kernels_interpreted",
    "resolve_backend",
]
