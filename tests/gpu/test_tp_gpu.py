"""Tensor-parallel GEMM + collective ops on CUDA ranks (bf16), under torchrun
(tests/gpu/run_gpu_suite.sh): each op and its gradients against float64 torch over every rank's
operands, bitwise run to run, GEMM+AR bitwise identical on every rank, and the TP MLP block
(replicated and sequence-parallel) against the unsharded block. Bodies record problems and
assert after their last collective (conftest.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ditron_ep  # noqa: F401
from ditron_ep.ops import (ColumnParallelLinear, RowParallelLinear, all_gather_matmul, matmul_all_reduce,
                           matmul_reduce_scatter)

TOL = 2e-2  # bf16 operands, fp32 accumulation


def _all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _rel(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("m, k, n", [(200, 512, 384), (64, 1024, 256)])
def test_tp_ops_match_float64_and_repeat_bitwise(dist_env, m, k, n):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(rank + 7)
    problems = []
    for op in ("ag", "rs", "ar"):
        rows = world * m if op == "rs" else m
        a = torch.randn(rows, k, generator=g, device=dev).to(torch.bfloat16)
        b = (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(torch.bfloat16)
        out_rows = world * m if op == "ag" else m
        gout = torch.randn(out_rows, n, generator=torch.Generator(device=dev).manual_seed(5 + (rank if op != "ar" else 0)),
                           device=dev).to(torch.bfloat16)
        fn = {"ag": all_gather_matmul, "rs": matmul_reduce_scatter, "ar": matmul_all_reduce}[op]
        runs = []
        for _ in range(2):
            la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
            y = fn(la, lb)
            (y.float() * gout.float()).sum().backward()
            runs.append((y.detach(), la.grad, lb.grad))
        if not all(torch.equal(x, z) for x, z in zip(*runs)):
            problems.append(f"{op}: a second call changed bits")
        a_all, b_all, g_all = _all(a), _all(b), _all(gout)
        ad = [t.double().requires_grad_() for t in a_all]
        bd = [t.double().requires_grad_() for t in b_all]
        if op == "ag":
            total = sum(((torch.cat(ad) @ bd[r]) * g_all[r].double()).sum() for r in range(world))
            want_y = torch.cat(ad).detach() @ bd[rank].detach()
        elif op == "rs":
            full = sum(x @ z for x, z in zip(ad, bd))
            total = (full * torch.cat(g_all).double()).sum()
            want_y = full.detach()[rank * m:(rank + 1) * m]
        else:
            full = sum(x @ z for x, z in zip(ad, bd))
            total = (full * gout.double()).sum()
            want_y = full.detach()
        total.backward()
        y, da, db = runs[0]
        for name, got, want in (("y", y, want_y), ("da", da, ad[rank].grad), ("db", db, bd[rank].grad)):
            if not _rel(got, want) < TOL:
                problems.append(f"{op} {name}: rel err {_rel(got, want):.2e}")
        if op == "ar" and not all(torch.equal(t, y) for t in _all(y)):
            problems.append("GEMM+AR: ranks differ")
    assert not problems, problems


@pytest.mark.parametrize("seq_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_tp_mlp_block_matches_the_unsharded_block(dist_env, seq_parallel):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(11)
    tokens, hidden, ffn = 256, 512, 1024
    fc1, fc2 = nn.Linear(hidden, ffn).to(dev), nn.Linear(ffn, hidden).to(dev)
    x = torch.randn(tokens, hidden, device=dev)
    gout = torch.randn(tokens, hidden, device=dev)
    col = ColumnParallelLinear.from_linear(fc1.to(torch.bfloat16), sequence_parallel=seq_parallel)
    row = RowParallelLinear.from_linear(fc2.to(torch.bfloat16), sequence_parallel=seq_parallel)
    rows = slice(rank * tokens // world, (rank + 1) * tokens // world)
    xin = (x[rows] if seq_parallel else x).to(torch.bfloat16).requires_grad_()
    y = row(torch.nn.functional.gelu(col(xin)))
    (y.float() * (gout[rows] if seq_parallel else gout)).sum().backward()
    f1, f2 = fc1.double(), fc2.double()
    ref_x = x.to(torch.bfloat16).double().requires_grad_()
    ref = f2(torch.nn.functional.gelu(f1(ref_x)))
    (ref * gout.double()).sum().backward()
    bias2 = row.bias.grad.float()
    if seq_parallel:
        bias2 = sum(_all(bias2))
    shard = slice(rank * ffn // world, (rank + 1) * ffn // world)
    errs = {"y": _rel(y, ref[rows] if seq_parallel else ref),
            "dx": _rel(xin.grad, ref_x.grad[rows] if seq_parallel else ref_x.grad),
            "dW1": _rel(col.weight.grad, f1.weight.grad[shard]), "dW2": _rel(row.weight.grad, f2.weight.grad[:, shard]),
            "db2": _rel(bias2, f2.bias.grad)}
    bad = {k: v for k, v in errs.items() if not v < TOL}
    assert not bad, errs


def _overlap_runs_vs_sequential(op, a, b, gout, **kw):
    """op(..., schedule=S) with the gradients of sum(y * gout), once sequential and twice overlapped
    (the second reuses the heap): (sequential's (outputs..., da, db), the indices of outputs in
    which an overlapped run differs from it, and the overlapped runs)."""
    outs = {}
    for schedule in ("sequential", "overlap", "overlap"):
        la, lb = a.clone().requires_grad_(), b.clone().requires_grad_()
        got = op(la, lb, schedule=schedule, **kw)
        got = got if isinstance(got, tuple) else (got,)
        (got[0].float() * gout.float()).sum().backward()
        outs.setdefault(schedule, []).append((*(t.detach() for t in got), la.grad, lb.grad))
    ref = outs["sequential"][0]
    differ = [i for run in outs["overlap"] for i, (x, z) in enumerate(zip(ref, run)) if not torch.equal(x, z)]
    return ref, differ, outs["overlap"]


@pytest.mark.parametrize("m, k, n", [(200, 512, 384), (1000, 1024, 768)])
def test_overlapped_all_gather_matmul_equals_sequential_bitwise(dist_env, m, k, n):
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(rank + 3)
    a = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    b = (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(torch.bfloat16)
    gout = torch.randn(dist.get_world_size() * m, n, generator=g, device=dev).to(torch.bfloat16)
    _, differ, _ = _overlap_runs_vs_sequential(all_gather_matmul, a, b, gout, return_gathered=True)
    assert not differ, f"overlap differs from sequential in outputs {differ} (y, gathered, da, db)"


@pytest.mark.parametrize("m, k, n", [(200, 512, 384), (1000, 1024, 768)])
def test_overlapped_matmul_reduce_scatter_equals_sequential_bitwise(dist_env, m, k, n):
    """bf16, M not a multiple of the tile (tiles span two shards): y and both gradients bit for
    bit, twice (the second call reuses the heap)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(rank + 5)
    a = torch.randn(world * m, k, generator=g, device=dev).to(torch.bfloat16)
    b = (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(torch.bfloat16)
    gout = torch.randn(m, n, generator=g, device=dev).to(torch.bfloat16)
    _, differ, _ = _overlap_runs_vs_sequential(matmul_reduce_scatter, a, b, gout)
    assert not differ, f"overlap differs from sequential in outputs {differ} (y, da, db)"


@pytest.mark.parametrize("m, k, n", [(128, 1024, 768), (1000, 512, 384)])
def test_overlapped_matmul_all_reduce_equals_sequential_bitwise(dist_env, m, k, n):
    """bf16, each rank its own K: y and both gradients bit for bit, twice; y the same on every rank."""
    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(rank + 7)
    kr = k + 64 * rank
    a = torch.randn(m, kr, generator=g, device=dev).to(torch.bfloat16)
    b = (torch.randn(kr, n, generator=g, device=dev) / kr ** 0.5).to(torch.bfloat16)
    gout = torch.randn(m, n, generator=torch.Generator(device=dev).manual_seed(11), device=dev).to(torch.bfloat16)
    ref, differ, overlapped = _overlap_runs_vs_sequential(matmul_all_reduce, a, b, gout)
    ys = [torch.empty_like(ref[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(ys, overlapped[0][0])  # before any assert: a rank that failed alone must not strand its peers
    assert not differ, f"overlap differs from sequential in outputs {differ} (y, da, db)"
    assert all(torch.equal(y, ys[0]) for y in ys), "the overlapped all-reduce differs between ranks"


def test_tp_ops_on_subgroups(dist_env):
    """The ranks split in two halves (single ranks at W=2, pairs at W=4), each half running the ops
    on its own group at the same time, fp32 ("ieee"): y and every gradient against float64 in the
    group's rank and row order, the overlapped schedule (a heap per group) bitwise the sequential
    one. The CPU twin: tests/ops/tp (emulated W=4)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("rank_fns_tp", Path(__file__).parents[1] / "ops" / "tp" / "rank_fns_tp.py")
    fns = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fns)
    rep = fns.subgroup_case(37, 96, 40, 4, device=dist_env.device)
    bad = {name: e for name, e in rep["errs"].items() if not e <= 2e-5}
    assert not bad and all(rep["bitwise"].values()), (dist.get_rank(), bad, rep["bitwise"])


@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
def test_tp_ops_captured_in_a_cuda_graph_replay_the_eager_bits(dist_env, schedule):
    """Each op (bf16, M off the tile grid) captured in a CUDA graph after one eager warm-up of its
    shapes, then replayed on fresh operands copied into the captured ones: every replay bitwise
    equal to an eager call on the same operands; the overlapped ops' heap reused across replays."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(rank + 13)
    m, k, n = 200, 512, 384
    problems = []
    for op, fn in (("ag", all_gather_matmul), ("rs", matmul_reduce_scatter), ("ar", matmul_all_reduce)):
        rows = world * m if op == "rs" else m

        def operands():
            return (torch.randn(rows, k, generator=g, device=dev).to(torch.bfloat16),
                    (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(torch.bfloat16))

        a, b = operands()
        fn(a, b, schedule=schedule)  # warm-up: builds the heap, initialises NCCL, compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = fn(a, b, schedule=schedule)
        for replay in range(2):
            na, nb = operands()
            a.copy_(na)
            b.copy_(nb)
            graph.replay()
            want = fn(na, nb, schedule=schedule)
            if not torch.equal(y, want):
                problems.append(f"{op} replay {replay}: differs from the eager call")
        del graph
    assert not problems, problems


def test_a_tuned_tile_keeps_the_bits_of_the_shape_rule(dist_env, monkeypatch):
    """A tuner-cache entry (one shared file, as a job's ranks read; a tile other than the shape
    rule's) drives `gemm.matmul` and the overlapped GEMM+RS / GEMM+AR: the sequential product is
    bitwise the rule tile's, and each overlapped op bitwise its sequential schedule, twice."""
    import os

    from ditron_ep.compiler import tuner
    from ditron_ep.compiler.tp_plan import planned_tile, sequential_tile
    from ditron_ep.ops.tp.gemm import matmul, matmul_with_tile

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    m, k, n = 200, 512, 384
    path = f"/tmp/ditron_tp_tune_test_{os.getppid()}.json"  # torchrun's agent: the same on every rank
    shapes = ((world * m, k, n), (m, k, n))  # GEMM+RS's product, GEMM+AR's
    tiles = {}
    for rows, kk, n_ in shapes:
        rule = sequential_tile("bfloat16", "cuda", rows, n_)
        tiles[rows] = next(c for c in tuner.tp_gemm_candidates(rule, 2) if c.block_n != rule.block_n)
    if rank == 0:
        cache = tuner.TuneCache(path)
        for rows, kk, n_ in shapes:
            cache.put(tuner.tp_gemm_key(torch.bfloat16, dev, rows=rows, k=kk, n=n_), {"gemm": ("portable", tiles[rows])})
    dist.barrier()
    monkeypatch.setenv(tuner.CACHE_ENV, path)
    problems = []
    g = torch.Generator(device=dev).manual_seed(rank + 13)
    for (rows, kk, n_), op in zip(shapes, (matmul_reduce_scatter, matmul_all_reduce)):
        if planned_tile("bfloat16", "cuda", rows, kk, n_) != (tiles[rows], "tuned"):
            problems.append(f"{rows}x{kk}x{n_}: the cache entry was not planned")
        a = torch.randn(rows, kk, generator=g, device=dev).to(torch.bfloat16)
        b = (torch.randn(kk, n_, generator=g, device=dev) / kk ** 0.5).to(torch.bfloat16)
        if not torch.equal(matmul(a, b), matmul_with_tile(a, b, sequential_tile("bfloat16", "cuda", rows, n_))):
            problems.append(f"{rows}x{kk}x{n_}: the tuned tile {tiles[rows]} changed the product's bits")
        gout = torch.randn(m, n_, generator=torch.Generator(device=dev).manual_seed(3), device=dev).to(torch.bfloat16)
        _, differ, _ = _overlap_runs_vs_sequential(op, a, b, gout)
        if differ:
            problems.append(f"{op.__name__}: overlap differs from sequential in outputs {differ} with the tuned tile")
    dist.barrier()
    if rank == 0:
        os.remove(path)
    assert not problems, problems
