"""Registry entry "tp_mlp": the tensor-parallel MLP block — ColumnParallelLinear → GELU →
RowParallelLinear (`ditron_ep.ops.tp.modules`) — forward and backward, against the same block on
NCCL + cuBLAS with torch autograd.

Tokens = T, the block's rows per rank (sequence-parallel, the default: each rank holds T rows, the
column layer gathers W·T, the row layer reduce-scatters back to T; `--opt sequence_parallel=0`:
every rank holds the same T rows, the row layer all-reduces). H = --hidden, F = --inter (the FFN
width, split over the ranks). One iteration: y = block(x); torch.autograd.grad(y, (x, W1, b1, W2, b2),
grad_out). Rows:
    ours TP MLP, fwd+bwd          the modules with schedule "sequential";
    ours overlap TP MLP, fwd+bwd  schedule "overlap" (the overlapped GEMM + collective kernels),
                                  checked bitwise against the sequential one;
    NCCL+cuBLAS TP MLP, fwd+bwd   the same block with torch.distributed.nn's all_gather /
                                  reduce_scatter / all_reduce (autograd) and F.linear (cuBLAS).
Work: the block's GEMM FLOPs on one rank, 3 × 2 × 2·rows·H·F/W (forward, and the two backward
GEMMs per forward GEMM), rows = W·T sequence-parallel, else T. Check: ours' output and every
gradient against NCCL+cuBLAS's, max |diff| / max |ref| over every rank, output within the dtype's
rtol, gradients within twice it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

from ditron_ep.bench.ranks import StageFailed, all_ranks, checked_runs, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement, Option, Shape, boolean
from ditron_ep.check.tolerances import TOLERANCES

OURS, OVERLAP, THEIRS = "ours TP MLP, fwd+bwd", "ours overlap TP MLP, fwd+bwd", "NCCL+cuBLAS TP MLP, fwd+bwd"
GRADS = ("y", "x", "W1", "b1", "W2", "b2")


def _torch_block(x, w1, b1, w2, b2, group, sequence_parallel: bool) -> torch.Tensor:
    """ColumnParallel → GELU → RowParallel on torch ops: w1 [F/W, H], b1 [F/W], w2 [H, F/W], b2 [H]."""
    world = dist.get_world_size(group)
    if sequence_parallel:
        x = torch.cat(dist_nn.all_gather(x, group=group))
    else:  # a replicated input: its gradient is summed over the ranks
        x = _CopyToGroup.apply(x, group)
    h = F.gelu(F.linear(x, w1, b1))
    partial = F.linear(h, w2)
    if sequence_parallel:
        y = dist_nn.reduce_scatter(torch.empty_like(partial[: partial.shape[0] // world]),
                                   list(partial.chunk(world)), group=group)
    else:
        y = _ReduceFromGroup.apply(partial, group)
    return y + b2


class _ReduceFromGroup(torch.autograd.Function):
    """all_reduce (NCCL); backward: identity — the replicated output's loss counts once, as Megatron's
    reduce_from_tensor_model_parallel_region (torch.distributed.nn's all_reduce would sum the
    ranks' gradients again)."""

    @staticmethod
    def forward(ctx, partial, group):
        out = partial.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _CopyToGroup(torch.autograd.Function):
    """Identity; backward: all_reduce of the gradient (NCCL), as Megatron's copy_to_tensor_model_parallel_region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        dx = dx.contiguous()
        dist.all_reduce(dx, group=ctx.group)
        return dx, None


def run_tp_mlp(ctx: BenchContext, tokens: int) -> list[Measurement]:
    from ditron_ep.ops.tp import ColumnParallelLinear, RowParallelLinear

    s, W, dev, dt = ctx.shape, ctx.world, ctx.device, ctx.dtype
    sp = ctx.options.get("sequence_parallel", True)
    rows = W * tokens if sp else tokens
    work = 3.0 * 2 * (2.0 * rows * s.hidden * s.inter / W)
    names = [OURS, OVERLAP, THEIRS]
    try:
        layers = guarded(ctx, "TP layers", lambda: {
            sched: (ColumnParallelLinear(s.hidden, s.inter, group=ctx.group, sequence_parallel=sp, dtype=dt, device=dev,
                                         schedule=sched),
                    RowParallelLinear(s.inter, s.hidden, group=ctx.group, sequence_parallel=sp, dtype=dt, device=dev,
                                      schedule=sched))
            for sched in ("sequential", "overlap")})
        g = torch.Generator(device=dev).manual_seed(ctx.seed * 1000 + 7 + (ctx.rank if sp else 0))
        x = torch.randn(tokens, s.hidden, generator=g, device=dev).to(dt)
        grad_out = torch.randn(tokens, s.hidden, generator=g, device=dev).to(dt)
    except StageFailed as exc:
        return [Measurement(n, ok=False, error=str(exc)) for n in names]
    col, row = layers["sequential"]
    for c, r in layers.values():  # one set of weights: the modules made this rank's shard the same way
        c.load_state_dict(col.state_dict())
        r.load_state_dict(row.state_dict())
    params = (col.weight, col.bias, row.weight, row.bias)

    def ours(sched: str) -> Callable[[], tuple]:
        c, r = layers[sched]

        def step() -> tuple:
            with torch.enable_grad():
                leaf = x.detach().requires_grad_()
                y = r(F.gelu(c(leaf)))
                return (y.detach(), *torch.autograd.grad(y, (leaf, c.weight, c.bias, r.weight, r.bias), grad_out))
        return step

    def theirs() -> tuple:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (x, *params)]
            y = _torch_block(*leaves, ctx.group, sp)
            return (y.detach(), *torch.autograd.grad(y, leaves, grad_out))

    steps = {OURS: ours("sequential"), OVERLAP: ours("overlap"), THEIRS: theirs}
    errors: dict[str, str] = {}
    results = checked_runs(ctx, steps, errors)
    checks: dict[str, tuple[str, bool]] = {THEIRS: ("reference", True)}
    rtol = TOLERANCES[dt][0]
    if THEIRS in results and OURS in results:
        rel = {n: relative_errors(ctx, w, {"g": o})["g"] for n, w, o in zip(GRADS, results[THEIRS], results[OURS])}
        worst = max(GRADS[1:], key=rel.get)
        ok = rel["y"] <= rtol and rel[worst] <= 2 * rtol
        checks[OURS] = (f"{'ok' if ok else 'FAIL'}: y {rel['y']:.1e}, grads <= {rel[worst]:.1e} ({worst}) vs "
                        f"NCCL+cuBLAS", ok)
    if OURS in results and OVERLAP in results:
        same = all_ranks(ctx, all(torch.equal(a, b) for a, b in zip(results[OURS], results[OVERLAP])))
        checks[OVERLAP] = ("bitwise = ours (y and every gradient)" if same else "FAIL: differs from ours", same)
    del results
    return [Measurement(n, work=work, ok=False, error=errors[n]) if n in errors else
            ctx.measure(n, steps[n], work, *checks.get(n, ("not checked: a row it is checked against failed", False)),
                        details={"rows": rows, "sequence_parallel": sp})
            for n in names]


def plan_tp_mlp(req: BenchRequest, tokens: int, options: Mapping[str, Any], on_gpu: bool) -> tuple[Impl, ...]:
    return Impl(OURS, against=(THEIRS,)), Impl(OVERLAP, against=(THEIRS,)), Impl(THEIRS, "baseline")


def validate(req: BenchRequest, options: Mapping[str, Any], world_size: int) -> str | None:
    if world_size < 2:
        return "tp_mlp needs at least 2 ranks (--world-size, or torchrun --nproc-per-node)"
    if req.shape.inter is None or req.shape.inter % world_size:
        return f"--inter (the FFN width) must be a multiple of the world size {world_size}"
    return None


TP_MLP = Benchmark(
    name="tp_mlp",
    description="the tensor-parallel MLP block (ColumnParallelLinear -> GELU -> RowParallelLinear), forward + backward, "
                "sequential and overlapped schedules vs the same block on NCCL + cuBLAS",
    metric="TFLOP/s", work_rule="FLOPs = this rank's GEMMs, 3 x 2 x 2*rows*H*F/W (forward and backward)",
    check_rule="output and every gradient vs NCCL+cuBLAS's within the dtype's rtol (gradients: twice it); the "
               "overlapped schedule bitwise equal to the sequential one",
    shapes={"emulated": Shape(hidden=32, experts=1, topk=1, inter=48),
            "torch": Shape(hidden=8192, experts=1, topk=1, inter=28672)},
    tokens={"emulated": (8,), "torch": (1024, 4096)}, plan=plan_tp_mlp, run=run_tp_mlp, default=False, ep=False,
    options=(Option("sequence_parallel", "rows sharded over the ranks (1, default) or replicated (0)", boolean, True),),
    validate=validate)
