"""Rank-side scenarios of the cross-rank agreement (runtime/agreement.py): one rank makes a
mistake, skips a call or arrives late; every rank's error and the seconds it took are recorded,
then a valid call on every rank must be right (no reset). Imported by name in the rank processes."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ditron_ep.check import make_routing


def _timed(res: dict, key: str, fn) -> None:
    """res[key] = "no error" or "<ErrorType>: message"; res[key + "_s"] = seconds taken."""
    t0 = time.monotonic()
    try:
        fn()
        res[key] = "no error"
    except Exception as err:  # noqa: BLE001 - the scenario records whatever every rank raised
        res[key] = f"{type(err).__name__}: {err}"
    res[key + "_s"] = time.monotonic() - t0


def _inputs(T: int, H: int, E: int, K: int, seed: int):
    """This rank's x [T, H] fp32, topk_idx [T, K], weights [T, K] (all ranks draw alike)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed * 31 + rank)
    idx, w = make_routing(T, E, K, "uniform", generator=g, num_ranks=dist.get_world_size())
    return torch.randn(T, H, generator=g), idx, w


def _weighted_sum(out, x, w) -> bool:
    return bool(torch.allclose(out, w.sum(dim=1, keepdim=True) * x, rtol=1e-6, atol=1e-6))


def buffer_scenarios() -> dict:
    """EPBuffer, default and graph mode: rank 1 passes x of another dtype or hidden size, expert
    ids out of range; rank 0 too many tokens; rank 1 skips a call (rank 0 times out, then rank 1
    arrives late); after each, a valid dispatch + combine on every rank."""
    from ditron_ep.ops import EPBuffer

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K, T = 2 * W, 32, 2, 6
    buf = EPBuffer(None, E, H, 8, K, torch.float32)
    x, idx, w = _inputs(T, H, E, K, 1)
    res: dict = {}

    def round_trip():
        recv_x, handle = buf.dispatch(x, idx, w)
        return _weighted_sum(buf.combine(recv_x, handle, w), x, w)

    res["first"] = round_trip()
    bad_idx = idx.clone()
    bad_idx[0, 0] = E + 1
    for key, args in (("dtype", (x.half(), idx, w)), ("shape", (torch.randn(T, H + 1), idx, w)),
                      ("expert_id", (x, bad_idx, w)), ("capacity", (torch.randn(9, H), idx[:1].repeat(9, 1), None))):
        mine = args if rank == (0 if key == "capacity" else 1) else (x, idx, w)
        _timed(res, key, lambda: buf.dispatch(*mine))
        res[key + "_after"] = round_trip()
    # graph mode: rank 1's own mistake raises there at once; rank 0's dispatch runs nothing, nor
    # does its combine along that handle (no call: the ranks stay in step), and its check()
    # raises; nobody waits
    def graph_step():
        recv_x, handle = buf.dispatch(x.half() if rank == 1 else x, idx, w, sync=False)
        buf.combine(recv_x, handle, w)

    _timed(res, "graph_dtype", graph_step)
    _timed(res, "graph_dtype_check", buf.check)
    res["graph_dtype_after"] = round_trip()
    # a skipped call: rank 0 calls alone and times out; rank 1 arrives late at that call
    budget = buf.heap.wait_budget
    if rank == 0:
        buf.heap.wait_budget = 3000
        _timed(res, "skipped", lambda: buf.dispatch(x, idx, w))
        buf.heap.wait_budget = budget
    dist.barrier()
    if rank == 1:
        _timed(res, "skipped", lambda: buf.dispatch(x, idx, w))
    res["skipped_after"] = round_trip()
    # under autograd no launch reads the error slot on its own (a host sync each): the backward
    # pass reads it once at its end, so a forward + backward of dispatch and combine reads it once
    reads, read_error = [], buf.heap.read_error
    buf.heap.read_error = lambda: (reads.append(1), read_error())[1]
    xg = x.clone().requires_grad_()
    recv_x, handle = buf.dispatch(xg, idx, w)
    (buf.combine(recv_x, handle, w) * x).sum().backward()
    res["reads_per_training_step"] = len(reads)
    res["training_grad_ok"] = bool(torch.allclose(xg.grad, w.sum(dim=1, keepdim=True) * x, rtol=1e-6, atol=1e-6))
    buf.heap.read_error = read_error
    # ... and a timeout inside a backward raises from backward(): rank 0 runs the backward of a
    # dispatch + combine (two barrier-opened launches: the combine's replay, then the dispatch's
    # combine) alone; its first launch times out, the second, holding that unread error, leaves
    # without waiting again; rank 1 arrives late at the first
    xg = x.clone().requires_grad_()
    recv_x, handle = buf.dispatch(xg, idx, w)
    loss = buf.combine(recv_x, handle, w).sum()
    if rank == 0:
        buf.heap.wait_budget = 3000
        _timed(res, "backward_skipped", loss.backward)
        buf.heap.wait_budget = budget
    dist.barrier()
    if rank == 1:
        _timed(res, "backward_skipped", loss.backward)
    res["backward_skipped_after"] = round_trip()
    res["calls"] = buf.heap.call_number
    buf.free()
    return res


