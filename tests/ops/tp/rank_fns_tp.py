"""Rank-side checks of the tensor-parallel ops (imported by name in emulated rank processes)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ditron_ep.ops import (ColumnParallelLinear, RowParallelLinear, all_gather_matmul, matmul_all_reduce,
                           matmul_reduce_scatter)
from ditron_ep.ops.tp.naive import all_gather_matmul_ref, matmul_all_reduce_ref, matmul_reduce_scatter_ref


def _gather_list(t: torch.Tensor) -> list[torch.Tensor]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach())
    return out


def _run(op, a: torch.Tensor, b: torch.Tensor, gout: torch.Tensor) -> tuple:
    """op(a, b) -> y or (y, ...), with the gradients of sum(y * gout): (outputs..., da, db)."""
    la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
    outs = op(la, lb)
    outs = outs if isinstance(outs, tuple) else (outs,)
    (outs[0] * gout).sum().backward()
    return (*(o.detach() for o in outs), la.grad, lb.grad)


def _two_runs(op, a: torch.Tensor, b: torch.Tensor, gout: torch.Tensor) -> list[tuple]:
    """`_run` twice: [(outputs..., da, db)] per run."""
    return [_run(op, a, b, gout) for _ in range(2)]


def _sequential_vs_overlap(op, a: torch.Tensor, b: torch.Tensor, gout: torch.Tensor,
                           **kw) -> tuple[list[bool], tuple, tuple]:
    """`_run` of op(..., schedule=S) for both schedules: (per output, whether overlap's bits equal
    sequential's; sequential's outputs; overlap's)."""
    seq, over = (_run(lambda x, y, s=s: op(x, y, schedule=s, **kw), a, b, gout) for s in ("sequential", "overlap"))
    return [torch.equal(x, z) for x, z in zip(seq, over)], seq, over


def _float64_leaves(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.double().requires_grad_() for t in ts]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


def ops_case(m: int, k: int, n: int, seed: int) -> dict:
    """Each op forward + backward against float64 torch on every rank's operands (fp32, shapes off
    any tile grid, each rank its own b); then the same call again, bitwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    errs, bitwise = {}, {}

    # ---- all_gather_matmul: a [m, k], b [k, n_r] (each rank its own columns)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(k, n + rank, generator=g)
    gout = torch.randn(world * m, n + rank, generator=g)
    runs = _two_runs(lambda la, lb: all_gather_matmul(la, lb, return_gathered=True), a, b, gout)
    a_all, b_all, g_all = _gather_list(a), _gather_list(b), _gather_list(gout)
    ad, bd = _float64_leaves(a_all), _float64_leaves(b_all)
    total = sum(((torch.cat(ad) @ bd[r]) * g_all[r].double()).sum() for r in range(world))
    total.backward()
    y, gathered, da, db = runs[0]
    errs["ag y"] = _rel(y, all_gather_matmul_ref(a_all, b))
    errs["ag gathered"] = _rel(gathered, torch.cat(a_all).double())
    errs["ag da"] = _rel(da, ad[rank].grad)
    errs["ag db"] = _rel(db, bd[rank].grad)
    bitwise["ag"] = all(torch.equal(x, z) for x, z in zip(runs[0], runs[1]))

    # ---- matmul_reduce_scatter: a [W*m, k], b [k, n] (the same shapes everywhere)
    a = torch.randn(world * m, k, generator=g)
    b = torch.randn(k, n, generator=g)
    gout = torch.randn(m, n, generator=g)
    runs = _two_runs(lambda la, lb: (matmul_reduce_scatter(la, lb),), a, b, gout)
    a_all, b_all, g_all = _gather_list(a), _gather_list(b), _gather_list(gout)
    ad, bd = _float64_leaves(a_all), _float64_leaves(b_all)
    full = sum(x @ z for x, z in zip(ad, bd))
    (full * torch.cat(g_all).double()).sum().backward()
    y, da, db = runs[0]
    errs["rs y"] = _rel(y, matmul_reduce_scatter_ref(a_all, b_all, rank))
    errs["rs da"] = _rel(da, ad[rank].grad)
    errs["rs db"] = _rel(db, bd[rank].grad)
    bitwise["rs"] = all(torch.equal(x, z) for x, z in zip(runs[0], runs[1]))

    # ---- matmul_all_reduce: a [m, k_r], b [k_r, n] (each rank its own K)
    a = torch.randn(m, k + 2 * rank, generator=g)
    b = torch.randn(k + 2 * rank, n, generator=g)
    gout = torch.randn(m, n, generator=torch.Generator().manual_seed(seed))  # the same upstream gradient everywhere
    runs = _two_runs(lambda la, lb: (matmul_all_reduce(la, lb),), a, b, gout)
    a_all, b_all = _gather_list(a), _gather_list(b)
    ad, bd = _float64_leaves(a_all), _float64_leaves(b_all)
    (sum(x @ z for x, z in zip(ad, bd)) * gout.double()).sum().backward()
    y, da, db = runs[0]
    errs["ar y"] = _rel(y, matmul_all_reduce_ref(a_all, b_all))
    errs["ar da"] = _rel(da, ad[rank].grad)
    errs["ar db"] = _rel(db, bd[rank].grad)
    bitwise["ar"] = all(torch.equal(x, z) for x, z in zip(runs[0], runs[1]))
    same_everywhere = all(torch.equal(t, y) for t in _gather_list(y))
    return {"errs": errs, "bitwise": bitwise, "ar_same_on_every_rank": same_everywhere}


def bad_input_case(kind: str) -> str:
    """The error every rank raises for one kind of bad input (rank 1 alone wrong where it can be)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = torch.randn(4 * world, 8), torch.randn(8, 6)
    try:
        if kind == "rows differ":  # all_gather_matmul needs one M on every rank
            all_gather_matmul(torch.randn(4 + (rank == 1), 8), b)
        elif kind == "not divisible":
            matmul_reduce_scatter(torch.randn(4 * world + 1, 8), b)
        elif kind == "inner mismatch on one rank":
            matmul_all_reduce(a, torch.randn(8 + (rank == 1), 6))
        elif kind == "dtype":
            matmul_all_reduce(a, b.double() if rank == 1 else b)
        elif kind == "1-D":
            all_gather_matmul(torch.randn(8), b)
        else:
            raise AssertionError(kind)
    except ValueError as exc:
        dist.barrier()  # the ranks are still in step: the next collective works
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def store_agreement_case(kinds: list[str]) -> dict:
    """The TP ops' agreement through the c10d store (what NCCL groups use; agreement.py): each
    kind of bad input raises the same error on every rank as the tensor exchange does, good
    calls give the tensor exchange's results, and each rank's keys of old calls are deleted."""
    from ditron_ep.runtime import agreement

    rank, world = dist.get_rank(), dist.get_world_size()
    rep: dict = {}
    old = agreement.AGREE_TRANSPORT
    try:
        a, b = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(rank)), torch.randn(8, 6)
        agreement.AGREE_TRANSPORT = "tensor"
        want = [matmul_all_reduce(a, b), all_gather_matmul(a, b), matmul_reduce_scatter(a, b)]
        agreement.AGREE_TRANSPORT = "store"
        rep["errors"] = {kind: bad_input_case(kind) for kind in kinds}
        got = [[matmul_all_reduce(a, b), all_gather_matmul(a, b), matmul_reduce_scatter(a, b)] for _ in range(3)]
        rep["same"] = [all(torch.equal(g, w) for g, w in zip(call, want)) for call in got]
        ag = next(iter(agreement._STORE_AGREEMENTS.values()))
        dist.barrier()
        rep["calls"] = ag.call
        rep["kept"] = [c for c in range(1, ag.call + 1) if ag.store.check([f"{c}/{rank}"])]
        # the group made again (destroy_process_group, init): its first calls must not read the
        # keys the old one left in the store
        again = agreement.StoreAgreement(None, ag.base)
        rep["fresh_rows"] = all(row[0] == 7 for _ in range(ag.call) for row in again.exchange([7, rank]))
        dist.barrier()
        # a peer that never comes: the store's timeout raises, and every later call of that
        # agreement raises at once (its call number is ahead of its peers')
        if rank == 0:
            import datetime
            before = again.store.timeout  # (the process group's own store: restored below)
            again.store.set_timeout(datetime.timedelta(seconds=1))
            rep["timeout"] = []
            try:
                for _ in range(2):
                    try:
                        again.exchange([7, rank])
                        rep["timeout"].append("no error")
                    except agreement.DitronOutOfStepError as err:
                        rep["timeout"].append(str(err))
            finally:
                again.store.set_timeout(before)
            rep["timeout_restored"] = ag.base.timeout == before
        dist.barrier()
    finally:
        agreement.AGREE_TRANSPORT = old
    return rep


