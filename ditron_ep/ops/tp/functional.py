"""GEMM + collective ops of tensor parallelism, with autograd: AllGather+GEMM, GEMM+ReduceScatter,
GEMM+AllReduce, on the process group's ranks.

    all_gather_matmul(a, b)      a [M, K] on each rank, b [K, N]   -> cat_r(a_r) @ b          [W*M, N]
    matmul_reduce_scatter(a, b)  a [W*M, K] on each rank, b [K, N] -> rows r*M:(r+1)*M of Σ_ranks a @ b
    matmul_all_reduce(a, b)      a [M, K] on each rank, b [K, N]   -> Σ_ranks a_r @ b_r        [M, N]

The default **sequential schedule** runs the collective, then (or before) the GEMM, as separate
steps: torch.distributed moves the rows, `gemm.matmul` (the expert-MLP kernels with one expert)
multiplies. `schedule="overlap"` (every op) runs one persistent launch that overlaps them at
tile granularity (fused.py), bitwise equal to the sequential one.

Determinism: every GEMM output element is one fp32 accumulation over K in order; the reductions
(GEMM+RS, GEMM+AR and the gradients that are reductions) keep each rank's partial in fp32 and add
the partials in rank order 0, 1, ..., W-1 in fp32, then cast once: bitwise run to run, and
GEMM+AR's result is bitwise identical on every rank. AllGather+GEMM is bitwise equal to an
all-gather followed by the same GEMM kernel.

Bad input — tensors that are not 2-D, inner dimensions that do not match, dtypes or devices that
differ, shapes that differ between ranks, rows not divisible by W — raises a DitronConfigError on
every rank before any row moves (`runtime.agreement.agree`: one small gather of every rank's
verdict and shapes).

Gradients (each a GEMM + collective of the other kind):
    all_gather_matmul:     da = reduce-scatter of dy @ bᵀ (this rank's rows),  db = gatheredᵀ @ dy
    matmul_reduce_scatter: da = all-gather(dy) @ bᵀ,                            db = aᵀ @ all-gather(dy)
    matmul_all_reduce:     da = dy @ bᵀ,                                        db = aᵀ @ dy
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.compiler.core_config import GemmTileConfig, device_type_of
from ditron_ep.compiler.tp_plan import planned_tile, sequential_tile
from ditron_ep.ops.tp.gemm import matmul
from ditron_ep.runtime.agreement import agree_words, require_member

__all__ = ["all_gather_matmul", "all_gather_rows", "matmul_all_reduce", "matmul_reduce_scatter",
           "reduce_scatter_rows", "sum_in_rank_order"]


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the GEMM + collective ops need torch.distributed initialised (every rank of `group` "
                           "calls them); on a CPU run them under ditron_ep.runtime.EmulatedCluster")
    require_member(group, "the GEMM + collective op")
    return dist.get_world_size(group), dist.get_rank(group)


def _describe(t: object) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _pair_problem(a: object, b: object) -> str | None:
    """Why (a, b) is not a pair of 2-D tensors with a @ b defined, same dtype and device."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return f"a and b must be tensors, got {_describe(a)} and {_describe(b)}"
    if a.dim() != 2 or b.dim() != 2:
        return f"a and b must be 2-D, got a {tuple(a.shape)} and b {tuple(b.shape)}"
    if a.shape[1] != b.shape[0]:
        return f"a's columns ({a.shape[1]}) must equal b's rows ({b.shape[0]}): a {tuple(a.shape)}, b {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"a and b must have one dtype, got {a.dtype} and {b.dtype}"
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"dtype must be float32, float16 or bfloat16, got {a.dtype}"
    if a.device != b.device:
        return f"a and b must be on one device, got {a.device} and {b.device}"
    return None


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """cat over ranks (rank order) of every rank's x [M, ...] -> [W*M, ...]."""
    world, _ = _world(group)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x.contiguous(), group=group)
    return out


def sum_in_rank_order(parts: torch.Tensor) -> torch.Tensor:
    """Σ_r parts[r] over the first dimension, r = 0, 1, ... in order, in parts' dtype (fp32 here)."""
    acc = parts[0].clone()
    for r in range(1, parts.shape[0]):
        acc.add_(parts[r])
    return acc


