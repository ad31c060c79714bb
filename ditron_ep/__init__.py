"""ditron_ep: expert-parallel MoE megakernels in stock Triton, with deterministic token ordering.

Importing the package has no side effects: the kernel mode (compiled or Triton interpreter) is
fixed when the first kernel module is imported — see `ditron_ep.runtime.mode`.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
