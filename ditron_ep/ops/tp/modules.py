"""Megatron-style tensor-parallel linear layers on the GEMM + collective ops.

ColumnParallelLinear: y = x @ Wᵀ (+ b) with W's rows (output features) split over the group:
each rank holds W_r [out/W, in] and b_r, and gets its slice of the output features. With
sequence_parallel the input arrives sequence-sharded (this rank's rows of the tokens) and is
gathered by `all_gather_matmul`; without it the input is replicated, and its gradient is summed
over the ranks (in rank order: `copy_to_group`'s backward). gather_output=True returns every
feature (an all-gather of the columns).

RowParallelLinear: y = x @ Wᵀ + b with W's columns (input features) split: each rank holds
W_r [out, in/W] and multiplies its input slice; the partial products are summed by
`matmul_all_reduce` (y replicated) or, with sequence_parallel, `matmul_reduce_scatter` (y
sequence-sharded). The bias is added once, after the sum; under sequence parallelism its
gradient on each rank covers that rank's rows only (`bias.sequence_parallel = True`, as Megatron
marks it: sum it over the group, as Megatron's optimizer does).

Tokens are the rows of x.reshape(-1, features): sequence sharding splits those rows in rank order.
schedule="overlap" runs the GEMM + collective ops on their overlapped kernels (the same bits).
`from_linear(linear, group=...)` shards an existing nn.Linear (every rank holding the same one).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ditron_ep.ops.tp.functional import (SCHEDULES, _world, all_gather_matmul, all_gather_rows, matmul_all_reduce,
                                        matmul_grads, matmul_reduce_scatter, sum_in_rank_order)
from ditron_ep.ops.tp.gemm import matmul
from ditron_ep.runtime.errors import DitronConfigError

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "copy_to_group", "gather_columns"]


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward: the sum over the group's ranks of the gradient (rank order, fp32)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        world, _ = _world(ctx.group)
        parts = all_gather_rows(dx.float().contiguous(), ctx.group).view(world, *dx.shape)
        return sum_in_rank_order(parts).to(dx.dtype), None


def copy_to_group(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """x, whose gradient is summed over the group (a replicated input of column-parallel layers)."""
    return _CopyToGroup.apply(x, group)


class _GatherColumns(torch.autograd.Function):
    """[T, n] per rank -> [T, W*n] (ranks' columns in rank order); backward: this rank's columns."""

    @staticmethod
    def forward(ctx, y, group):
        world, rank = _world(group)
        ctx.rank, ctx.n = rank, y.shape[1]
        parts = all_gather_rows(y.t().contiguous(), group)  # [W*n, T]
        return parts.t().contiguous()

    @staticmethod
    def backward(ctx, dy):
        return dy[:, ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None


def gather_columns(y: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    return _GatherColumns.apply(y, group)


def _split(total: int, world: int, what: str) -> int:
    if total % world:
        raise DitronConfigError(f"{what} ({total}) must be a multiple of the group's {world} ranks")
    return total // world


class _ParallelLinear(nn.Module):
    def _shard(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """This rank's parts of a whole layer's weight and bias."""
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group: dist.ProcessGroup | None = None, **kw):
        """This rank's shard of `linear` (the same on every rank): see the subclass's `_shard`."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    dtype=linear.weight.dtype, device=linear.weight.device, **kw)
        weight, bias = layer._shard(linear.weight, linear.bias)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
        return layer

    def _init(self, weight_shape, fan_in: int, bias_size: int | None, dtype, device) -> None:
        self.weight = nn.Parameter(torch.empty(weight_shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(bias_size, dtype=dtype, device=device)) if bias_size else None
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        gen = torch.Generator().manual_seed(1234 + self.rank)  # a different shard per rank, reproducible
        with torch.no_grad():
            self.weight.copy_(torch.empty(weight_shape).uniform_(-bound, bound, generator=gen))
            if self.bias is not None:
                self.bias.copy_(torch.empty(bias_size).uniform_(-bound, bound, generator=gen))


class ColumnParallelLinear(_ParallelLinear):
    """nn.Linear(in_features, out_features) with the output features split over `group`
    (module docstring). weight: [out_features / W, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, sequence_parallel: bool = False,
                 gather_output: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, schedule: str = "sequential") -> None:
        super().__init__()
        self.world, self.rank = _world(group)
        self.group, self.sequence_parallel, self.gather_output = group, bool(sequence_parallel), bool(gather_output)
        self.schedule = _check_schedule(schedule)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _split(out_features, self.world, "out_features")
        self._init((self.out_per_rank, in_features), in_features, self.out_per_rank if bias else None, dtype, device)

    def _shard(self, weight, bias):
        """Rows r*out/W:(r+1)*out/W of the weight and the bias."""
        rows = slice(self.rank * self.out_per_rank, (self.rank + 1) * self.out_per_rank)
        return weight[rows], None if bias is None else bias[rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.sequence_parallel:
            y = all_gather_matmul(x2, self.weight.t(), group=self.group, schedule=self.schedule)
            lead = (y.shape[0],)  # every rank's rows, in rank order
        else:
            y = _LocalMatmul.apply(copy_to_group(x2, self.group), self.weight.t())
        if self.bias is not None:
            y = y + self.bias
        if self.gather_output:
            y = gather_columns(y, self.group)
        return y.reshape(*lead, y.shape[-1])


class RowParallelLinear(_ParallelLinear):
    """nn.Linear(in_features, out_features) with the input features split over `group` (module
    docstring). weight: [out_features, in_features / W]; x: this rank's input features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 schedule: str = "sequential") -> None:
        super().__init__()
        self.world, self.rank = _world(group)
        self.group, self.sequence_parallel = group, bool(sequence_parallel)
        self.schedule = _check_schedule(schedule)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _split(in_features, self.world, "in_features")
        self._init((out_features, self.in_per_rank), in_features, out_features if bias else None, dtype, device)
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel

    def _shard(self, weight, bias):
        """Columns r*in/W:(r+1)*in/W of the weight, the whole bias."""
        cols = slice(self.rank * self.in_per_rank, (self.rank + 1) * self.in_per_rank)
        return weight[:, cols], bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_per_rank)
        if self.sequence_parallel:
            y = matmul_reduce_scatter(x2, self.weight.t(), group=self.group, schedule=self.schedule)
            lead = (y.shape[0],)  # this rank's rows
        else:
            y = matmul_all_reduce(x2, self.weight.t(), group=self.group, schedule=self.schedule)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


def _check_schedule(schedule: object) -> str:
    if schedule not in SCHEDULES:
        raise DitronConfigError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return schedule


class _LocalMatmul(torch.autograd.Function):
    """a @ b with `gemm.matmul` forward and backward (no communication)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return matmul(a, b)

    @staticmethod
    def backward(ctx, dy):
        return matmul_grads(ctx, *ctx.saved_tensors, dy)
