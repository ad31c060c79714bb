"""Registry entry "megatron_dispatch": Megatron-core's MoE token dispatchers as `MoELayer` calls
them, forward and backward — `ditron_ep.integrations.megatron.DitronTokenDispatcher` against
Megatron's all-to-all dispatcher and its flex dispatcher on DeepEP.

Per token count T (per rank): this rank's tokens and top-K routing (`ep_inputs.make_inputs`), as
Megatron's router hands them over: probs [T, E] (the top-K weights, 0 elsewhere) and routing_map
[T, E]; one upstream gradient. One iteration = MoELayer's dispatcher sequence
dispatch_preprocess → token_dispatch → dispatch_postprocess → experts → combine_preprocess →
token_combine → combine_postprocess, the experts a stand-in that scales each row by its
probability (what Megatron's experts do last; the same cheap op for every dispatcher, so the
difference is the dispatchers'), then the gradients of x and probs (the router's). Rows:
  ditron dispatcher, fwd+bwd         DitronTokenDispatcher (ours);
  alltoall dispatcher, fwd+bwd       MoEAlltoAllTokenDispatcher (moe_token_dispatcher_type
                                     "alltoall", unfused permutes);
  flex dispatcher (DeepEP), fwd+bwd  (GPUs, where deep_ep imports) MoEFlexTokenDispatcher with
                                     moe_flex_dispatcher_backend "deepep".
Megatron's own dispatchers need CUDA (emulated CPU ranks time ours alone). Checks, once per T:
every dispatcher's output and gradients against float64 (with the stand-in experts, out[t] =
x[t] * the sum of its routed probabilities), max |diff| / max |ref| over every rank: output
within the dtype's rtol (Megatron's dispatchers, which weigh and add rows in the token dtype,
within twice it), gradients within twice it. On an intranode DeepEP build the flex dispatcher's
buffer is sized as an NVSHMEM build sizes it on one node (`_flex_problem`).
Needs megatron-core (`pip install 'ditron_ep[megatron]'`; 0.16.1 / 0.19.2).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ditron_ep.bench.deepep import deepep_absent
from ditron_ep.bench.ep_inputs import BYTE_RULE, Inputs, make_inputs, traffic_bytes
from ditron_ep.bench.moe_layer import on_fresh_caches
from ditron_ep.bench.ranks import StageFailed, checked_runs, guarded, relative_errors
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement, Shape
from ditron_ep.check.tolerances import TOLERANCES

OURS, ALLTOALL, FLEX = "ditron dispatcher, fwd+bwd", "alltoall dispatcher, fwd+bwd", "flex dispatcher (DeepEP), fwd+bwd"
WORK_RULE = ("bytes = 4 x the dispatch's bytes by the EP rule below (dispatch and combine, each forward and backward); "
             "GB/s = bytes / median step time. " + BYTE_RULE)
_SINGLES: dict[int, list] = {}  # world size -> one single-rank group per rank (expert tensor parallelism of 1)


def _dispatcher(ctx: BenchContext, impl: str):
    """A dispatcher of kind `impl` for this rank's experts (collective: process groups)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher, MoEFlexTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ditron_ep.integrations.megatron import DitronTokenDispatcher

    s, W, r = ctx.shape, ctx.world, ctx.rank
    if W not in _SINGLES:  # every rank creates every group, in the same order
        _SINGLES[W] = [dist.new_group([q]) for q in range(W)]
    group = ctx.group if ctx.group is not None else dist.group.WORLD
    kind = {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"} if impl == FLEX \
        else {"moe_token_dispatcher_type": "alltoall"}
    cfg = TransformerConfig(num_layers=1, hidden_size=s.hidden, num_attention_heads=1, num_moe_experts=s.experts,
                            moe_router_topk=s.topk, use_cpu_initialization=True, params_dtype=ctx.dtype,
                            bf16=ctx.dtype == torch.bfloat16, **kind)
    pg = ProcessGroupCollection(ep=group, expt_tp=_SINGLES[W][r], tp_ep=group)
    el = s.experts // W
    cls = {OURS: DitronTokenDispatcher, ALLTOALL: MoEAlltoAllTokenDispatcher, FLEX: MoEFlexTokenDispatcher}[impl]
    return cls(el, list(range(r * el, (r + 1) * el)), cfg, pg_collection=pg)


def _flex_problem() -> str | None:
    """Why Megatron's flex dispatcher cannot run on this DeepEP (None: it may). Megatron sizes
    DeepEP's RDMA buffer even on one node (`fused_a2a.get_buffer`), which an intranode DeepEP build
    (no NVSHMEM, as `../shared/anchors` builds it) refuses with an assertion; a build with NVSHMEM
    answers 0 bytes for groups of at most 8 ranks (DeepEP's config.hpp, NUM_MAX_NVL_PEERS). On an
    intranode build Megatron's `get_buffer` is therefore replaced by one that sizes the buffer the
    way an NVSHMEM build would on one node: the same NVL bytes, no RDMA bytes."""
    why = deepep_absent()
    if why is not None:
        return why
    import deep_ep

    try:
        deep_ep.Buffer.get_dispatch_config(2).get_rdma_buffer_size_hint(7168 * 2, 2)
    except Exception as exc:  # noqa: BLE001 - only DeepEP's NVSHMEM assertion is a verdict
        if "NVSHMEM" not in str(exc):
            return f"DeepEP's buffer sizing failed: {exc}"
        _size_flex_buffer_intranode(deep_ep.Buffer)
    return None


_NVL_PEERS = 8  # DeepEP's NUM_MAX_NVL_PEERS: groups up to this size run intranode


def _size_flex_buffer_intranode(Buffer: Any) -> None:
    """Point Megatron's `fused_a2a.get_buffer` at a one-node sizing (see `_flex_problem`)."""
    from megatron.core.transformer.moe import fused_a2a

    if getattr(fused_a2a.get_buffer, "_ditron_intranode", False):
        return
    buffers: dict = {}

    def get_buffer(group, hidden_bytes: int):
        if group.size() > _NVL_PEERS:
            raise RuntimeError(f"an intranode DeepEP build serves groups of at most {_NVL_PEERS} ranks, "
                               f"not {group.size()}: build DeepEP with NVSHMEM")
        nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, group.size())
                  for c in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())))
        buf = buffers.get(id(group))
        if buf is None or buf.num_nvl_bytes < nvl:
            buf = buffers[id(group)] = Buffer(group, nvl, 0)
        return buf

    get_buffer._ditron_intranode = True
    fused_a2a.get_buffer = get_buffer


