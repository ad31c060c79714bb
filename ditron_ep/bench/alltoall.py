"""The `all_to_all_single` baseline of EP dispatch and combine, and the outputs it implies.

dispatch: every rank sends each other rank one row per token routed there (to any of its
    experts), pre-packed in (destination rank, token) order; nothing is sent to itself.
combine: the reverse exchange. For every token it received, a rank sends back one row: the sum of
    w[t, k] * y(t, k) over the token's slots on that rank (pre-reduced in fp32, cast to the
    dtype); the source rank adds its own slots and the rows that came back.
Only the exchange is timed (packing and the final sums are not), so the baseline moves exactly
the bytes of ep_inputs.BYTE_RULE. With identity experts (y = the dispatched rows), the exchanged
rows determine what ours must return: dispatch's expert-major rows, ordered by (source rank,
source token), bit for bit; and combine's out[t] = sum_k w[t, k] * x[t] within the dtype's
tolerance.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ditron_ep.bench.ranks import RankContext


def gather_routing(ctx: RankContext, idx: torch.Tensor,
                   w: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's topk_idx and topk_weights, on the CPU (collective; same T on every rank)."""
    idx_all = [torch.empty_like(idx) for _ in range(ctx.world)]
    w_all = [torch.empty_like(w) for _ in range(ctx.world)]
    dist.all_gather(idx_all, idx, group=ctx.group)
    dist.all_gather(w_all, w, group=ctx.group)
    return [i.cpu() for i in idx_all], [v.cpu() for v in w_all]


class AllToAll:
    """This rank's side of the baseline exchanges of one routing.

    Args:
        ctx: this rank.
        x: [T, H] this rank's tokens.
        idx_all, w_all: every rank's [T, K] routing (`gather_routing`).
        experts: E in all; rank d owns experts [d * E / W, (d + 1) * E / W).
    """

    def __init__(self, ctx: RankContext, x: torch.Tensor, idx_all: list[torch.Tensor],
                 w_all: list[torch.Tensor], experts: int) -> None:
        W, r = ctx.world, ctx.rank
        self.ctx, self.x, self.idx_all, self.w_all = ctx, x, idx_all, w_all
        self.e_local = experts // W
        # dest[s][t, k]: rank of slot (t, k) of rank s's tokens, -1 if dropped.
        self.dest = [torch.where(i >= 0, i // self.e_local, torch.full_like(i, -1)) for i in idx_all]
        # routed[s][d][t]: whether rank s's token t goes to rank d (one row per such token).
        self.routed = [[(self.dest[s] == d).any(1) for d in range(W)] for s in range(W)]
        self.send_splits = [0 if d == r else int(self.routed[r][d].sum()) for d in range(W)]
        self.recv_splits = [0 if s == r else int(self.routed[s][r].sum()) for s in range(W)]
        self.send = torch.cat([x[self.routed[r][d].to(x.device)] for d in range(W) if d != r]
                              or [x[:0]]).contiguous()                      # [sum send, H]
        self.recv = x.new_empty(sum(self.recv_splits), x.shape[1])          # [sum recv, H]
        self.back_send = self.recv.new_empty(self.recv.shape)               # combine: partial rows
        self.back_recv = self.send.new_empty(self.send.shape)

    # ------------------------------------------------------------------ the timed exchanges
    def dispatch(self) -> None:
        # As bytes: all_to_all_single of any dtype on every backend (gloo has no bf16).
        dist.all_to_all_single(self.recv.view(torch.uint8), self.send.view(torch.uint8),
                               self.recv_splits, self.send_splits, group=self.ctx.group)

    def combine(self) -> None:
        dist.all_to_all_single(self.back_recv.view(torch.uint8), self.back_send.view(torch.uint8),
                               self.send_splits, self.recv_splits, group=self.ctx.group)

    def pack_combine(self) -> None:
        """Pre-reduce the rows to send back (needs the rows of one `dispatch`)."""
        r, start = self.ctx.rank, 0
        for s, n in enumerate(self.recv_splits):
            if s == r:
                continue
            w_here = (self.w_all[s] * (self.dest[s] == r)).sum(1)[self.routed[s][r]]   # fp32 [n]
            rows = self.recv[start:start + n].float() * w_here.to(self.recv.device)[:, None]
            self.back_send[start:start + n] = rows.to(self.back_send.dtype)
            start += n

    # ------------------------------------------------------------------ what ours must return
    def _source_rows(self, s: int, start: int) -> tuple[torch.Tensor, int]:
        """Rank s's tokens routed to this rank, one row each in token order: received rows of
        the last `dispatch` (s remote) or this rank's own tokens (s == this rank)."""
        if s == self.ctx.rank:
            return self.x[self.routed[s][s].to(self.x.device)], start
        n = self.recv_splits[s]
        return self.recv[start:start + n], start + n

    def expected_dispatch(self) -> torch.Tensor:
        """[rows, H]: one row per (source rank, token, k) routed to this rank, ordered by
        (local expert, source rank, token, k), from the rows the last `dispatch` moved."""
        W, r = self.ctx.world, self.ctx.rank
        keys, rows, start = [], [], 0
        for s in range(W):
            src, start = self._source_rows(s, start)
            T, K = self.dest[s].shape
            pos = torch.cumsum(self.routed[s][r].long(), 0) - 1           # token -> row of src
            t, k = (self.dest[s] == r).nonzero(as_tuple=True)
            e = self.idx_all[s][t, k] - r * self.e_local
            keys.append(((e * W + s) * T + t) * K + k)
            rows.append(src[pos[t].to(src.device)])
        order = torch.argsort(torch.cat(keys)).to(self.x.device)
        return torch.cat(rows)[order]

    def expected_combine(self) -> torch.Tensor:
        """fp32 [T, H]: out[t] = sum_k w[t, k] * x[t], from this rank's own slots and the rows
        that the last `combine` brought back."""
        r = self.ctx.rank
        mine = self.dest[r]
        w_local = (self.w_all[r] * (mine == r)).sum(1).to(self.x.device)
        out = self.x.float() * w_local[:, None]
        start = 0
        for d, n in enumerate(self.send_splits):
            if d != r and n:
                out[self.routed[r][d].to(self.x.device)] += self.back_recv[start:start + n].float()
                start += n
        return out
