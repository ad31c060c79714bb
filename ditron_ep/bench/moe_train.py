"""Registry entry "moe_train": one training step of the EP MoE layer — forward and backward — of
`ditron_ep.ops.moe` against the torch-native pipeline under autograd, with each one's peak memory.

Per token count T (per rank): tokens, routing and weights as in the "moe" entry (SwiGLU experts,
w1 [E_local, H, 2I], w2 [E_local, I, H]); an upstream gradient drawn once. One iteration =
out = layer(x, topk_idx, topk_weights, w1, w2), then torch.autograd.grad(out, (x, topk_weights,
w1, w2), grad_out): every input's gradient, no accumulation into .grad. Rows:
  moe overlap, fwd+bwd     `moe`'s default with gradients: the staged launches run the forward and
                      keep what their backward needs (dispatch's rows, the pre-activation, the
                      expert outputs);
  moe <schedule>, recompute  recompute=True (activation checkpointing) for "overlap" and
                      "sequential": the fused forward keeps only the inputs and the backward
                      recomputes the staged forward first;
  torch-native, fwd+bwd    `torch_moe.torch_native_moe(..., differentiable=True)`: NCCL
                      all_to_all_single with autograd (torch.distributed.nn), torch._grouped_mm
                      and its backward (a per-expert matmul loop where unsupported);
  DeepEP + grouped_mm, fwd+bwd  (GPUs, bf16, where deep_ep imports) `deepep.DeepEPMoE` under
                      autograd: DeepEP's dispatch / combine (each one's backward the other) around
                      the same torch._grouped_mm experts;
  gate-up / down: dense, one expert's W  one torch.matmul of the busiest rank's rows against one
                      expert's weights (the forward GEMMs' FLOPs at cuBLAS's dense rate);
  floor: 3 x forward GEMMs  3 x (gate-up + down dense): a step's FLOPs are the forward's and twice
                      them in the backward (dgrad and wgrad of both GEMMs); communication excluded.
Checks, once per T before timing: every gradient of ours and of torch-native against float32
gradients (torch-native's pipeline in float32, per-expert matmuls, no TF32): max |diff| / max |ref|
over every rank, per input; ours passes where each of its four is within the dtype's rtol or
within 1.25x torch-native's own error on that input (two bf16 pipelines round differently: dz, h
and the rows are bf16 in both); the recompute rows' gradients bit for bit equal to the default's. Peak memory: on GPUs, one
step's peak allocation above what was allocated before it (torch.cuda.max_memory_allocated),
the largest over the ranks; ditron_ep's persistent buffers (EP heaps, fused layers: allocated once per
shape, not per step) are in the baseline and reported apart as "workspace".
"""
from __future__ import annotations

from typing import Callable

import torch

from ditron_ep.bench.deepep import DeepEPMoE
from ditron_ep.bench.moe_layer import (DEEPEP_LAYER, DENSE, LAYER_DTYPES, LAYER_ROUTINGS, LAYER_SHAPES,
                                       deepep_layer_wanted, layer_case, on_fresh_caches, probe_grouped_mm,
                                       training_floor)
from ditron_ep.bench.moe_layer import TRAINING_FLOOR as FLOOR
from ditron_ep.bench.ranks import StageFailed, all_ranks, checked_runs, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement
from ditron_ep.bench.torch_moe import torch_native_moe
from ditron_ep.check.tolerances import TOLERANCES
from ditron_ep.ops import dispatch, moe

TORCH_NATIVE = "torch-native, fwd+bwd"
DEEPEP_TRAIN = f"{DEEPEP_LAYER}, fwd+bwd"
GRADS = ("x", "topk_weights", "w1", "w2")
FLOP_RULE = ("FLOPs = 3 x (2*rows*H*2I + 2*rows*I*H): the forward's expert GEMMs and twice them in the backward, "
             "rows = the (token, k) rows of the busiest rank; TFLOP/s = those FLOPs / median of the slowest "
             "rank's step time, per GPU (activations, permutes and communication are not counted).")


DEFAULT = "moe overlap, fwd+bwd"
OURS = {DEFAULT: ("overlap", False), "moe overlap, recompute": ("overlap", True),
        "moe sequential, recompute": ("sequential", True)}   # name: (schedule, recompute)


