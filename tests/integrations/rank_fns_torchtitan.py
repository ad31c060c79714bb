"""Rank side of the torchtitan integration tests: DitronTokenDispatcher against a faithful copy of
torchtitan 0.3.0's AllToAllTokenDispatcher (`_local_reorder`, the counts and rows all-to-alls,
`_permute` to expert-major, and combine: unpermute, all-to-all back, score in fp32, scatter-add),
written here with torch.distributed.nn's differentiable all_to_all (torchtitan 0.3.0 does not
import beside this torch)."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

H = 16


def _titan_dispatch(x, scores, ids, E, K, group):
    """torchtitan 0.3.0 AllToAllTokenDispatcher.dispatch, plain torch."""
    W = dist.get_world_size(group)
    order = torch.argsort(ids.reshape(-1), stable=True)
    scores_sorted = scores.reshape(-1)[order]
    token_idx = order // K
    routed = x[token_idx]
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)       # [W * e]: (source rank, local expert)
    input_splits = counts.view(W, -1).sum(1).tolist()
    output_splits = got.view(W, -1).sum(1).tolist()
    routed = dist_nn.all_to_all_single(routed.new_empty(sum(output_splits), x.shape[1]), routed, output_splits,
                                       input_splits, group=group)
    e = E // W
    t_mat = got.view(W, e)
    starts = (got.cumsum(0) - got).view(W, e).t().reshape(-1)
    lens = t_mat.t().reshape(-1)
    seg = torch.arange(lens.shape[0]).repeat_interleave(lens)
    out_starts = lens.cumsum(0) - lens
    perm = starts[seg] + torch.arange(seg.shape[0]) - out_starts[seg]
    meta = (token_idx, scores_sorted, routed.shape, perm, input_splits, output_splits)
    return routed[perm], t_mat.sum(0), meta


def _titan_combine(y, meta, x, group):
    token_idx, scores_sorted, shape, perm, input_splits, output_splits = meta
    unperm = y.new_zeros(shape).index_copy(0, perm, y)
    back = dist_nn.all_to_all_single(unperm.new_empty(sum(input_splits), y.shape[1]), unperm, input_splits,
                                     output_splits, group=group)
    scored = (back.to(torch.float32) * scores_sorted[:, None]).to(back.dtype)
    return torch.zeros_like(x).scatter_add(0, token_idx[:, None].expand(-1, x.shape[1]), scored)


def dispatcher_case(tokens: list[int], E: int, K: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from ditron_ep.integrations.torchtitan import DitronTokenDispatcher
    from ditron_ep.ops import clear_cache

    rank, W = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,))
    disp = DitronTokenDispatcher(DitronTokenDispatcher.Config(num_experts=E, top_k=K))
    disp.wire_meshes(ep_mesh=mesh)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x0 = torch.randn(tokens[rank], H, generator=g)
    logits = torch.randn(tokens[rank], E, generator=g)
    ids = torch.topk(logits, K, dim=1).indices
    s0 = torch.softmax(logits, -1).gather(1, ids)
    gout = torch.randn(x0.shape, generator=g)
    results = {}
    for name in ("ditron", "titan"):
        x, s = x0.clone().requires_grad_(), s0.clone().requires_grad_()
        counts_e = torch.bincount(ids.reshape(-1), minlength=E)
        if name == "ditron":
            routed, per_expert, meta = disp.dispatch(x, s, ids, counts_e)
        else:
            routed, per_expert, meta = _titan_dispatch(x, s, ids, E, K, mesh.get_group())
        # stand-in experts: local expert e scales its rows by (1 + global id / 8)
        first = rank * (E // W)
        scale = torch.repeat_interleave(torch.arange(E // W) + first, per_expert).to(torch.float32) / 8 + 1
        y = routed * scale[:, None]
        out = disp.combine(y, meta, x) if name == "ditron" else _titan_combine(y, meta, x, mesh.get_group())
        (out * gout).sum().backward()
        results[name] = (routed.detach(), per_expert.tolist(), out.detach(), x.grad, s.grad)
    clear_cache()
    d, t = results["ditron"], results["titan"]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0

    return {"rows_equal": torch.equal(d[0], t[0]), "counts_equal": d[1] == t[1], "out_err": rel(d[2], t[2]),
            "x_grad_err": rel(d[3], t[3]), "score_grad_err": rel(d[4], t[4])}