def modules_case(seq_parallel: bool, tokens: int, hidden: int, ffn: int, seed: int,
                 schedule: str = "sequential") -> dict:
    """A TP MLP block (ColumnParallel -> GELU -> RowParallel, from the same nn.Linears on every rank)
    against the unsharded block: outputs and every gradient (weights: this rank's shard)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    fc1, fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    x = torch.randn(tokens, hidden)
    gout = torch.randn(tokens, hidden)
    col = ColumnParallelLinear.from_linear(fc1, sequence_parallel=seq_parallel, schedule=schedule)
    row = RowParallelLinear.from_linear(fc2, sequence_parallel=seq_parallel, schedule=schedule)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)
    xin = (x[rows] if seq_parallel else x).clone().requires_grad_()
    y = row(torch.nn.functional.gelu(col(xin)))
    (y * (gout[rows] if seq_parallel else gout)).sum().backward()
    ref_x = x.double().requires_grad_()
    f1, f2 = nn.Linear(hidden, ffn).double(), nn.Linear(ffn, hidden).double()
    f1.load_state_dict(fc1.state_dict())
    f2.load_state_dict(fc2.state_dict())
    ref = f2(torch.nn.functional.gelu(f1(ref_x)))
    (ref * gout.double()).sum().backward()
    shard1 = slice(rank * ffn // world, (rank + 1) * ffn // world)
    bias2 = row.bias.grad
    if seq_parallel:  # each rank's bias gradient covers its rows: the group's sum is the full one
        parts = _gather_list(bias2)
        bias2 = sum(parts)
    return {"y": _rel(y, ref[rows] if seq_parallel else ref),
            "dx": _rel(xin.grad, ref_x.grad[rows] if seq_parallel else ref_x.grad),
            "dW1": _rel(col.weight.grad, f1.weight.grad[shard1]), "db1": _rel(col.bias.grad, f1.bias.grad[shard1]),
            "dW2": _rel(row.weight.grad, f2.weight.grad[:, shard1]), "db2": _rel(bias2, f2.bias.grad)}


def overlap_case(m: int, k: int, n: int, seed: int) -> dict:
    """all_gather_matmul(schedule="overlap") against "sequential": y, the gathered rows and both
    gradients bit for bit, for two calls in a row (the second reuses the heap) and one with more
    rows (the heap is rebuilt on every rank)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    same = []
    for rows in (m, m, 2 * m + 3):
        a = torch.randn(rows, k, generator=g)
        b = torch.randn(k, n + rank, generator=g)
        gout = torch.randn(dist.get_world_size() * rows, n + rank, generator=g)
        bits, seq, _ = _sequential_vs_overlap(all_gather_matmul, a, b, gout, return_gathered=True)
        same.append(bits)
        # the role split (a copy program, which turns to GEMM tiles once its queue drains)
        from ditron_ep.ops.tp.fused import overlapped_all_gather_matmul
        with torch.no_grad():
            same[-1].append(torch.equal(overlapped_all_gather_matmul(a, b, None, comm_programs=1), seq[0]))
    return {"same": same}


