"""The tile compiler: plans (Task/Device/Core levels), lowering, verifier, and the portability
registry that compiles every kernel for sm_90 and gfx942."""
from ditron_ep.compiler.lowering import lower
from ditron_ep.compiler.plan import MoESpec
from ditron_ep.compiler.verifier import verify

__all__ = ["MoESpec", "lower", "verify"]
