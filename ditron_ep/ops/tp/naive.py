"""float64 references of the GEMM + collective ops, on every rank's operands (gathered by the caller)."""
from __future__ import annotations

import torch

__all__ = ["all_gather_matmul_ref", "matmul_all_reduce_ref", "matmul_reduce_scatter_ref"]


def all_gather_matmul_ref(a_all: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """cat(a_all) @ b in float64 (a_all: every rank's a, rank order)."""
    return torch.cat([a.double() for a in a_all]) @ b.double()


def matmul_reduce_scatter_ref(a_all: list[torch.Tensor], b_all: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Rows of `rank` of Σ_r a_r @ b_r in float64."""
    total = sum(a.double() @ b.double() for a, b in zip(a_all, b_all))
    m = total.shape[0] // len(a_all)
    return total[rank * m:(rank + 1) * m]


def matmul_all_reduce_ref(a_all: list[torch.Tensor], b_all: list[torch.Tensor]) -> torch.Tensor:
    """Σ_r a_r @ b_r in float64."""
    return sum(a.double() @ b.double() for a, b in zip(a_all, b_all))
