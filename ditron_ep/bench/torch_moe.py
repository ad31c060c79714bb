"""The torch-native EP MoE forward, the baseline the MoE layer benchmarks time ours against, and
its expert GEMMs (torch._grouped_mm), the grouped GEMM benchmark's baseline."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F


def torch_gate_up(x_rows: torch.Tensor, w1: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """h = silu(x_r @ gate) * (x_r @ up) of every local expert's rows, torch._grouped_mm: [rows, H] -> [rows, I].
    offs: int32 [E_local] cumulative row ends; w1 [E_local, H, 2I] (any strides)."""
    inter = w1.shape[2] // 2
    g = torch._grouped_mm(x_rows, w1, offs=offs)                      # [rows, 2I]
    return F.silu(g[:, :inter]) * g[:, inter:]


def torch_down(h: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """y = h_r @ W2[e] of every local expert's rows, torch._grouped_mm: [rows, I] -> [rows, H]."""
    return torch._grouped_mm(h, w2, offs=offs)


def torch_experts(x_rows: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  loop_offsets: list[int] | None) -> torch.Tensor:
    """SwiGLU FFN of every local expert over expert-major rows [rows, H] -> [rows, H].

    offs: int32 [E_local] cumulative row ends (torch._grouped_mm). loop_offsets: None to use
    torch._grouped_mm; else the host row offsets [E_local + 1] of a per-expert torch.matmul loop
    (the fallback where torch._grouped_mm is unsupported).
    """
    inter = w2.shape[1]
    if loop_offsets is None:
        return torch_down(torch_gate_up(x_rows, w1, offs), w2, offs)
    parts = []   # one matmul pair per expert, concatenated (differentiable: training benchmarks use it)
    for e in range(w1.shape[0]):
        g = x_rows[loop_offsets[e]:loop_offsets[e + 1]] @ w1[e]
        parts.append((F.silu(g[:, :inter]) * g[:, inter:]) @ w2[e])
    return torch.cat(parts)


def torch_native_moe(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     grouped: bool, group: dist.ProcessGroup | None = None, differentiable: bool = False) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * FFN_{idx[t,k]}(x[t]) with NCCL all_to_all_single and torch ops only.

    x [T, H]; idx int64 [T, K] (no dropped slots); w fp32 [T, K]; w1 / w2 this rank's experts.
    grouped: torch._grouped_mm for the experts, else a per-expert torch.matmul loop.
    differentiable: the row exchanges through torch.distributed.nn's all_to_all_single, which has
    autograd (everything else is differentiable torch ops), for training.
    """
    def exchange(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if differentiable:
            return dist_nn.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
        return out

    T, K = idx.shape
    H, e_local = x.shape[1], w1.shape[0]
    W = dist.get_world_size(group)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)                  # (token, k) pairs by destination expert
    send_x = x.index_select(0, order // K)                    # [T*K, H], one copy per (token, expert)
    counts = torch.zeros(e_local * W, dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))                       # [W * E_local] rows per destination expert (no sync)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [W * E_local]: source rank s, local expert e
    host = torch.stack([counts, recv_counts]).view(2, W, e_local).cpu()   # the one host read
    send_splits, recv_splits = host[0].sum(1).tolist(), host[1].sum(1).tolist()
    rows = sum(recv_splits)
    recv_x = exchange(x.new_empty(rows, H), send_x, recv_splits, send_splits)
    # Source-major -> expert-major; stable, so within an expert rows stay in (source rank, token) order.
    expert_of_row = torch.repeat_interleave(torch.arange(e_local, device=x.device).repeat(W), recv_counts,
                                            output_size=rows)
    perm = torch.argsort(expert_of_row, stable=True)
    per_expert = recv_counts.view(W, e_local).sum(0)
    offs = per_expert.cumsum(0).to(torch.int32)
    loop_offsets = None if grouped else [0, *host[1].sum(0).cumsum(0).tolist()]
    y_e = torch_experts(recv_x.index_select(0, perm), offs, w1, w2, loop_offsets)
    y_r = torch.empty_like(y_e).index_copy_(0, perm, y_e)    # back to the received (source-major) order
    back = exchange(x.new_empty(T * K, H), y_r, send_splits, recv_splits)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(T * K, device=x.device)
    rows_tk = back.index_select(0, inv).view(T, K, H)          # [T, K, H] in (token, k) order
    return torch.bmm(w.to(x.dtype).unsqueeze(1), rows_tk).squeeze(1)   # [T, H]