def functional_scenarios() -> dict:
    """ops.dispatch and ops.moe (one buffer / layer per group): rank 1's first call is malformed;
    after a valid call rank 1 passes another hidden size (every rank raises at once, naming
    it); then every rank passes the new hidden size (one collective rebuild, right results)."""
    from ditron_ep.ops import clear_cache, clear_layers, combine, dispatch, moe
    from ditron_ep.ops.ep.functional import get_buffer

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, I, K, T = 2 * W, 32, 16, 2, 6
    res: dict = {}
    g = torch.Generator().manual_seed(70 + rank)

    def experts(h):
        return torch.randn(E // W, h, 2 * I, generator=g) / h ** 0.5, torch.randn(E // W, I, h, generator=g) / I ** 0.5

    def round_trip(h, seed=2):
        x, idx, w = _inputs(T, h, E, K, seed)
        recv_x, handle = dispatch(x, idx, w, num_experts=E)
        return _weighted_sum(combine(recv_x, handle, w, num_experts=E), x, w)

    x, idx, w = _inputs(T, H, E, K, 2)
    _timed(res, "dispatch_first_bad", lambda: dispatch(x[None] if rank == 1 else x, idx, num_experts=E))
    res["dispatch_first_after"] = round_trip(H)
    x48, idx48, _ = _inputs(T, 48, E, K, 3)
    _timed(res, "dispatch_hidden", lambda: dispatch(x48 if rank == 1 else x, idx48 if rank == 1 else idx,
                                                    num_experts=E))
    res["dispatch_hidden_after"] = round_trip(H)
    res["dispatch_all_new_hidden"] = round_trip(48, seed=4) and get_buffer().hidden == 48
    w1, w2 = experts(H)
    w1b, w2b = experts(48)
    with torch.no_grad():
        _timed(res, "moe_first_bad", lambda: moe(x, idx, w[:, 0] if rank == 1 else w, w1, w2))
        ref = moe(x, idx, w, w1, w2)
        _timed(res, "moe_hidden", lambda: moe(x48, idx48, w, w1b, w2b) if rank == 1 else moe(x, idx, w, w1, w2))
        res["moe_hidden_after"] = bool(torch.equal(moe(x, idx, w, w1, w2), ref))
    clear_layers()
    clear_cache()
    return res


def module_scenarios() -> dict:
    """EPMoE owns its layer: rank 1 passes x of the wrong hidden size (every rank raises at once);
    a second EPMoE of another hidden size in the same process never rebuilds the first one's
    buffers, so both train; FusedMoE called by rank 0 alone times out and rank 1, arriving late,
    raises DitronOutOfStepError; the next call on both is right."""
    from ditron_ep.ops import EPMoE, FusedMoE

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, I, K, T = 2 * W, 32, 16, 2, 6
    res: dict = {}
    torch.manual_seed(5)
    a, b = EPMoE(H, I, E, K), EPMoE(48, I, E, K)
    xa = torch.randn(T, H, generator=torch.Generator().manual_seed(rank))
    xb = torch.randn(T, 48, generator=torch.Generator().manual_seed(10 + rank))
    with torch.no_grad():
        first = a(xa)[0]
        _timed(res, "epmoe_hidden", lambda: a(xa[:, :-1] if rank == 1 else xa))
        res["epmoe_after"] = bool(torch.equal(a(xa)[0], first))
    out_a, out_b = a(xa)[0], b(xb)[0]  # both forwards, then both backwards
    (out_a.sum() + out_b.sum()).backward()
    res["two_layers_train"] = all(p.grad is not None and torch.isfinite(p.grad).all() for p in (a.w1, b.w1))
    a.free_buffers()
    b.free_buffers()

    x, idx, w = _inputs(T, H, E, K, 6)
    w1, w2 = torch.randn(E // W, H, 2 * I) / H ** 0.5, torch.randn(E // W, I, H) / I ** 0.5
    layer = FusedMoE(None, E, H, I, T, K, torch.float32)
    with torch.no_grad():
        ref = layer(x, idx, w, w1, w2)
        if rank == 0:
            budget, layer.heap.wait_budget = layer.heap.wait_budget, 3000
            _timed(res, "fused_skipped", lambda: layer(x, idx, w, w1, w2))
            layer.heap.wait_budget = budget
        dist.barrier()
        if rank == 1:
            _timed(res, "fused_skipped", lambda: layer(x, idx, w, w1, w2))
        res["fused_after"] = bool(torch.equal(layer(x, idx, w, w1, w2), ref))
    layer.free()
    return res


def non_member_scenarios() -> dict:
    """Rank 1 hands every entry point a group of rank 0 alone: it gets a DitronConfigError naming
    the group at once (rank 0, a member, runs its one-rank calls)."""
    from ditron_ep.ops import EPBuffer, FusedMoE, all_gather_matmul

    only0 = dist.new_group([0])  # collective: every rank makes it
    res: dict = {}
    for key, make in (("buffer", lambda: EPBuffer(only0, 4, 16, 8, 2, torch.float32)),
                      ("layer", lambda: FusedMoE(only0, 4, 16, 8, 8, 2, torch.float32)),
                      ("tp", lambda: all_gather_matmul(torch.randn(4, 8), torch.randn(8, 3), group=only0))):
        try:
            got = make()
            res[key] = "no error"
            if hasattr(got, "free"):
                got.free()
        except Exception as e:  # noqa: BLE001
            res[key] = f"{type(e).__name__}: {e}"
    return res
