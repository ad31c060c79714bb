"""Registry entry "deepspeed_moe": one DeepSpeed MoE block (`deepspeed.moe.layer.MoE`), forward and
backward, DeepSpeed's own data path against `ditron_ep.integrations.deepspeed.replace_moe`.

The block: hidden H, experts `Sequential(Linear(H, I), GELU, Linear(I, H))` with biases, E experts
over the ranks (ep_size = world), top-k=2, capacity_factor 1.0 (drops on), no RTS and no
second-expert sampling (deterministic gates); the same gate and distinct experts on both
layers. One iteration: out, l_aux = block(x); torch.autograd.grad(sum(out * grad_out) + l_aux,
(x, every parameter)). Rows:
  replace_moe, fwd+bwd       the default, experts="modules": ditron_ep's gate kernels, dispatch and
                             combine around DeepSpeed's expert modules (one call per local expert on
                             its rows: cuBLAS GEMMs);
  replace_moe(experts='kernels'), fwd+bwd   ditron_ep's gate kernels, dispatch, grouped expert
                             kernels and combine;
  DeepSpeed MoE, fwd+bwd     DeepSpeed's own (gate, [E, capacity, H] buffer, two all-to-alls,
                             per-expert loop);
  gate-up / down: dense, one expert's W  torch.matmul of the busiest rank's routed rows against
                             one expert's weights;
  floor: 3 x forward GEMMs   3 x (gate-up + down dense): the block's expert FLOPs at cuBLAS's rate.
Checks, once per T: the output, l_aux and every gradient of replace_moe against DeepSpeed's (max
|diff| / max |ref| over every rank; output within the dtype's rtol, gradients within twice it);
two replace_moe steps bitwise equal.
Needs DeepSpeed 0.19.8 (`pip install 'ditron_ep[deepspeed]'`); on GPUs DeepSpeed joins the NCCL
group torchrun made, on emulated ranks the gloo one (DS_ACCELERATOR=cpu).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ditron_ep.bench.moe_layer import DENSE, on_fresh_caches, training_floor
from ditron_ep.bench.moe_layer import TRAINING_FLOOR as FLOOR
from ditron_ep.bench.ranks import StageFailed, all_ranks, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement, Shape

OURS, THEIRS = "replace_moe, fwd+bwd", "DeepSpeed MoE, fwd+bwd"
KERNELS = "replace_moe(experts='kernels'), fwd+bwd"
TOPK, CAPACITY_FACTOR = 2, 1.0
FLOP_RULE = ("FLOPs = 3 x (2*rows*H*I + 2*rows*I*H): the experts' forward GEMMs and twice them in the backward, "
             "rows = the routed (token, k) rows the busiest rank's experts keep; TFLOP/s = those FLOPs / median "
             "of the slowest rank's step time, per GPU.")


def _init_deepspeed(ctx: BenchContext):
    if not ctx.on_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(ctx.rank))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if ctx.on_cuda else "gloo", auto_mpi_discovery=False)
    return deepspeed


def _block(ctx: BenchContext, seed: int) -> nn.Module:
    """DeepSpeed's MoE with distinct experts (each from its global id), the same gate everywhere."""
    from deepspeed.moe.layer import MoE

    s = ctx.shape
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(s.hidden, s.inter), nn.GELU(), nn.Linear(s.inter, s.hidden))
    block = MoE(s.hidden, expert, num_experts=s.experts, ep_size=ctx.world, k=TOPK, capacity_factor=CAPACITY_FACTOR,
                eval_capacity_factor=CAPACITY_FACTOR, min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False)
    block.set_deepspeed_parallelism()
    local = s.experts // ctx.world
    with torch.no_grad():
        for i, ex in enumerate(block.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(seed * 1000 + ctx.rank * local + i)
            for p in ex.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.to(ctx.device, ctx.dtype)


def _step(block: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Callable[[], tuple]:
    params = list(block.parameters())

    def step() -> tuple:
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            out, l_aux, _ = block(leaf)
            loss = (out.float() * grad_out.float()).sum() + l_aux
            return (out.detach(), l_aux.detach(), *torch.autograd.grad(loss, [leaf, *params], allow_unused=True))
    return step


def run_deepspeed_moe(ctx: BenchContext, tokens: int) -> list[Measurement]:
    return on_fresh_caches(lambda: _run(ctx, tokens))


def _run(ctx: BenchContext, tokens: int) -> list[Measurement]:
    from ditron_ep.check.tolerances import TOLERANCES
    from ditron_ep.integrations.deepspeed import replace_moe

    s = ctx.shape
    names = (OURS, KERNELS, THEIRS, *DENSE, FLOOR)
    try:
        guarded(ctx, "deepspeed.init_distributed", lambda: _init_deepspeed(ctx))
        theirs = guarded(ctx, "DeepSpeed MoE block", lambda: _block(ctx, 17 + ctx.seed))
        ours = guarded(ctx, "DeepSpeed MoE block (to replace)", lambda: _block(ctx, 17 + ctx.seed))
        guarded(ctx, "replace_moe", lambda: replace_moe(ours))
        kernels = guarded(ctx, "DeepSpeed MoE block (kernels)", lambda: _block(ctx, 17 + ctx.seed))
        guarded(ctx, "replace_moe(experts='kernels')", lambda: replace_moe(kernels, experts="kernels"))
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1000 + ctx.rank)
        x = torch.randn(tokens, s.hidden, generator=gen, device=ctx.device).to(ctx.dtype)
        grad_out = torch.randn(tokens, s.hidden, generator=gen, device=ctx.device).to(ctx.dtype)
    except StageFailed as exc:
        return [Measurement(n, ok=False, error=str(exc)) for n in names]
    rows_max = _busiest_rows(ctx, theirs, x)
    flops = 3 * (2.0 * rows_max * s.hidden * s.inter * 2)  # plain MLP: two GEMMs of rows x H x I
    rtol = TOLERANCES[ctx.dtype][0]
    steps = {OURS: _step(ours, x, grad_out), KERNELS: _step(kernels, x, grad_out), THEIRS: _step(theirs, x, grad_out)}
    labels = ["out", "l_aux", "x", *[n for n, _ in ours.named_parameters()]]
    try:
        want = guarded(ctx, f"{THEIRS} (check)", steps[THEIRS])
        checks = {name: _check(ctx, steps[name], name, want, labels, rtol) for name in (OURS, KERNELS)}
    except StageFailed as exc:
        return [Measurement(n, work=flops, ok=False, error=str(exc)) for n in names]
    del want
    return [*(ctx.measure(name, steps[name], flops, *checks[name]) for name in (OURS, KERNELS)),
            ctx.measure(THEIRS, steps[THEIRS], flops, "reference", True), *training_floor(ctx, rows_max, s.inter)]


def _check(ctx: BenchContext, step: Callable[[], tuple], name: str, want: tuple, labels: list[str],
           rtol: float) -> tuple[str, bool]:
    """(text, ok) of a replaced block's step against DeepSpeed's: output, l_aux and every gradient
    within tolerance, and two steps bitwise equal."""
    got = guarded(ctx, f"{name} (check)", step)
    again = guarded(ctx, f"{name} (check again)", step)
    rel = {lab: relative_errors(ctx, w, {"g": g})["g"] for lab, g, w in zip(labels, got, want)
           if g is not None and w is not None}
    worst_grad = max((lab for lab in rel if lab not in ("out", "l_aux")), key=rel.get)
    same = all_ranks(ctx, all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, again)))
    ok = rel["out"] <= rtol and rel["l_aux"] <= rtol and rel[worst_grad] <= 2 * rtol and same
    return (f"{'ok' if ok else 'FAIL'}: out {rel['out']:.1e}, grads <= {rel[worst_grad]:.1e} ({worst_grad}) vs "
            f"DeepSpeed's{', bitwise run to run' if same else ', FAIL: two runs differ'}"), ok


