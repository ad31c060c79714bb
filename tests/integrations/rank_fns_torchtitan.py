"""Rank side of the torchtitan integration tests: DitronTokenDispatcher against a faithful copy of
torchtitan 0.3.0's AllToAllTokenDispatcher (`_local_reorder`, the counts and rows all-to-alls,
`_permute` to expert-major, and combine: unpermute, all-to-all back, score in fp32, scatter-add),
written with torch.distributed.nn's differentiable all_to_all (torchtitan 0.3.0 does not import
beside this torch); the torchtitan_dispatch benchmark times the same copy."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.bench.torchtitan_dispatch import titan_alltoall_combine, titan_alltoall_dispatch

H = 16


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
            routed, per_expert, meta = titan_alltoall_dispatch(x, s, ids, E, mesh.get_group())
        # stand-in experts: local expert e scales its rows by (1 + global id / 8)
        first = rank * (E // W)
        scale = torch.repeat_interleave(torch.arange(E // W) + first, per_expert).to(torch.float32) / 8 + 1
        y = routed * scale[:, None]
        out = disp.combine(y, meta, x) if name == "ditron" else titan_alltoall_combine(y, meta, x, mesh.get_group())
        (out * gout).sum().backward()
        results[name] = (routed.detach(), per_expert.tolist(), out.detach(), x.grad, s.grad)
    clear_cache()
    d, t = results["ditron"], results["titan"]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0

    return {"rows_equal": torch.equal(d[0], t[0]), "counts_equal": d[1] == t[1], "out_err": rel(d[2], t[2]),
            "x_grad_err": rel(d[3], t[3]), "score_grad_err": rel(d[4], t[4])}