def reduce_scatter_rows(partial: torch.Tensor, group: dist.ProcessGroup | None, dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows [M, ...] of Σ_ranks partial [W*M, ...] (fp32), added in rank order, cast once."""
    world, _ = _world(group)
    recv = torch.empty_like(partial)
    dist.all_to_all_single(recv, partial.contiguous(), group=group)  # recv[s*M:(s+1)*M]: rank s's partial of my rows
    return sum_in_rank_order(recv.view(world, -1, *partial.shape[1:])).to(dtype)


def _all_reduce_rows(partial: torch.Tensor, group: dist.ProcessGroup | None, dtype: torch.dtype) -> torch.Tensor:
    """Σ_ranks partial (fp32), added in rank order on every rank (bitwise identical everywhere), cast once."""
    world, _ = _world(group)
    return sum_in_rank_order(all_gather_rows(partial, group).view(world, *partial.shape)).to(dtype)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, return_gathered, overlap):
        if overlap:
            from ditron_ep.ops.tp.fused import overlapped_all_gather_matmul

            y, gathered = overlapped_all_gather_matmul(a, b, group, return_gathered=True)
        else:
            gathered = all_gather_rows(a, group)
            y = matmul(gathered, b)
        ctx.save_for_backward(gathered, b)
        ctx.group, ctx.rows = group, a.shape[0]
        if return_gathered:
            ctx.mark_non_differentiable(gathered)
            return y, gathered
        return y

    @staticmethod
    def backward(ctx, dy, *_):
        gathered, b = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:
            da = reduce_scatter_rows(matmul(dy, b.t(), out_dtype=torch.float32), ctx.group, gathered.dtype)
        if ctx.needs_input_grad[1]:
            db = matmul(gathered.t(), dy)
        return da, db, None, None, None


def matmul_grads(ctx, a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor) -> tuple:
    """(da, db) of y = a @ b for the inputs that need them: dy @ bᵀ and aᵀ @ dy (`gemm.matmul`)."""
    da = matmul(dy, b.t()) if ctx.needs_input_grad[0] else None
    db = matmul(a.t(), dy) if ctx.needs_input_grad[1] else None
    return da, db


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, overlap, tile):
        ctx.save_for_backward(a, b)
        ctx.group = group
        if overlap:
            from ditron_ep.ops.tp.fused import overlapped_matmul_reduce_scatter

            return overlapped_matmul_reduce_scatter(a, b, group, tile)
        return reduce_scatter_rows(matmul(a, b, out_dtype=torch.float32), group, a.dtype)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        return (*matmul_grads(ctx, a, b, all_gather_rows(dy, ctx.group)), None, None, None)


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, overlap, tile):
        ctx.save_for_backward(a, b)
        if overlap:
            from ditron_ep.ops.tp.fused import overlapped_matmul_all_reduce

            return overlapped_matmul_all_reduce(a, b, group, tile)
        return _all_reduce_rows(matmul(a, b, out_dtype=torch.float32), group, a.dtype)

    @staticmethod
    def backward(ctx, dy):
        return (*matmul_grads(ctx, *ctx.saved_tensors, dy), None, None, None)


def _agree(group, what: str, a, b, problem: str | None, fields: tuple[str, ...], schedule: str = "sequential",
           tile_rows: int | None = None) -> tuple[GemmTileConfig, str] | None:
    """Every rank's verdict and `fields` (of a, b: "rows", "K", "N", "dtype") compared in one small
    all_gather (agreement.agree_words); DitronConfigError on every rank if any rank has a problem
    or a field differs. tile_rows (the overlapped GEMM+RS / GEMM+AR, whose output tiles are the
    grid of their signals on every rank): the GEMM tile of a product of tile_rows rows, the same
    on every rank — each rank's `planned_tile` rides along, and if any differs (tuner caches that
    differ between hosts, GEMM+AR's per-rank K under different entries) every rank takes the
    shape rule's (of rows and N, which agree). Same bits either way (tuner.tune_tp_gemm)."""
    def value(f: str) -> object:
        if problem is not None:
            return 0
        return {"rows": a.shape[0], "K": a.shape[1], "N": b.shape[1], "dtype": a.dtype, "schedule": schedule}[f]
    device = a.device if isinstance(a, torch.Tensor) else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    planned = None
    if tile_rows is not None and problem is None:
        dtype = str(a.dtype).removeprefix("torch.")
        device_type = device_type_of(device)
        planned = planned_tile(dtype, device_type, tile_rows, a.shape[1], b.shape[1])
    words = agree_words(group, what, problem, {f: value(f) for f in fields}, device,
                        extra=() if tile_rows is None else (tile_word(planned[0]) if planned else 0,))
    if planned is None or len(set(words)) == 1:
        return planned
    return sequential_tile(dtype, device_type, tile_rows, b.shape[1]), "rule"


def tile_word(cfg: GemmTileConfig) -> int:
    """A GEMM tile as one int32 word for the agreement (log2 of each size, warps, stages)."""
    return (cfg.block_m.bit_length() | cfg.block_n.bit_length() << 4 | cfg.block_k.bit_length() << 8
            | cfg.num_warps.bit_length() << 12 | cfg.num_stages << 16)


SCHEDULES = ("sequential", "overlap")


def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                      return_gathered: bool = False, schedule: str = "sequential"):
    """cat_r(a_r) @ b: a [M, K] on every rank (the same M and K), b [K, N] (its own N per rank);
    returns y [W*M, N] (and the gathered a [W*M, K] when return_gathered). Collective.
    schedule "overlap": one persistent launch on a symmetric heap that multiplies each chunk of
    rows as it lands (fused.py), bitwise equal to "sequential" (the all-gather, then the GEMM)."""
    _world(group)  # torch.distributed must be initialised
    problem = _pair_problem(a, b)
    if problem is None and schedule not in SCHEDULES:
        problem = f"schedule must be one of {SCHEDULES}, got {schedule!r}"
    _agree(group, "all_gather_matmul", a, b, problem, ("rows", "K", "dtype", "schedule"),
           schedule=schedule)
    # an empty a takes the sequential path on every rank (its rows and K agree; N may differ per rank,
    # and a rank with N = 0 only gathers, in the kernel too)
    return _AllGatherMatmul.apply(a, b, group, bool(return_gathered), schedule == "overlap" and a.numel() > 0)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                          schedule: str = "sequential") -> torch.Tensor:
    """Rows [r*M, (r+1)*M) of Σ_ranks a @ b on rank r: a [W*M, K], b [K, N] (the same shapes on
    every rank); returns [M, N]. Collective. schedule "overlap": one persistent launch on a
    symmetric heap in which each partial tile lands in its rows' owner's buffer as it is computed
    and each owner adds a tile's partials as soon as all have landed (fused.py), bitwise equal to
    "sequential" (the fp32 partial, an all-to-all, the partials added in rank order)."""
    world, _ = _world(group)
    problem = _pair_problem(a, b)
    if problem is None and a.shape[0] % world:
        problem = f"a's rows ({a.shape[0]}) must be a multiple of the group's {world} ranks"
    if problem is None and schedule not in SCHEDULES:
        problem = f"schedule must be one of {SCHEDULES}, got {schedule!r}"
    tile = _agree(group, "matmul_reduce_scatter", a, b, problem, ("rows", "K", "N", "dtype", "schedule"),
                  schedule=schedule, tile_rows=a.shape[0] if schedule == "overlap" else None)
    # (an empty product takes the sequential path: every rank's shapes agree, so every rank does)
    return _MatmulReduceScatter.apply(a, b, group, schedule == "overlap" and a.numel() * b.numel() > 0, tile)


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                      schedule: str = "sequential") -> torch.Tensor:
    """Σ_ranks a_r @ b_r on every rank (bitwise the same everywhere): a [M, K], b [K, N], M and N
    the same on every rank (K may differ). Collective. schedule "overlap": one persistent launch
    in which each output tile's partials land in its owner's buffer, the owner adds them and
    writes the sum to every rank (fused.py), bitwise equal to "sequential"."""
    _world(group)  # torch.distributed must be initialised
    problem = _pair_problem(a, b)
    if problem is None and schedule not in SCHEDULES:
        problem = f"schedule must be one of {SCHEDULES}, got {schedule!r}"
    # K: each rank's own shard
    tile = _agree(group, "matmul_all_reduce", a, b, problem, ("rows", "N", "dtype", "schedule"), schedule=schedule,
                  tile_rows=a.shape[0] if schedule == "overlap" else None)
    # an empty result takes the sequential path on every rank (M and N agree; K = 0 on a rank is
    # a zero partial, which the kernel adds like any other)
    return _MatmulAllReduce.apply(a, b, group, schedule == "overlap" and a.shape[0] * b.shape[1] > 0, tile)
