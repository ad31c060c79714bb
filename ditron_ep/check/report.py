"""Report rows of the checker (`python -m ditron_ep check`) and the comparisons they are made of.

The verdict is pure data: `CheckReport.ok` and `exit_status` decide from the `CaseResult`s alone,
so they are tested with fabricated results and no ranks at all.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class CaseResult:
    """One row of the report.

    max_abs / max_rel: largest absolute error, and that error over the largest |expected| value
    (a norm-wise relative error, meaningful where outputs cross zero); None where the case does
    not compare numbers. bitwise: whether the compared results were identical bit for bit
    (received tiles vs sent tiles; run vs run for the reference); None where not applicable.
    """

    case: str
    kind: str
    max_abs: float | None
    max_rel: float | None
    bitwise: bool | None
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        row = asdict(self)
        for key in ("max_abs", "max_rel"):
            row[key] = _json_float(row[key])
        return row


@dataclass(frozen=True)
class CheckReport:
    backend: str
    world_size: int
    seed: int
    cases: tuple[CaseResult, ...]
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when there is at least one case and every case passed."""
        return bool(self.cases) and all(c.ok for c in self.cases)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.ok]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "backend": self.backend, "world_size": self.world_size,
                "seed": self.seed, "wall_s": round(self.wall_s, 3),
                "cases": [c.to_json() for c in self.cases]}


def exit_status(report: CheckReport) -> int:
    """Process exit status of `ditron_ep check`: 0 when every case passed, else 1."""
    return 0 if report.ok else 1


def _json_float(v: float | None) -> float | str | None:
    # JSON has no inf/nan: keep them readable as strings instead of emitting invalid JSON.
    if v is None or math.isfinite(v):
        return v
    return str(v)


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (unlike torch.equal: NaN == NaN, -0 != +0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def max_abs_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in float64; inf if either holds a non-finite value; 0 when empty."""
    if got.numel() == 0:
        return 0.0
    err = (got.double() - want.double()).abs()
    return float(err.max()) if bool(err.isfinite().all()) else math.inf


def relative(max_abs: float, max_ref: float) -> float:
    """Norm-wise relative error: the largest error over the largest |expected| (0 when both are 0)."""
    if max_abs == 0.0:
        return 0.0
    return max_abs / max_ref if max_ref > 0 else math.inf
