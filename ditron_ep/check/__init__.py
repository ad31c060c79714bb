"""The numerical-consistency checker (`python -m ditron_ep check`): routing generators, the
per-dtype tolerance table, the self-check cases (`selfcheck.py`, with the heap's own test kernels
in `kernels.py`) and the check of a user's MoE function (`against.py`)."""
from ditron_ep.check.routing import ROUTING_KINDS, make_routing, validate_routing
from ditron_ep.check.tolerances import TOLERANCES, assert_close_to_oracle

__all__ = ["ROUTING_KINDS", "make_routing", "validate_routing", "TOLERANCES", "assert_close_to_oracle"]
