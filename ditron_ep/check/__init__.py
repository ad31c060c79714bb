"""The numerical-consistency checker (`python -m ditron_ep check`): routing generators, the
per-dtype tolerance table, the self-check cases (`selfcheck.py`, with the heap's own test kernels
in `kernels.py`) and the check of a user's MoE function (`against.py`)."""
from ditron_ep.runtime.mode import decide_mode

decide_mode()  # before any module below imports triton (see ditron_ep.runtime.mode)

from ditron_ep.check.routing import ROUTING_KINDS, make_routing, validate_routing  # noqa: E402
from ditron_ep.check.tolerances import TOLERANCES, assert_close_to_oracle  # noqa: E402

__all__ = ["ROUTING_KINDS", "make_routing", "validate_routing", "TOLERANCES", "assert_close_to_oracle"]
