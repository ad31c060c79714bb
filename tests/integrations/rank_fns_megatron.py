"""Rank side of the Megatron integration tests (emulated gloo ranks, megatron-core installed)."""
from __future__ import annotations

import torch
import torch.distributed as dist

H = 24


def _scale(e: int) -> float:
    return 1.0 + e / 8.0  # the stand-in expert: y = x * (1 + e/8), scaled by the row's probability


def _routing(tokens: int, E: int, K: int, drop: float, seed: int, r: int):
    g = torch.Generator().manual_seed(seed * 100 + r)
    x = torch.randn(tokens, H, generator=g)
    logits = torch.randn(tokens, E, generator=g)
    top = torch.topk(logits, K, dim=1).indices
    routing_map = torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, top, True)
    routing_map &= torch.rand(tokens, E, generator=g) >= drop   # slots a capacity would drop
    return x, logits, routing_map


def dispatcher_case(tokens: list[int], E: int, K: int, drop: float, seed: int) -> dict:
    """DitronTokenDispatcher through MoELayer's call sequence with stand-in experts that scale their
    rows by the probabilities (as Megatron's do): the dispatched rows, tokens_per_expert and
    probabilities against the all-to-all dispatcher's contract, and the output and the gradients
    of x and the router logits against float64 autograd over every rank."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ditron_ep.integrations.megatron import DitronTokenDispatcher
    from ditron_ep.ops import clear_cache

    rank, W = dist.get_rank(), dist.get_world_size()
    singles = [dist.new_group([r]) for r in range(W)]
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=E, moe_router_topk=K,
                            use_cpu_initialization=True)
    pg = ProcessGroupCollection(ep=dist.group.WORLD, expt_tp=singles[rank], tp_ep=dist.group.WORLD)
    el = E // W
    disp = DitronTokenDispatcher(el, list(range(rank * el, (rank + 1) * el)), cfg, pg)
    inputs = [_routing(t, E, K, drop, seed, r) for r, t in enumerate(tokens)]
    x0, logits0, rmap = inputs[rank]
    x, logits = x0.clone().requires_grad_(), logits0.clone().requires_grad_()
    probs = torch.softmax(logits, dim=-1)
    gout = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed * 7 + rank))

    hidden, p = disp.dispatch_preprocess(x, rmap, probs)
    hidden, p = disp.token_dispatch(hidden, p)
    rows, tokens_per_expert, p = disp.dispatch_postprocess(hidden, p)
    expert = torch.repeat_interleave(torch.arange(el) + rank * el, tokens_per_expert)
    y = rows * torch.tensor([_scale(int(e)) for e in expert])[:, None] * p[:, None]
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(y)))
    (out * gout).sum().backward()

    # the all-to-all dispatcher's contract: per local expert, sources in rank order, tokens in order
    want_rows, want_probs, want_counts = [], [], []
    for e in range(rank * el, (rank + 1) * el):
        n = 0
        for s, (xs, lg, rm) in enumerate(inputs):
            t = rm[:, e].nonzero().flatten()
            want_rows.append(xs[t])
            want_probs.append(torch.softmax(lg, dim=-1)[t, e])
            n += len(t)
        want_counts.append(n)
    # float64 over every rank: out_s[t] = sum_e p[t, e] * scale(e) * x[t]; loss = sum_s <out_s, gout_s>
    x64 = [xs.double().requires_grad_() for xs, _, _ in inputs]
    lg64 = [lg.double().requires_grad_() for _, lg, _ in inputs]
    loss = 0
    ref_out = None
    for s, (xs, lg, rm) in enumerate(inputs):
        scale = torch.tensor([_scale(e) for e in range(E)], dtype=torch.float64)
        o = ((torch.softmax(lg64[s], -1) * rm * scale) @ torch.ones(E, 1, dtype=torch.float64)) * x64[s]
        gs = torch.randn(xs.shape, generator=torch.Generator().manual_seed(seed * 7 + s)).double()
        loss = loss + (o * gs).sum()
        if s == rank:
            ref_out = o.detach()
    loss.backward()
    clear_cache()

    def rel(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)) if b.numel() else 0.0

    return {"rows_equal": torch.equal(rows.detach(), torch.cat(want_rows)),
            "counts": tokens_per_expert.tolist(), "want_counts": want_counts,
            "counts_dtype": str(tokens_per_expert.dtype), "counts_device": str(tokens_per_expert.device),
            "probs_err": rel(p.detach(), torch.cat(want_probs)),
            "out_err": rel(out.detach(), ref_out), "x_grad_err": rel(x.grad, x64[rank].grad),
            "logits_grad_err": rel(logits.grad, lg64[rank].grad)}
