"""ditron_ep: expert-parallel MoE megakernels in stock Triton, with deterministic token ordering.

Importing the package decides, once, whether kernels are compiled for a GPU or run by the Triton
interpreter (see `ditron_ep.runtime.mode`); kernel modules are imported only after that.
"""
from __future__ import annotations

from .runtime.mode import decide_mode as _decide_mode

_decide_mode()

__version__ = "0.1.0"

__all__ = ["__version__"]