def overlap_rs_case(m: int, k: int, n: int, seed: int) -> dict:
    """matmul_reduce_scatter(schedule="overlap") against "sequential": y and both gradients bit for
    bit (the backward is the sequential one's), for two calls in a row (the second reuses the heap
    and its signals, stamped with a new call number), one with more rows (the heap is rebuilt on
    every rank) and one with other columns; and y against float64."""
    from ditron_ep.ops.tp import matmul_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    same, errs = [], []
    for rows, cols in ((m, n), (m, n), (2 * m + 3, n), (m, n + 7)):
        a = torch.randn(world * rows, k, generator=g)
        b = torch.randn(k, cols, generator=g)
        gout = torch.randn(rows, cols, generator=g)
        bits, _, over = _sequential_vs_overlap(matmul_reduce_scatter, a, b, gout)
        same.append(bits)
        full = sum(p.double() @ q.double() for p, q in zip(_gather_list(a), _gather_list(b)))
        errs.append(_rel(over[0], full[rank * rows:(rank + 1) * rows]))
    return {"same": same, "errs": errs}


def overlap_ar_case(m: int, k: int, n: int, seed: int) -> dict:
    """matmul_all_reduce(schedule="overlap") against "sequential" (each rank its own K, as a
    row-parallel layer's shard): y and both gradients bit for bit, twice in a row, then with more
    rows (a rebuilt heap); y identical on every rank and against float64."""
    from ditron_ep.ops.tp import matmul_all_reduce

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed * 100 + rank)
    same, errs, ys = [], [], []
    for rows in (m, m, 2 * m + 3):
        a = torch.randn(rows, k + 3 * rank, generator=g)
        b = torch.randn(k + 3 * rank, n, generator=g)
        gout = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed + rows))  # the same on every rank
        bits, _, over = _sequential_vs_overlap(matmul_all_reduce, a, b, gout)
        same.append(bits)
        full = sum(p.double() @ q.double() for p, q in zip(_gather_list(a), _gather_list(b)))
        errs.append(_rel(over[0], full))
        ys.append(all(torch.equal(y, over[0]) for y in _gather_list(over[0])))
    return {"same": same, "errs": errs, "same_on_every_rank": ys}