def _router_outputs(inp: Inputs, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] fp32, routing_map [T, E] bool) of the routing, as Megatron's router gives them."""
    T = inp.idx.shape[0]
    kept = inp.idx >= 0
    cols = torch.where(kept, inp.idx, 0)
    probs = torch.zeros(T, experts, dtype=torch.float32, device=inp.x.device).scatter_(
        1, cols, torch.where(kept, inp.w, 0.0))
    routing_map = torch.zeros(T, experts, dtype=torch.bool, device=inp.x.device).scatter_(1, cols, kept)
    return probs, routing_map


def _step(disp, inp: Inputs, probs: torch.Tensor, routing_map: torch.Tensor,
          grad_out: torch.Tensor) -> Callable[[], tuple]:
    def step() -> tuple:
        with torch.enable_grad():
            x, p = inp.x.detach().requires_grad_(), probs.detach().requires_grad_()
            h, hp = disp.dispatch_preprocess(x, routing_map, p)
            h, hp = disp.token_dispatch(h, hp)
            rows, _, row_p = disp.dispatch_postprocess(h, hp)
            y = rows * row_p.to(rows.dtype).reshape(-1, 1)   # the stand-in experts
            out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))
            return (out.detach(), *torch.autograd.grad(out, (x, p), grad_out))
    return step


def run_megatron_dispatch(ctx: BenchContext, tokens: int) -> list[Measurement]:
    impls = [i.name for i in plan_megatron_dispatch(ctx.request, tokens, {}, ctx.on_cuda)]
    return on_fresh_caches(lambda: run_dispatchers(ctx, tokens, impls, _megatron_step))


def _megatron_step(ctx: BenchContext, impl: str, inp: Inputs, probs: torch.Tensor, routing_map: torch.Tensor,
                   grad_out: torch.Tensor) -> Callable[[], tuple]:
    if impl == FLEX and (why := _flex_problem()) is not None:
        raise StageFailed(why)
    disp = guarded(ctx, f"{impl} (build)", lambda: _dispatcher(ctx, impl))
    return _step(disp, inp, probs, routing_map, grad_out)


BuildStep = Callable[[BenchContext, str, Inputs, torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], tuple]]


