"""torchtitan_dispatch: torchtitan's MoE token dispatcher interface, forward + backward.

Rows (one config = one T), each timing dispatch -> stand-in experts (identity: the combine applies
the scores) -> combine -> the backward to x and the scores:
  ditron dispatcher (torchtitan), fwd+bwd   ditron_ep.integrations.torchtitan.DitronTokenDispatcher;
  torchtitan all-to-all dispatcher, fwd+bwd torchtitan 0.3.0's AllToAllTokenDispatcher, written here
                                            from its source (`titan_alltoall_dispatch` / `_combine`:
                                            local reorder, counts and rows all-to-alls with host
                                            splits, permutation to expert-major, and back; scores
                                            applied in fp32, rounded to the dtype per term, then
                                            scatter-added): torchtitan 0.3.0 pins a torch nightly and
                                            does not import beside the torch this project runs on.
Where torchtitan itself imports, its MinimalAsyncEPTokenDispatcher is the natural further baseline;
it is not planned here (it does not import on the machines this project is tested on).
Checks, timing rule and bytes as `megatron_dispatch` (run_dispatchers): output and gradients vs
float64 (out[t] = x[t] * the sum of its scores), ours within the dtype's rtol, torchtitan's within
twice it (it adds the scored terms in the token dtype).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ditron_ep.bench.ep_inputs import Inputs
from ditron_ep.bench.megatron_dispatch import DISPATCHER_CONFIGS, run_dispatchers
from ditron_ep.bench.moe_layer import on_fresh_caches
from ditron_ep.bench.ranks import StageFailed, all_ranks, guarded
from ditron_ep.bench.spec import BenchContext, Benchmark, BenchRequest, Impl, Measurement

OURS, ALLTOALL = "ditron dispatcher (torchtitan), fwd+bwd", "torchtitan all-to-all dispatcher, fwd+bwd"


def titan_alltoall_dispatch(x: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, num_experts: int,
                            group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """torchtitan 0.3.0 AllToAllTokenDispatcher.dispatch in plain torch (differentiable through
    torch.distributed.nn): (rows of this rank's experts, expert-major and by (source rank, source
    token) within an expert; tokens per local expert; what combine needs)."""
    import torch.distributed.nn.functional as dist_nn

    W, K, dev = dist.get_world_size(group), ids.shape[1], x.device
    order = torch.argsort(ids.reshape(-1), stable=True)          # _local_reorder: by expert
    scores_sorted = scores.reshape(-1)[order]
    token_idx = order // K
    routed = x[token_idx]
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)             # [W * e]: (source rank, local expert)
    input_splits = counts.view(W, -1).sum(1).tolist()            # host syncs, as torchtitan's
    output_splits = got.view(W, -1).sum(1).tolist()
    routed = dist_nn.all_to_all_single(routed.new_empty(sum(output_splits), x.shape[1]), routed, output_splits,
                                       input_splits, group=group)
    e = num_experts // W
    t_mat = got.view(W, e)
    starts = (got.cumsum(0) - got).view(W, e).t().reshape(-1)    # _permute: (rank, expert) -> expert-major
    lens = t_mat.t().reshape(-1)
    seg = torch.arange(lens.shape[0], device=dev).repeat_interleave(lens)
    out_starts = lens.cumsum(0) - lens
    perm = starts[seg] + torch.arange(seg.shape[0], device=dev) - out_starts[seg]
    meta = (token_idx, scores_sorted, routed.shape, perm, input_splits, output_splits)
    return routed[perm], t_mat.sum(0), meta


def titan_alltoall_combine(y: torch.Tensor, meta: tuple, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """torchtitan 0.3.0 AllToAllTokenDispatcher.combine: unpermute, all-to-all back, each term
    scored in fp32 and rounded to the dtype, scatter-added per token."""
    import torch.distributed.nn.functional as dist_nn

    token_idx, scores_sorted, shape, perm, input_splits, output_splits = meta
    unperm = y.new_zeros(shape).index_copy(0, perm, y)
    back = dist_nn.all_to_all_single(unperm.new_empty(sum(input_splits), y.shape[1]), unperm, input_splits,
                                     output_splits, group=group)
    scored = (back.to(torch.float32) * scores_sorted[:, None]).to(back.dtype)
    return torch.zeros_like(x).scatter_add(0, token_idx[:, None].expand(-1, x.shape[1]), scored)


def _ep_mesh(ctx: BenchContext):
    from torch.distributed.device_mesh import DeviceMesh

    group = ctx.group if ctx.group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, ctx.device.type)


def _titan_step(ctx: BenchContext, impl: str, inp: Inputs, probs: torch.Tensor, routing_map: torch.Tensor,
                grad_out: torch.Tensor) -> Callable[[], tuple]:
    """(out, dx, dprobs [T, E]) of dispatch -> identity experts -> combine -> backward."""
    del routing_map
    if not all_ranks(ctx, not bool((inp.idx < 0).any())):  # every rank raises alike
        raise StageFailed("torchtitan's dispatchers take no dropped slots; use a routing without drops")
    E, ids = ctx.shape.experts, inp.idx.to(torch.int64)
    mesh = guarded(ctx, f"{impl} (mesh)", lambda: _ep_mesh(ctx))
    if impl == OURS:
        from ditron_ep.integrations.torchtitan import DitronTokenDispatcher

        disp = DitronTokenDispatcher(DitronTokenDispatcher.Config(num_experts=E, top_k=ids.shape[1]))
        guarded(ctx, f"{impl} (build)", lambda: disp.wire_meshes(ep_mesh=mesh))
    group = mesh.get_group()
    counts_e = torch.bincount(ids.reshape(-1), minlength=E)

    def step() -> tuple:
        with torch.enable_grad():
            x, s = inp.x.detach().requires_grad_(), inp.w.detach().requires_grad_()
            if impl == OURS:
                rows, _, meta = disp.dispatch(x, s, ids, counts_e)
                out = disp.combine(rows, meta, x)
            else:
                rows, _, meta = titan_alltoall_dispatch(x, s, ids, E, group)
                out = titan_alltoall_combine(rows, meta, x, group)
            dx, ds = torch.autograd.grad(out, (x, s), grad_out)
            dprobs = torch.zeros_like(probs).scatter_(1, ids, ds.to(probs.dtype))
            return out.detach(), dx, dprobs
    return step


def run_torchtitan_dispatch(ctx: BenchContext, tokens: int) -> list[Measurement]:
    impls = [i.name for i in plan_torchtitan_dispatch(ctx.request, tokens, {}, ctx.on_cuda)]
    return on_fresh_caches(lambda: run_dispatchers(ctx, tokens, impls, _titan_step))


def plan_torchtitan_dispatch(req: BenchRequest, tokens: int, options: Any, on_gpu: bool) -> tuple[Impl, ...]:
    return (Impl(OURS, against=(ALLTOALL,)), Impl(ALLTOALL, "baseline"))


TORCHTITAN_DISPATCH = Benchmark(
    name="torchtitan_dispatch",
    description="torchtitan's MoE token dispatcher interface, forward + backward: ditron_ep's DitronTokenDispatcher "
                "vs torchtitan 0.3.0's all-to-all dispatcher (written from its source)",
    check_rule="output and gradients of x and the scores vs float64 (out[t] = x[t] * the sum of its scores): "
               "max |diff| / max |ref| over every rank, output within the dtype's rtol (torchtitan's, which adds "
               "scored terms in the token dtype: twice it), gradients within twice it",
    plan=plan_torchtitan_dispatch, run=run_torchtitan_dispatch, **DISPATCHER_CONFIGS)
