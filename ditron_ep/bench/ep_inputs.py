"""Inputs of the EP benchmarks (tokens, routing, experts' weights) and the traffic they cause
between ranks.

Seeds: rank r's routing comes from `torch.Generator().manual_seed(seed * 1000 + r)`, its tokens
from a generator on its device seeded `seed * 1000 + 500 + r` and its experts' weights from one
seeded `seed * 1000 + 700 + r`, so a (seed, T, E, K, H, I) config is the same in every benchmark
and every run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ditron_ep.bench.ranks import RankContext
from ditron_ep.check import make_routing

BYTE_RULE = (
    "bytes = tokens this rank receives from OTHER ranks, one copy per (token, destination rank), "
    "x hidden x element size; combine: the same count in the reverse direction. Reported bytes are "
    "the mean over ranks (bytes_max in JSON is the busiest rank); GB/s = mean bytes / median of "
    "the slowest rank's per-iteration time (1 GB = 1e9 B). Local (same-rank) tokens are not "
    "counted (DeepEP's rule counts them). 'wire' bytes of our combine = (token, k) pairs received "
    "from other ranks x hidden x element size: it returns one row per pair, not per (token, rank). "
    "Baseline NCCL all_to_all_single moves exactly the rule's bytes.")


def ranks_reached(idx: torch.Tensor, experts: int, world: int) -> torch.Tensor:
    """int64 [T]: the ranks holding each token's routed experts (idx [T, K], -1 = dropped), each
    counted once: a combine of identity experts' token rows gives x times this."""
    home = torch.where(idx >= 0, idx // (experts // world), world).long()  # dropped: a column past the ranks
    return (torch.zeros(idx.shape[0], world + 1, dtype=torch.int64, device=idx.device)
            .scatter_(1, home, 1)[:, :world].sum(1))


@dataclass
class Inputs:
    x: torch.Tensor            # [T, H] dtype, device
    idx: torch.Tensor          # int64 [T, K], device
    w: torch.Tensor            # fp32 [T, K], device
    tokens_sent: list[list[int]]  # [src][dst] tokens (one copy per (token, destination rank))
    pairs_sent: list[list[int]]   # [src][dst] (token, k) pairs

    def recv_remote_tokens(self, r: int) -> int:
        return sum(self.tokens_sent[s][r] for s in range(len(self.tokens_sent)) if s != r)

    def recv_remote_pairs(self, r: int) -> int:
        return sum(self.pairs_sent[s][r] for s in range(len(self.pairs_sent)) if s != r)

    def rows_received(self, r: int) -> int:
        return sum(self.pairs_sent[s][r] for s in range(len(self.pairs_sent)))


def make_inputs(ctx: RankContext, tokens: int, experts: int, topk: int, hidden: int, routing: str) -> Inputs:
    """This rank's tokens and routing, and every rank's traffic (collective: one all_gather)."""
    W = ctx.world
    g = torch.Generator().manual_seed(ctx.seed * 1000 + ctx.rank)
    idx, w = make_routing(tokens, experts, topk, routing, generator=g, num_ranks=W)
    gx = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1000 + 500 + ctx.rank)
    x = torch.randn(tokens, hidden, generator=gx, device=ctx.device).to(ctx.dtype)
    e_local = experts // W
    dest = torch.where(idx >= 0, idx // e_local, torch.full_like(idx, W))   # W = dropped
    hit = torch.zeros((tokens, W + 1), dtype=torch.int64).scatter_(1, dest, 1)[:, :W]
    mine = torch.cat([hit.sum(0), torch.bincount(dest.reshape(-1), minlength=W + 1)[:W]]).to(torch.float64)
    vec = ctx.coll_tensor(mine.tolist())
    parts = [torch.empty_like(vec) for _ in range(W)]
    dist.all_gather(parts, vec, group=ctx.group)
    rows = [[int(v) for v in p.tolist()] for p in parts]
    return Inputs(x=x, idx=idx.to(ctx.device), w=w.to(ctx.device),
                  tokens_sent=[r[:W] for r in rows], pairs_sent=[r[W:] for r in rows])


@dataclass
class Weights:
    w1: torch.Tensor           # [E_local, H, 2I] row-major (gate ‖ up)
    w2: torch.Tensor           # [E_local, I, H] row-major
    col_major: dict[str, torch.Tensor] = field(default_factory=dict)  # same values, column-major views

    def layout(self, name: str, col: bool) -> torch.Tensor:
        """`name` ("w1" or "w2") row-major, or column-major (a transposed view of [E, N, K] storage)."""
        w = getattr(self, name)
        if not col:
            return w
        if name not in self.col_major:
            self.col_major[name] = w.transpose(1, 2).contiguous().transpose(1, 2)
        return self.col_major[name]


def make_weights(ctx: RankContext, e_local: int, hidden: int, inter: int) -> Weights:
    """`e_local` experts' weights on this rank's device, scaled by H^-1/2 and I^-1/2 (so that h
    and y are O(1))."""
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed * 1000 + 700 + ctx.rank)

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=ctx.device) * scale).to(ctx.dtype)

    return Weights(w1=randn(e_local, hidden, 2 * inter, scale=hidden**-0.5),
                   w2=randn(e_local, inter, hidden, scale=inter**-0.5))


@dataclass
class Bytes:
    rule: float | None        # mean over ranks
    rule_max: float | None
    wire: float | None        # mean over ranks


def traffic_bytes(ctx: RankContext, inp: Inputs, kind: str | None, hidden: int) -> Bytes:
    """Bytes of one `kind` ("dispatch", "combine", "roundtrip") call by BYTE_RULE."""
    if kind is None:
        return Bytes(None, None, None)
    rb = hidden * ctx.elt
    tok = [inp.recv_remote_tokens(r) * rb for r in range(ctx.world)]
    pairs = [inp.recv_remote_pairs(r) * rb for r in range(ctx.world)]
    mean_t, max_t, mean_p = sum(tok) / ctx.world, max(tok), sum(pairs) / ctx.world
    if kind == "dispatch":
        return Bytes(mean_t, max_t, mean_t)
    if kind == "combine":
        return Bytes(mean_t, max_t, mean_p)
    return Bytes(2 * mean_t, 2 * max_t, mean_t + mean_p)  # roundtrip
