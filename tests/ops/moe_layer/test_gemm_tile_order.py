"""The megakernel's GEMM ticket decode, run as device code (Triton interpreter): over the live
row-tile positions of a call (n_pos <= the plan's bound, the last group possibly short), the
gate-up and down tickets reach exactly the plan's tasks of those positions, each once, in the
plan's order, and each task decodes to the (row tile, col tile) the plan's coords give it;
combine tickets pass through. Every tile order the lowering makes, gate-up and down with
different column-tile counts."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from ditron_ep.compiler.lowering import lower
from ditron_ep.compiler.plan import MoESpec
from ditron_ep.ops.moe_layer.fused_kernels import _gemm_task_of_ticket, _gemm_tile


@triton.jit
def _walk_kernel(out_ptr, tiles_ptr, F2, F3, F4, n_pos, n_t1, n_t2, group, n_combine):
    G3 = F2 + n_pos * n_t1
    G4 = G3 + n_pos * n_t2
    for t in range(F2, G4 + n_combine):
        task = _gemm_task_of_ticket(t, F2, F3, F4, G3, G4, n_pos, n_t1, n_t2, group)
        i_m = -1
        i_n = -1
        if task < F3:
            i_m, i_n, e, row0, n_rows = _gemm_tile(task - F2, n_t1, group, tiles_ptr)
        elif task < F4:
            i_m, i_n, e, row0, n_rows = _gemm_tile(task - F3, n_t2, group, tiles_ptr)
        tl.store(out_ptr + 3 * (t - F2), task)
        tl.store(out_ptr + 3 * (t - F2) + 1, i_m)
        tl.store(out_ptr + 3 * (t - F2) + 2, i_n)


# (order, group rows): the plan's own groups, short last groups (n_rt not a multiple), groups
# larger than n_pos, and the two classic orders
ORDERS = [("grouped", 2), ("grouped", 3), ("grouped", 5), ("row_major", None), ("column_major", None)]


@pytest.mark.parametrize("order,group", ORDERS, ids=[f"{o}-{g}" for o, g in ORDERS])
def test_tickets_reach_the_plans_live_tasks_in_order(order, group):
    # H=48 (down: 2 column tiles of 32), I=64 (gate-up: 4 of 16), 8 row-tile bound or so
    spec = MoESpec(world_size=2, num_experts=4, topk=2, hidden=48, ffn_hidden=64, max_tokens=20,
                   dtype="float32", device_type="cpu")
    plan = lower(spec, gemm_tile_order=order, **({"gemm_group_rows": group} if group else {}))
    d = plan.device
    gu, dn, cb = d.stage("gemm_gate_up"), d.stage("gemm_down"), d.stage("combine_reduce")
    assert d.n_tiles1 != d.n_tiles2 and d.n_row_tiles_max >= 6
    # tile table: position i holds natural tile 100 + i (the decode returns the natural index)
    tiles = torch.tensor([[0, 0, 1, 100 + i] for i in range(d.n_row_tiles_max)], dtype=torch.int32)
    for n_pos in sorted({1, 2, d.gemm_group_rows, d.gemm_group_rows + 1, d.n_row_tiles_max - 1, d.n_row_tiles_max}):
        if not 1 <= n_pos <= d.n_row_tiles_max:
            continue
        n_tickets = n_pos * (d.n_tiles1 + d.n_tiles2) + 3
        out = torch.full((n_tickets, 3), -7, dtype=torch.int32)
        _walk_kernel[(1,)](out, tiles, gu.first_task, dn.first_task, cb.first_task, n_pos, d.n_tiles1, d.n_tiles2,
                           d.gemm_group_rows, 3)
        got = out.tolist()
        want = []
        for s in (gu, dn):
            for q in range(s.num_tasks):
                c = s.coords(q)
                if c["row_tile"] < n_pos:
                    want.append([s.first_task + q, 100 + c["row_tile"], c["col_tile"]])
        want += [[cb.first_task + j, -1, -1] for j in range(3)]
        assert got == want, f"{order} groups of {d.gemm_group_rows}, n_pos={n_pos}"
