"""The one table of per-dtype tolerances against the float64 oracle, and the check that uses it.

An element passes when |actual - expected| <= atol + rtol * |expected| (as `torch.allclose`).
The numbers assume outputs of order 1 (inputs scaled so; see the tests) and inputs already in
the given dtype, so the oracle sees exactly the same input values:

* bfloat16 / float16 — the output cast alone costs up to half an ulp (2^-9 ≈ 2e-3 for bf16,
  2^-11 ≈ 5e-4 for fp16); kernels may also round the SwiGLU activation to the dtype before the
  second GEMM. The bounds leave ~4-5x margin over one rounding.
* float32 — float32 accumulation over H and I terms; on the GPU this holds only with
  `input_precision="ieee"` (a fp32 `tl.dot` defaults to TF32 there).
"""
from __future__ import annotations

import torch

# dtype -> (rtol, atol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}


def assert_close_to_oracle(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype,
                           what: str) -> None:
    """Raise AssertionError unless `actual` matches the float64 `expected64` within TOLERANCES.

    Args:
        actual: result computed in (or returned as) `dtype`, any shape.
        expected64: float64 oracle result, same shape.
        dtype: the input dtype that selects the tolerance.
        what: names the result in the message (e.g. "rank 1 output").

    The message gives the number of failing elements, the worst absolute and relative error and
    where the worst absolute error sits.
    """
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerance for {dtype}; TOLERANCES covers "
                         f"{', '.join(str(d) for d in TOLERANCES)}")
    rtol, atol = TOLERANCES[dtype]
    if actual.shape != expected64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != oracle shape "
                             f"{tuple(expected64.shape)}")
    got = actual.detach().to(device="cpu", dtype=torch.float64)
    want = expected64.detach().to(device="cpu", dtype=torch.float64)
    if got.numel() == 0:
        return
    abs_err = (got - want).abs()
    # NaN/inf in the result (or the oracle) must fail, never compare as "close".
    abs_err = torch.where(torch.isfinite(got) & torch.isfinite(want), abs_err,
                          torch.full_like(abs_err, float("inf")))
    bad = abs_err > atol + rtol * want.abs()
    if not bool(bad.any()):
        return
    rel_err = abs_err / want.abs().clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(abs_err.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), got.shape))
    raise AssertionError(
        f"{what}: {int(bad.sum())}/{got.numel()} elements outside {dtype} tolerance "
        f"(rtol={rtol:g}, atol={atol:g}); max abs err {float(abs_err.max()):.3e} at {index} "
        f"(got {float(got.reshape(-1)[worst]):.6g}, oracle {float(want.reshape(-1)[worst]):.6g}), "
        f"max rel err {float(rel_err.max()):.3e}")
