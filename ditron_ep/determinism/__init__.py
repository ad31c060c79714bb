"""Determinism: routing generators, the sequential pure-torch reference over a process group,
the float64 single-process oracle, and the per-dtype tolerance table."""
from .oracle import ep_moe_oracle
from .reference import ep_moe_reference, validate_moe_inputs
from .routing import ROUTING_KINDS, make_routing, validate_routing
from .tolerances import TOLERANCES, assert_close_to_oracle

__all__ = [
    "ep_moe_oracle", "ep_moe_reference", "validate_moe_inputs", "ROUTING_KINDS", "make_routing",
    "validate_routing", "TOLERANCES", "assert_close_to_oracle",
]