def _busiest_rows(ctx: BenchContext, block: nn.Module, x: torch.Tensor) -> int:
    """Routed (token, k) rows the capacity keeps on the busiest rank's experts (max over ranks)."""
    with torch.no_grad():
        indices = block.deepspeed_moe.gate(x.reshape(-1, x.shape[-1]), None, True, False)[3]
    local = ctx.shape.experts // ctx.world
    kept = indices[indices >= 0].long()
    per_rank = torch.bincount(kept // local, minlength=ctx.world).to(torch.float64)
    vec = ctx.coll_tensor(per_rank.tolist())
    dist.all_reduce(vec, group=ctx.group)
    return int(vec.max().item())


def plan_deepspeed_moe(req: BenchRequest, tokens: int, options: Any, on_gpu: bool) -> tuple[Impl, ...]:
    return (Impl(OURS, against=(THEIRS,)), Impl(KERNELS, against=(THEIRS,)), Impl(THEIRS, "baseline"),
            *(Impl(n, "reference") for n in DENSE), Impl(FLOOR, "reference", timed=False))


def validate(req: BenchRequest, options: Any, world_size: int) -> str | None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return "needs DeepSpeed: pip install 'ditron_ep[deepspeed]'"
    return None


DEEPSPEED_MOE = Benchmark(
    name="deepspeed_moe",
    description="one DeepSpeed MoE block, forward + backward: DeepSpeed's own data path vs "
                "ditron_ep.integrations.deepspeed.replace_moe, with the floor",
    metric="TFLOP/s", work_rule=FLOP_RULE,
    check_rule="replace_moe's output, l_aux and every gradient vs DeepSpeed's: max |diff| / max |ref| over every "
               "rank within the dtype's rtol (gradients: twice it); two replace_moe steps bitwise equal",
    shapes={"emulated": Shape(hidden=32, experts=4, topk=TOPK, inter=64),
            "torch": Shape(hidden=4096, experts=16, topk=TOPK, inter=16384)},
    tokens={"emulated": (8,), "torch": (4096,)}, plan=plan_deepspeed_moe, run=run_deepspeed_moe, default=False,
    dtypes={"emulated": ("fp32",), "torch": ("bf16",)}, routings=("uniform",), validate=validate)