def run_dispatchers(ctx: BenchContext, tokens: int, impls: list[str], build: BuildStep) -> list[Measurement]:
    """The token-dispatcher benchmarks' run (Megatron's, torchtitan's): this rank's inputs, the
    router's (probs [T, E], routing_map [T, E]) and an output gradient; each impl's step from
    `build(ctx, impl, inputs, probs, routing_map, grad_out)` (a StageFailed: that impl's error row),
    returning (out, dx, dprobs [T, E]); every step run once on every rank and checked against
    float64 (`_checks`: ours to the dtype's rtol, the frameworks' to twice it), then timed."""
    s = ctx.shape
    try:
        inp = guarded(ctx, "inputs", lambda: make_inputs(ctx, tokens, s.experts, s.topk, s.hidden, ctx.request.routing))
        probs, routing_map = _router_outputs(inp, s.experts)
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1000 + 77 + ctx.rank)
        grad_out = torch.randn(inp.x.shape, generator=gen, device=ctx.device).to(ctx.dtype)
    except StageFailed as exc:
        return [Measurement(n, ok=False, error=str(exc)) for n in impls]
    work = 2 * traffic_bytes(ctx, inp, "roundtrip", s.hidden).rule
    rtol = TOLERANCES[ctx.dtype][0]
    steps: dict[str, Callable[[], tuple] | None] = {}
    errors: dict[str, str] = {}
    for impl in impls:
        try:
            steps[impl] = build(ctx, impl, inp, probs, routing_map, grad_out)
        except StageFailed as exc:
            errors[impl] = str(exc)
    results = checked_runs(ctx, steps, errors)
    checks = _checks(ctx, results, inp, probs, grad_out, rtol, ours=impls[0])
    del results
    out = []
    for impl in impls:
        if impl in errors:
            out.append(Measurement(impl, work=work, ok=False, error=errors[impl]))
            continue
        text, ok = checks[impl]
        out.append(ctx.measure(impl, steps[impl], work, text, ok))
    return out


def _checks(ctx: BenchContext, results: dict[str, tuple], inp: Inputs, probs: torch.Tensor,
            grad_out: torch.Tensor, rtol: float, ours: str) -> dict[str, tuple[str, bool]]:
    """Every dispatcher's output and gradients against float64: with experts that scale a row by
    its probability, out[t] = x[t] * sum_e probs[t, e] over the routed e, so dx[t] = g[t] * that
    sum and dprobs[t, e] = <g[t], x[t]> where routed (0 elsewhere)."""
    x, g = inp.x.double(), grad_out.double()
    routed = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, torch.where(inp.idx >= 0, inp.idx, 0),
                                                               inp.idx >= 0)
    total = (probs.double() * routed).sum(1, keepdim=True)
    want = (x * total, g * total, torch.where(routed, (g * x).sum(1, keepdim=True), 0.0))
    checks = {}
    for impl, got in results.items():
        rel = [relative_errors(ctx, w, {"g": o})["g"] for w, o in zip(want, got)]
        # the frameworks' own dispatchers weigh and add a token's rows in the token dtype (Megatron's
        # alltoall: 1.1e-2 at T=4096 in bf16 on 2xH200): their output gets twice the rtol ours is held to
        out_tol = rtol if impl == ours else 2 * rtol
        ok = rel[0] <= out_tol and max(rel[1:]) <= 2 * rtol
        checks[impl] = (f"{'ok' if ok else 'FAIL'}: vs float64: out {rel[0]:.1e}, grad x {rel[1]:.1e}, "
                        f"grad probs {rel[2]:.1e}", ok)
    return checks


def plan_megatron_dispatch(req: BenchRequest, tokens: int, options: Any, on_gpu: bool) -> tuple[Impl, ...]:
    # Megatron's dispatchers need CUDA (the all-to-all one makes a torch.cuda.Stream when built)
    theirs = (ALLTOALL, FLEX) if on_gpu else ()
    return (Impl(OURS, against=theirs), *(Impl(n, "baseline") for n in theirs))


def validate(req: BenchRequest, options: Any, world_size: int) -> str | None:
    try:
        from ditron_ep.integrations.megatron import _megatron
        _megatron()
    except Exception as exc:  # noqa: BLE001 - missing or unsupported: say which
        return f"needs megatron-core ({exc})"
    return None


# The drop-in issue's dispatcher runs (Megatron's and torchtitan's): top-8 of 64 at 4096 tokens a rank
DISPATCHER_CONFIGS = dict(
    metric="GB/s", work_rule=WORK_RULE,
    shapes={"emulated": Shape(hidden=32, experts=8, topk=2), "torch": Shape(hidden=7168, experts=64, topk=8)},
    tokens={"emulated": (8, 24), "torch": (4096,)}, default=False,
    dtypes={"emulated": ("fp32",), "torch": ("bf16",)}, routings=("uniform", "zipf"))

MEGATRON_DISPATCH = Benchmark(
    name="megatron_dispatch",
    description="Megatron-core's MoE token dispatchers inside MoELayer's call sequence, forward + backward: "
                "ditron_ep's DitronTokenDispatcher vs the all-to-all and the flex (DeepEP) dispatchers",
    check_rule="output and gradients of x and probs vs float64 (out[t] = x[t] * the sum of its routed probabilities): "
               "max |diff| / max |ref| over every rank, output within the dtype's rtol (Megatron's dispatchers, which add "
               "in the token dtype: twice it), gradients within twice it",
    plan=plan_megatron_dispatch, run=run_megatron_dispatch, validate=validate, **DISPATCHER_CONFIGS)
