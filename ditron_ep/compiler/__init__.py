"""The tile compiler: plans (Task/Device/Core levels), lowering, verifier, tuner, and the
portability registry that compiles every kernel for sm_90 and gfx942."""
