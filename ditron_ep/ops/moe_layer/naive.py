"""Naive references of the MoE layer forward, in plain torch.

* `ep_moe_reference` — sequential expert-parallel forward over a process group: the reference
  layout of the library's deterministic ordering contract (below).
* `ep_moe_oracle` — single-process float64 oracle: a plain loop over tokens and slots on the whole
  cluster's inputs at once. It shares no layout, permutation or combine code with the reference
  (only input validation), so agreement between the two checks the reference's ordering.

`ep_moe_reference` runs each stage to completion before the next (no overlap), with the ordering
built from counts and prefix sums — never from arrival order:
1. layout   — every kept (token, k) pair becomes one row; rows are sorted by destination expert
              (stable, so by token index, then k, inside one expert);
2. counts   — `all_to_all_single` of per-expert row counts;
3. dispatch — `all_to_all_single` of the rows (a copy, in x's dtype);
4. experts  — rows of local expert e are ordered by (source rank, source token index); the
              SwiGLU FFN runs in float32;
5. return   — `all_to_all_single` of the float32 expert outputs back to their source rank;
6. combine  — out[t] = sum over k = 0..K-1, in that order, of w[t, k] * y(t, k) in float32,
              cast once to x's dtype.

Works over gloo (CPU tensors) and NCCL (CUDA tensors).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ditron_ep.check.routing import validate_routing

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def ep_moe_reference(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Expert-parallel MoE forward of this rank's tokens; collective over `group`.

    Rank r of W owns experts [r * E_local, (r + 1) * E_local), E_local = num_experts // W.
    Every rank of `group` must call this (with its own tokens; T_r may differ and may be 0).

    Args:
        x: [T_r, H], float16 / bfloat16 / float32 — this rank's tokens.
        topk_idx: [T_r, K], int32 or int64 — global expert id of each slot; -1 = dropped.
        topk_weights: [T_r, K], any float dtype — combine weight of each slot.
        w1: [E_local, H, 2I], x.dtype — this rank's experts, gate ‖ up (columns [:I] = gate).
        w2: [E_local, I, H], x.dtype — this rank's down projections.
        num_experts: E, experts in the whole group; a multiple of the group size.
        group: process group (default: the world).

    Returns:
        [T_r, H], x.dtype: out[t] = sum_k w[t,k] * (silu(x[t] @ w1g) * (x[t] @ w1u)) @ w2,
        accumulated in float32 in k order; dropped slots contribute nothing.

    Raises:
        ValueError on every rank if any rank's inputs are invalid or ranks disagree on H, I, K
        or dtype (checked collectively, so a bad rank does not leave the others hanging).
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _validate_collectively(x, topk_idx, topk_weights, w1, w2, num_experts, rank, world_size,
                           group)
    num_local = num_experts // world_size
    device = x.device

    layout = _send_layout(topk_idx, num_experts, world_size)
    recv_counts = torch.empty_like(layout.send_counts)  # [W * E_local]: (source rank, expert)
    dist.all_to_all_single(recv_counts, layout.send_counts, group=group)
    recv_counts = recv_counts.view(world_size, num_local)
    send_splits = layout.send_counts.view(world_size, num_local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()

    num_topk = topk_idx.shape[1]
    send_rows = x[layout.pair_ids // num_topk]  # [num_pairs, H], x.dtype
    recv_rows = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(recv_rows, send_rows, recv_splits, send_splits, group=group)

    expert_order = _expert_major_order(recv_counts)
    expert_out = _run_experts(recv_rows[expert_order], w1, w2, recv_counts.sum(0).tolist())
    recv_out = torch.empty_like(expert_out)  # back in arrival (source-major) order
    recv_out[expert_order] = expert_out
    send_out = recv_out.new_empty(len(layout.pair_ids), x.shape[1])
    dist.all_to_all_single(send_out, recv_out, send_splits, recv_splits, group=group)

    # One [T, K, H] float32 tensor of slot outputs; dropped slots stay zero.
    num_tokens = x.shape[0]
    slot_out = torch.zeros(num_tokens * num_topk, x.shape[1], dtype=torch.float32, device=device)
    slot_out[layout.pair_ids] = send_out
    slot_out = slot_out.view(num_tokens, num_topk, x.shape[1])
    weights = torch.where(topk_idx >= 0, topk_weights.float(), 0.0)  # [T, K] float32
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=device)
    for k in range(num_topk):  # fixed k order: the combine contract
        out += weights[:, k, None] * slot_out[:, k]
    return out.to(x.dtype)


def validate_moe_inputs(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    num_experts: int,
    world_size: int,
) -> None:
    """Raise ValueError, saying what to fix, unless one rank's MoE inputs are consistent.

    Shapes as in `ep_moe_reference`. Checks only this rank's tensors (not agreement between
    ranks).
    """
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % world_size != 0:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the world size {world_size} "
            f"(experts are split evenly over ranks); change num_experts or the world size")
    for name, t in (("x", x), ("w1", w1), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"x must be float16, bfloat16 or float32, got {x.dtype}; cast it with x.to(...)")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {t.dtype} but x has {x.dtype}; "
                             f"cast {name} to {x.dtype}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights), ("w1", w1),
                    ("w2", w2)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; "
                             f"put every input on one device")
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")
    hidden = x.shape[1]
    num_local = num_experts // world_size
    if w1.ndim != 3 or w1.shape[0] != num_local or w1.shape[1] != hidden:
        raise ValueError(
            f"w1 must have shape [E_local={num_local}, H={hidden}, 2*I], got {tuple(w1.shape)}; "
            f"E_local = num_experts // world_size = {num_experts} // {world_size}")
    if w1.shape[2] == 0 or w1.shape[2] % 2 != 0:
        raise ValueError(
            f"w1's last dim is gate ‖ up and must be even and > 0, got {w1.shape[2]}")
    inter = w1.shape[2] // 2
    if tuple(w2.shape) != (num_local, inter, hidden):
        raise ValueError(
            f"w2 must have shape [E_local={num_local}, I={inter}, H={hidden}] to match w1 "
            f"{tuple(w1.shape)} and x {tuple(x.shape)}, got {tuple(w2.shape)}")
    validate_routing(topk_idx, topk_weights, num_experts, x.shape[0])


@dataclass(frozen=True)
class _SendLayout:
    """Where this rank's kept (token, k) pairs go, in send order.

    pair_ids:    int64 [num_pairs] — flat slot id t * K + k of each row, sorted by destination
                 expert (stable: token, then k, inside one expert);
    send_counts: int64 [E] — rows for each global expert; as [W, E_local] it is per rank.
    """

    pair_ids: torch.Tensor
    send_counts: torch.Tensor


def _send_layout(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> _SendLayout:
    flat_expert = topk_idx.reshape(-1).to(torch.int64)
    kept = torch.nonzero(flat_expert >= 0).squeeze(1)  # ascending flat slot ids
    order = torch.sort(flat_expert[kept], stable=True).indices
    send_counts = torch.bincount(flat_expert[kept], minlength=num_experts)
    return _SendLayout(pair_ids=kept[order], send_counts=send_counts)


def _expert_major_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """Permutation taking received rows (source-major, then expert) to expert-major order.

    recv_counts: int64 [W, E_local], rows from each source rank for each local expert.
    Returns int64 [sum(recv_counts)]: index into the received rows, for rows ordered by
    (local expert, source rank, source token) — the deterministic ordering contract.
    """
    num_ranks, num_local = recv_counts.shape
    flat = recv_counts.reshape(-1)
    segment_start = torch.cumsum(flat, 0) - flat  # arrival offset of each (source, expert)
    by_expert = torch.arange(num_ranks * num_local, device=flat.device)
    by_expert = by_expert.view(num_ranks, num_local).t().reshape(-1)  # segments, expert-major
    lengths = flat[by_expert]
    starts = segment_start[by_expert]
    total = int(lengths.sum())
    first_out = torch.cumsum(lengths, 0) - lengths  # position of each segment in the output
    row = torch.arange(total, device=flat.device)
    return (torch.repeat_interleave(starts, lengths, output_size=total)
            + row - torch.repeat_interleave(first_out, lengths, output_size=total))


def _run_experts(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 rows_per_expert: list[int]) -> torch.Tensor:
    """SwiGLU FFN of expert-major rows [N, H] in float32; returns float32 [N, H]."""
    inter = w1.shape[2] // 2
    out = torch.empty(rows.shape[0], w2.shape[2], dtype=torch.float32, device=rows.device)
    start = 0
    for e, count in enumerate(rows_per_expert):
        x_e = rows[start:start + count].float()  # [count, H]
        h = x_e @ w1[e].float()  # [count, 2I]
        out[start:start + count] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) \
            @ w2[e].float()
        start += count
    return out


# Dtype codes for the cross-rank agreement check (any fixed numbering works).
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(ACTIVATION_DTYPES)}


def _validate_collectively(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           w1: torch.Tensor, w2: torch.Tensor, num_experts: int, rank: int,
                           world_size: int, group: dist.ProcessGroup | None) -> None:
    """Validate locally, then all-gather (ok, H, I, K, dtype) so every rank raises together."""
    try:
        validate_moe_inputs(x, topk_idx, topk_weights, w1, w2, num_experts=num_experts,
                            world_size=world_size)
        error = None
        summary = [1, x.shape[1], w1.shape[2] // 2, topk_idx.shape[1], _DTYPE_CODES[x.dtype]]
    except ValueError as exc:
        error = exc
        summary = [0, -1, -1, -1, -1]
    device = _collective_device(group)
    mine = torch.tensor(summary, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    if error is not None:
        raise ValueError(f"rank {rank}: {error}") from error
    table = torch.stack(gathered).cpu()
    bad = [r for r in range(world_size) if table[r, 0] == 0]
    if bad:
        raise ValueError(f"rank {rank}: inputs on rank(s) {bad} failed validation; "
                         f"see the error raised on those ranks")
    for column, what in ((1, "hidden size H"), (2, "intermediate size I"), (3, "topk K"),
                         (4, "dtype")):
        values = table[:, column].tolist()
        if len(set(values)) > 1:
            shown = values if column != 4 else [str(ACTIVATION_DTYPES[v]) for v in values]
            raise ValueError(f"ranks disagree on {what}: {shown} (by rank); every rank must "
                             f"pass tensors of the same {what}")


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Device for small control tensors: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

def ep_moe_oracle(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    w1s: list[torch.Tensor],
    w2s: list[torch.Tensor],
) -> list[torch.Tensor]:
    """MoE outputs of every rank, computed in float64 in one process.

    W = len(xs) ranks; index r of every list is rank r's input of `ep_moe_reference`:

    Args:
        xs: W tensors [T_r, H], float16 / bfloat16 / float32 (T_r may differ, may be 0).
        topk_idxs: W tensors [T_r, K], integer — global expert ids, -1 = dropped slot.
        topk_weights: W tensors [T_r, K], float.
        w1s: W tensors [E_local, H, 2I], dtype of xs — gate ‖ up of rank r's experts.
        w2s: W tensors [E_local, I, H], dtype of xs.

    Expert e lives on rank e // E_local at local index e % E_local.

    Returns:
        W tensors [T_r, H], float64 (on each x's device):
        out[t] = sum_k w[t,k] * (silu(x[t] @ gate) * (x[t] @ up)) @ w2 over kept slots.
    """
    num_ranks = len(xs)
    if num_ranks == 0:
        raise ValueError("xs is empty; pass one tensor per rank")
    for name, seq in (("topk_idxs", topk_idxs), ("topk_weights", topk_weights), ("w1s", w1s),
                      ("w2s", w2s)):
        if len(seq) != num_ranks:
            raise ValueError(f"{name} has {len(seq)} entries but xs has {num_ranks}; "
                             f"pass one tensor per rank in every list")
    if not isinstance(w1s[0], torch.Tensor) or w1s[0].ndim != 3:
        raise ValueError("w1s[0] must be a 3-D tensor [E_local, H, 2I]")
    num_local = w1s[0].shape[0]
    num_experts = num_local * num_ranks
    for r in range(num_ranks):
        try:
            validate_moe_inputs(xs[r], topk_idxs[r], topk_weights[r], w1s[r], w2s[r],
                                num_experts=num_experts, world_size=num_ranks)
        except ValueError as exc:
            raise ValueError(f"rank {r}: {exc}") from exc
    for r in range(1, num_ranks):
        if w1s[r].shape != w1s[0].shape or xs[r].dtype != xs[0].dtype \
                or topk_idxs[r].shape[1] != topk_idxs[0].shape[1]:
            raise ValueError(
                f"rank {r} disagrees with rank 0 on w1 shape, dtype or topk: "
                f"{tuple(w1s[r].shape)}, {xs[r].dtype}, K={topk_idxs[r].shape[1]} vs "
                f"{tuple(w1s[0].shape)}, {xs[0].dtype}, K={topk_idxs[0].shape[1]}")

    gate_up = [w.to(torch.float64) for w in w1s]  # per rank [E_local, H, 2I]
    down = [w.to(torch.float64) for w in w2s]  # per rank [E_local, I, H]
    inter = w1s[0].shape[2] // 2
    outs = []
    for r in range(num_ranks):
        x = xs[r].to(torch.float64)
        out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        for t in range(x.shape[0]):
            for k in range(topk_idxs[r].shape[1]):
                expert = int(topk_idxs[r][t, k])
                if expert < 0:
                    continue
                owner, local = divmod(expert, num_local)
                h = x[t] @ gate_up[owner][local]  # [2I]
                gate, up = h[:inter], h[inter:]
                act = gate / (1.0 + torch.exp(-gate)) * up  # silu(gate) * up, [I]
                out[t] += float(topk_weights[r][t, k]) * (act @ down[owner][local])
        outs.append(out)
    return outs


def ep_moe_oracle_grads(xs: list[torch.Tensor], topk_idxs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                        w1s: list[torch.Tensor], w2s: list[torch.Tensor],
                        grad_outs: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """float64 gradients of sum_r <out_r, grad_outs[r]> (outs as in `ep_moe_oracle`, SwiGLU
    experts) with respect to every rank's (x, topk_weights, w1, w2): W tuples of four float64
    tensors. torch autograd through a per-expert loop over every rank's tokens in one process; a
    dropped slot's weight gets gradient 0."""
    num_local = w1s[0].shape[0]
    inter = w1s[0].shape[2] // 2
    f64 = torch.float64
    x64 = [x.to(f64).requires_grad_() for x in xs]
    w64 = [w.to(f64).requires_grad_() for w in topk_weights]
    g1 = [w.to(f64).requires_grad_() for w in w1s]
    g2 = [w.to(f64).requires_grad_() for w in w2s]
    loss = torch.zeros((), dtype=f64)
    for r, idx in enumerate(topk_idxs):
        out = torch.zeros(x64[r].shape, dtype=f64)
        for e in idx.unique().tolist():
            if e < 0:
                continue
            owner, local = divmod(e, num_local)
            t, k = (idx == e).nonzero(as_tuple=True)
            z = x64[r][t] @ g1[owner][local]
            y = (torch.nn.functional.silu(z[:, :inter]) * z[:, inter:]) @ g2[owner][local]
            out = out.index_add(0, t, w64[r][t, k][:, None] * y)
        loss = loss + (out * grad_outs[r].to(f64)).sum()
    leaves = [t for r in range(len(xs)) for t in (x64[r], w64[r], g1[r], g2[r])]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return [tuple(grads[4 * r:4 * r + 4]) for r in range(len(xs))]
