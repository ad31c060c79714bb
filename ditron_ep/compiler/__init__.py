"""The tile compiler: plans (Task/Device/Core levels), lowering, verifier, and the portability
registry that compiles every kernel for sm_90 and gfx942."""
from .lowering import lower
from .plan import MoESpec
from .verifier import verify

__all__ = ["MoESpec", "lower", "verify"]
