"""Gates: `top2_capacity_gate` (top-2 routes with expert capacity, DeepSpeed's TopKGate semantics,
fused into two kernels; `naive.py` the torch reference)."""
from ditron_ep.ops.gate.top2 import top2_capacity_gate

__all__ = ["top2_capacity_gate"]