def overlap_empty_case() -> dict:
    """The overlapped schedule with empty operands gives what the sequential one does, on every
    rank (no rank raising alone): AG+GEMM with N = 0 on rank 1 and with no rows; GEMM+RS with no
    rows; GEMM+AR with K = 0 on rank 1 and with no rows."""
    from ditron_ep.ops.tp import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    cases = {
        "ag N=0 on rank 1": (all_gather_matmul, torch.randn(5, 8, generator=g), torch.randn(8, 0 if rank == 1 else 6)),
        "ag no rows": (all_gather_matmul, torch.randn(0, 8), torch.randn(8, 6, generator=g)),
        "rs no rows": (matmul_reduce_scatter, torch.randn(0, 8), torch.randn(8, 6, generator=g)),
        "ar K=0 on rank 1": (matmul_all_reduce, torch.randn(7, 0 if rank == 1 else 9, generator=g),
                             torch.randn(0 if rank == 1 else 9, 6, generator=g)),
        "ar no rows": (matmul_all_reduce, torch.randn(0, 9), torch.randn(9, 6, generator=g)),
    }
    out = {}
    for what, (op, a, b) in cases.items():
        seq, over = (op(a, b, schedule=s) for s in ("sequential", "overlap"))
        out[what] = torch.equal(seq, over) and tuple(over.shape) == tuple(seq.shape)
    assert world >= 2
    return out