def run_moe_train(ctx: BenchContext, tokens: int) -> list[Measurement]:
    case = layer_case(ctx, tokens)
    return on_fresh_caches(lambda: _run(ctx, case))


def _step(layer: Callable, inp, wts, grad_out: torch.Tensor) -> Callable[[], tuple]:
    """One training step of `layer(x, idx, w, w1, w2)`: the gradients of x, topk_weights, w1, w2."""
    def step() -> tuple:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (inp.x, inp.w, wts.w1, wts.w2)]
            out = layer(leaves[0], inp.idx, leaves[1], leaves[2], leaves[3])
            return torch.autograd.grad(out, leaves, grad_out)
    return step


def _peak_mib(ctx: BenchContext, fn: Callable[[], object]) -> float | None:
    """Peak allocation of one call above the allocation before it, MiB (GPUs; None elsewhere)."""
    if not ctx.on_cuda:
        return None
    torch.cuda.synchronize(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    result = fn()
    torch.cuda.synchronize(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - base
    del result
    return peak / 2**20


def _run(ctx: BenchContext, case) -> list[Measurement]:
    s, inp, wts = ctx.shape, case.inp, case.wts
    rtol = TOLERANCES[ctx.dtype][0]
    flops = 3 * case.flops
    grad_out = guarded(ctx, "upstream gradient", lambda: torch.randn(
        inp.x.shape, generator=torch.Generator(device=ctx.device).manual_seed(1234 + ctx.rank), device=ctx.device,
        dtype=torch.float32).to(ctx.dtype))

    def first_dispatch() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            recv, handle = dispatch(inp.x, inp.idx, num_experts=s.experts, group=ctx.group)
        return recv, handle.expert_offsets

    recv_x, off = guarded(ctx, "dispatch (untimed)", first_dispatch)
    grouped = probe_grouped_mm(ctx, recv_x, off[1:], wts) is None
    del recv_x, off
    steps = {name: _step(lambda *a, S=S, rc=rc: moe(*a, group=ctx.group, schedule=S, recompute=rc), inp, wts,
                         grad_out) for name, (S, rc) in OURS.items()}
    steps[TORCH_NATIVE] = _step(lambda *a: torch_native_moe(*a, grouped, ctx.group, differentiable=True), inp, wts,
                                grad_out)
    errors: dict[str, str] = {}
    deepep = None
    if deepep_layer_wanted(ctx):
        try:
            if not grouped:
                raise StageFailed("torch._grouped_mm does not run here")
            deepep = DeepEPMoE(ctx, s.experts, s.hidden)
            steps[DEEPEP_TRAIN] = _step(deepep, inp, wts, grad_out)
        except StageFailed as exc:
            steps[DEEPEP_TRAIN] = None
            errors[DEEPEP_TRAIN] = str(exc)
    try:
        return _checked_and_timed(ctx, case, steps, errors, grad_out, flops, rtol)
    finally:
        if deepep is not None:
            deepep.close()


def _checked_and_timed(ctx: BenchContext, case, steps: dict, errors: dict[str, str], grad_out: torch.Tensor,
                       flops: float, rtol: float) -> list[Measurement]:
    s, inp, wts = ctx.shape, case.inp, case.wts
    # ---- checks: every gradient against float32 ones; the recompute rows' bits against the default's
    ref = guarded(ctx, "float32 gradients (check)", lambda: _float32_grads(ctx, inp, wts, grad_out))
    results = checked_runs(ctx, steps, errors)
    rel = {impl: {g: relative_errors(ctx, r, {"got": o})["got"] for g, r, o in zip(GRADS, ref, got)}
           for impl, got in results.items()}
    del ref
    theirs = rel.get(TORCH_NATIVE, {})
    checks: dict[str, tuple[str, bool]] = {}
    for impl in steps:
        if impl not in rel:
            continue
        mine = rel[impl]
        worst = max(mine, key=mine.get)
        if impl == TORCH_NATIVE:
            checks[impl] = (f"reference: grads vs fp32 <= {mine[worst]:.1e} ({worst})", True)
            continue
        ok = all(mine[g] <= rtol or (g in theirs and mine[g] <= 1.25 * theirs[g]) for g in GRADS)
        text = f"{'ok' if ok else 'FAIL'}: grads vs fp32 <= {mine[worst]:.1e} ({worst}"
        text += f"; torch-native {theirs[worst]:.1e})" if worst in theirs else ")"
        if impl in OURS and impl != DEFAULT and DEFAULT in results:
            same = all_ranks(ctx, all(torch.equal(a, b) for a, b in zip(results[impl], results[DEFAULT])))
            ok = ok and same
            text += ", bitwise == default" if same else ", FAIL: differs from the default's"
        checks[impl] = (text, ok)
    del results
    out = []
    for impl, fn in steps.items():
        if impl in errors:
            out.append(Measurement(impl, work=flops, ok=False, error=errors[impl]))
            continue
        peak = guarded(ctx, f"{impl} (peak memory)", lambda fn=fn: _peak_mib(ctx, fn))
        peak = _max_over_ranks(ctx, peak)
        text, ok = checks.get(impl, ("not checked", False))
        details = {"peak_mib": peak, "workspace_mib": _workspace_mib(ctx)}
        if peak is not None:
            text += f"; peak {peak:,.0f} MiB"
        out.append(ctx.measure(impl, fn, flops, text, ok, details=details))
    out += training_floor(ctx, case.rows_max, 2 * s.inter)
    return out


def _float32_grads(ctx: BenchContext, inp, wts, grad_out: torch.Tensor) -> tuple:
    """(dx, dw, dw1, dw2) of the torch-native pipeline in float32 (per-expert matmuls, no TF32)."""
    f32 = torch.float32
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.enable_grad():
            leaves = [t.detach().to(f32).requires_grad_() for t in (inp.x, inp.w, wts.w1, wts.w2)]
            out = torch_native_moe(leaves[0], inp.idx, leaves[1], leaves[2], leaves[3], False, ctx.group,
                                   differentiable=True)
            return torch.autograd.grad(out, leaves, grad_out.to(f32))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _max_over_ranks(ctx: BenchContext, value: float | None) -> float | None:
    if value is None:
        return None
    vec = ctx.coll_tensor([value])
    torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.MAX, group=ctx.group)
    return vec.item()


def _workspace_mib(ctx: BenchContext) -> float | None:
    """ditron_ep's persistent buffers on this GPU now (EP heaps and fused layers), MiB."""
    from ditron_ep.ops.ep.functional import _SLOTS
    from ditron_ep.ops.moe_layer.functional import _GROUP_SLOTS

    if not ctx.on_cuda:
        return None
    resources = ([s.buffer for s in _SLOTS.values()] + [s.buffer.buffer for s in _GROUP_SLOTS.values()]
                 + [layer.resource for s in _GROUP_SLOTS.values() for layer in s.layers.values()])
    layers = [r for r in resources if r is not None]
    heaps = [r.heap for r in layers] + [r.staged_slot.buffer.heap for r in layers
                                        if getattr(r, "staged_slot", None) and r.staged_slot.buffer]
    return sum(getattr(h, "size_bytes", 0) for h in heaps) / 2**20


def plan_moe_train(req: BenchRequest, tokens: int, options, on_gpu: bool) -> tuple[Impl, ...]:
    deepep = (DEEPEP_TRAIN,) if on_gpu and req.dtype == "bf16" else ()
    return (*(Impl(name, against=(TORCH_NATIVE, *deepep)) for name in OURS), Impl(TORCH_NATIVE, "baseline"),
            *(Impl(n, "baseline") for n in deepep),
            *(Impl(n, "reference") for n in DENSE), Impl(FLOOR, "reference", timed=False))


MOE_TRAIN = Benchmark(
    name="moe_train",
    description="EP MoE layer training step (forward + backward of ditron_ep.ops.moe) vs torch-native autograd, "
                "with peak memory and the floor",
    metric="TFLOP/s", work_rule=FLOP_RULE,
    check_rule="every gradient vs float32 gradients (torch-native's pipeline in fp32): max |diff| / max |ref| over "
               "every rank within the dtype's rtol or 1.25x torch-native's own error; the recompute rows' gradients "
               "bit for bit equal to the default's",
    shapes=LAYER_SHAPES, tokens={"emulated": (8, 32), "torch": (1024, 4096)},
    plan=plan_moe_train, run=run_moe_train, default=False, options=(), dtypes=LAYER_DTYPES, routings=LAYER_ROUTINGS)