def subgroup_case(m: int, k: int, n: int, seed: int, device: str | torch.device = "cpu") -> dict:
    """The ops on half the ranks each ({0, 1} and {2, 3} at W=4, single ranks at W=2; one group
    object per half, made by every rank): y and the gradients against float64 over the half's
    operands, ranks and rows taken in the group's order, and the overlapped schedule bitwise the
    sequential one. fp32 operands made on the CPU, run on `device` (tests/gpu uses it too)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [dist.new_group(list(range(h, h + world // 2))) for h in (0, world // 2)]  # collective, same order
    grp = halves[rank // (world // 2)]
    gw, gr = dist.get_world_size(grp), dist.get_rank(grp)
    g = torch.Generator().manual_seed(seed * 100 + rank)

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out: list = [None] * gw
        dist.all_gather_object(out, t.detach().cpu(), group=grp)
        return out

    def run(op, a, b, gout):
        """_sequential_vs_overlap on `device`; the sequential outputs back on the CPU."""
        same, seq, _ = _sequential_vs_overlap(op, a.to(device), b.to(device), gout.to(device), group=grp)
        return same, tuple(t.cpu() for t in seq)

    errs, same = {}, {}
    # all_gather_matmul: every rank its own b columns and upstream gradient, so da sums the group's terms
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n + gr, generator=g)
    gout = torch.randn(gw * m, n + gr, generator=g)
    same["ag"], seq = run(all_gather_matmul, a, b, gout)
    ad, bd, g_all = _float64_leaves(gather(a)), _float64_leaves(gather(b)), gather(gout)
    sum(((torch.cat(ad) @ bd[r]) * g_all[r].double()).sum() for r in range(gw)).backward()
    errs["ag y"] = _rel(seq[0], torch.cat(ad).detach() @ bd[gr].detach())
    errs["ag da"], errs["ag db"] = _rel(seq[1], ad[gr].grad), _rel(seq[2], bd[gr].grad)

    a, b = torch.randn(gw * m, k, generator=g), torch.randn(k, n, generator=g)
    gout = torch.randn(m, n, generator=g)
    same["rs"], seq = run(matmul_reduce_scatter, a, b, gout)
    ad, bd = _float64_leaves(gather(a)), _float64_leaves(gather(b))
    full = sum(x @ z for x, z in zip(ad, bd))
    (full * torch.cat(gather(gout)).double()).sum().backward()
    errs["rs y"] = _rel(seq[0], full.detach()[gr * m:(gr + 1) * m])
    errs["rs da"], errs["rs db"] = _rel(seq[1], ad[gr].grad), _rel(seq[2], bd[gr].grad)

    a, b = torch.randn(m, k + gr, generator=g), torch.randn(k + gr, n, generator=g)
    gout = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 1))
    same["ar"], seq = run(matmul_all_reduce, a, b, gout)
    ad, bd = _float64_leaves(gather(a)), _float64_leaves(gather(b))
    full = sum(x @ z for x, z in zip(ad, bd))
    (full * gout.double()).sum().backward()
    errs["ar y"], errs["ar da"], errs["ar db"] = _rel(seq[0], full.detach()), _rel(seq[1], ad[gr].grad), \
        _rel(seq[2], bd[gr].grad)
    return {"errs": errs, "bitwise": {op: all(v) for op, v in same.items()}}


def tuned_tile_agreement_case(m: int, k: int, n: int) -> dict:
    """The overlapped GEMM+RS / GEMM+AR take one tile on every rank: each rank's `planned_tile` is
    replaced by a stand-in for its tuner cache (both ranks "tuned" to one tile; then only rank 0);
    returns the plan tile each call ran (a spy on fused._reducing_plan) and each result's error
    against float64 torch."""
    from ditron_ep.compiler.core_config import GemmTileConfig
    from ditron_ep.compiler.tp_plan import sequential_tile
    from ditron_ep.ops.tp import functional, fused

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    rule = sequential_tile("float32", "cpu", world * m, n)
    narrow = GemmTileConfig(rule.block_m, 16, rule.block_k, rule.num_warps, rule.num_stages)
    used: list = []
    real_plan = fused._reducing_plan

    def spy(*args):
        plan = real_plan(*args)
        used.append((str(plan.tile), plan.tile_source, plan.verified))
        return plan

    fused._reducing_plan = spy
    real_planned = functional.planned_tile
    out = {}
    try:
        for case, tuned_on in (("all tuned", range(world)), ("rank 0 tuned", (0,))):
            functional.planned_tile = lambda *a, _t=tuned_on: (narrow, "tuned") if rank in _t else real_planned(*a)
            a_rs = torch.randn(world * m, k, generator=g)
            b = torch.randn(k, n, generator=g)
            y = matmul_reduce_scatter(a_rs, b, schedule="overlap")
            want = matmul_reduce_scatter_ref(_gather_list(a_rs), _gather_list(b), rank)
            a_ar = torch.randn(m, k, generator=g)
            y_ar = matmul_all_reduce(a_ar, b, schedule="overlap")
            want_ar = matmul_all_reduce_ref(_gather_list(a_ar), _gather_list(b))
            out[case] = {"tiles": list(used), "err": max(_rel(y, want), _rel(y_ar, want_ar))}
            used.clear()
    finally:
        fused._reducing_plan = real_plan
        functional.planned_tile = real_planned
    out["rule"], out["narrow"] = str(rule), str(narrow)
    return out
