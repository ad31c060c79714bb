"""Rank-side EP dispatch/combine checks (imported by name in emulated rank processes).

Every rank builds every rank's inputs from the same seeds, so the expected permutation and the
float64 oracle are computed locally with plain loops that share no code with the kernels.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ditron_ep.check import TOLERANCES, make_routing
from ditron_ep.ops import EPBuffer
from ditron_ep.ops.ep.buffer import quantize_fp8
from ditron_ep.ops.ep.naive import recv_order


def make_inputs(W: int, tokens: list[int], H: int, E: int, K: int, dtype: torch.dtype, kind: str,
                seed: int, drop_prob: float = 0.0):
    xs, idxs, ws = [], [], []
    for r in range(W):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        xs.append(torch.randn(tokens[r], H, generator=g).to(dtype))
        idx, w = make_routing(tokens[r], E, K, kind, generator=g, drop_prob=drop_prob, num_ranks=W)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def row_scale(e: int) -> float:
    # Expert "FFN" of the test: y = x * (1 + e / 8): exact in every dtype for small e, and
    # different per expert, so a row returned to the wrong (t, k) shows.
    return 1.0 + e / 8.0


def call_slices_expected(n_call: int, W: int, buf: EPBuffer) -> int:
    """Column slices the copy kernels should use for a call walking n_call of the buffer's chunks:
    those of a buffer of the call's size, when more than the buffer's and within its signal words."""
    from ditron_ep.language.task_queue import hidden_slices

    used = max(n_call, 1)
    want, _ = hidden_slices(used * buf.block_rows, W, buf.block_rows, buf.hidden, buf.block_hidden)
    if want <= buf.n_slices:
        return buf.n_slices
    cap = buf.n_chunks * buf.n_slices // used
    n_hb = -(-buf.hidden // buf.block_hidden)
    return -(-n_hb // -(-n_hb // min(want, cap)))


def stamped_words_ok(buf: EPBuffer, idxs, rank: int, W: int, E: int) -> dict:
    """After one dispatch + combine (the buffer's last two launches): the words each copy kernel
    stamped with its epoch are exactly (source, chunk < the chunks holding that pair's tokens,
    slice < the call's slices), at chunk_signal's index: dispatch's on the receiver, combine's on
    the tokens' owner."""
    e_local = E // W
    goes = [[int(((i >= 0) & (i // e_local == d)).any(1).sum()) for d in range(W)] for i in idxs]  # [src][dst]
    n_call = min(-(-max(i.shape[0] for i in idxs) // buf.block_rows), buf.n_chunks)
    n_sl = call_slices_expected(n_call, W, buf)
    per_rank = buf.n_chunks * buf.n_slices
    sig = buf.heap.signals.cpu()
    epoch = buf.heap.call_number  # the combine's; the dispatch data kernel's is one less
    out = {"n_sl": n_sl}
    for name, first, e, pairs in (("dispatch", buf._sig_dispatch, epoch - 1, [goes[s][rank] for s in range(W)]),
                                  ("combine", buf._sig_combine, epoch, [goes[rank][d] for d in range(W)])):
        ok = True
        for peer, n in enumerate(pairs):
            words = sig[first + peer * per_rank:first + (peer + 1) * per_rank]
            got = set((words == e).nonzero().flatten().tolist())
            want = {c * n_sl + j for c in range(-(-n // buf.block_rows)) for j in range(n_sl)}
            ok = ok and got == want
        out[name] = ok
    return out


def dispatch_combine_case(tokens: list[int], H: int, E: int, K: int, dtype: torch.dtype, kind: str,
                          seed: int = 0, drop_prob: float = 0.0, max_tokens: int | None = None,
                          num_programs: int | None = None, block_rows: int = 16, block_hidden: int | None = None,
                          hidden_slices: int | None = None) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, kind, seed, drop_prob)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    buf = EPBuffer(None, E, H, max_tokens or max(max(tokens), 1), K, dtype, num_programs=num_programs,
                   block_rows=block_rows, block_hidden=block_hidden, hidden_slices=hidden_slices)
    report: dict = {"n_slices": buf.n_slices}

    order = recv_order(idxs, rank, E)
    ref = torch.stack([xs[s][t] for s, t, _ in order]) if order else torch.empty(0, H, dtype=dtype)
    e_local = E // W
    counts = [sum(1 for s, t, k in order if int(idxs[s][t, k]) == e)
              for e in range(rank * e_local, (rank + 1) * e_local)]

    def run(sync: bool):
        recv_x, handle = buf.dispatch(x, idx, w, sync=sync)
        n = int(handle.expert_offsets[-1])
        scale = torch.tensor([row_scale(int(idxs[s][t, k])) for s, t, k in order] + [0.0] * (recv_x.shape[0] - n))
        y = (recv_x.to(torch.float32) * scale[:, None]).to(dtype)
        out = buf.combine(y, handle, w)
        return recv_x, handle, n, y, out

    recv_x, handle, n, y, out = run(True)
    report["stamped"] = stamped_words_ok(buf, idxs, rank, W, E)
    report["rows"] = (recv_x.shape[0], len(order))
    report["dispatch_exact"] = recv_x.shape[0] == len(order) and torch.equal(recv_x, ref)
    report["counts_ok"] = handle.num_recv_per_expert.tolist() == counts and handle.recv_counts == tuple(counts)
    report["offsets_ok"] = handle.expert_offsets.tolist() == [sum(counts[:i]) for i in range(e_local + 1)]
    report["recv_weights_ok"] = torch.equal(handle.recv_weights, torch.tensor(
        [float(ws[s][t, k]) for s, t, k in order], dtype=torch.float32))

    # float64 oracle of combine from the exact rows each expert rank produced
    ys = [None] * W
    dist.all_gather_object(ys, (order, y))
    exp = torch.zeros(tokens[rank], H, dtype=torch.float64)
    for s_rank, (order_d, y_d) in enumerate(ys):
        for row, (s, t, k) in enumerate(order_d):
            if s == rank:
                exp[t] += float(w[t, k]) * y_d[row].to(torch.float64)
    err = (out.to(torch.float64) - exp).abs()
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else TOLERANCES[dtype]
    report["combine_max_abs"] = float(err.max()) if err.numel() else 0.0
    report["combine_ok"] = bool((err <= atol + rtol * exp.abs()).all())

    # run-to-run and graph mode: bitwise identical
    recv_x2, _, _, _, out2 = run(True)
    report["rerun_bitwise"] = torch.equal(recv_x2, recv_x) and torch.equal(out2, out)
    report["out_bytes"] = out.contiguous().view(torch.uint8).flatten().tolist() if out.numel() else []
    recv_g, handle_g, n_g, _, out_g = run(False)
    report["counts_ok"] &= handle_g.recv_counts is None  # graph mode: no host read
    report["graph_rows_cap"] = recv_g.shape[0]
    report["graph_bitwise"] = n_g == n and torch.equal(recv_g[:n], recv_x) and torch.equal(out_g, out)
    buf.free()
    return report


def _nan_empty(empty):
    """torch.empty whose floating-point tensors come filled with NaN (a row a kernel leaves unwritten shows)."""
    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    return poisoned


def gradient_case(tokens: list[int], H: int, E: int, K: int, dtype: torch.dtype, kind: str, seed: int = 0,
                  sync: bool = True, block_hidden: int | None = None, hidden_slices: int | None = None,
                  poison: bool = False) -> dict:
    """d(sum(out * R)) / dx and / dw through dispatch -> per-expert scale -> combine, vs float64;
    poison: torch.empty fills floating-point tensors with NaN meanwhile."""
    empty = torch.empty
    if poison:
        torch.empty = _nan_empty(empty)
    try:
        return _gradient_case(tokens, H, E, K, dtype, kind, seed, sync, block_hidden, hidden_slices)
    finally:
        torch.empty = empty


def _gradient_case(tokens, H, E, K, dtype, kind, seed, sync, block_hidden, hidden_slices) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, kind, seed, drop_prob=0.1)
    buf = EPBuffer(None, E, H, max(max(tokens), 1), K, dtype, block_hidden=block_hidden, hidden_slices=hidden_slices)
    x = xs[rank].clone().requires_grad_(True)
    w = ws[rank].clone().requires_grad_(True)
    idx = idxs[rank]
    g = torch.Generator().manual_seed(seed + 77 + rank)
    upstream = torch.randn(tokens[rank], H, generator=g).to(dtype)
    order = recv_order(idxs, rank, E)
    recv_x, handle = buf.dispatch(x, idx, sync=sync)
    scale = torch.tensor([row_scale(int(idxs[s][t, k])) for s, t, k in order] + [0.0] * (recv_x.shape[0] - len(order)))
    y = recv_x * scale[:, None].to(dtype)
    out = buf.combine(y, handle, w)
    (out.to(torch.float32) * upstream.to(torch.float32)).sum().backward()

    # float64 oracle: out[t] = sum_k w[t,k] * x[t] * scale(e_k)
    x64 = xs[rank].to(torch.float64).requires_grad_(True)
    w64 = ws[rank].to(torch.float64).requires_grad_(True)
    valid = idx >= 0
    sc = torch.where(valid, 1.0 + idx.clamp(min=0).to(torch.float64) / 8.0, torch.zeros((), dtype=torch.float64))
    out64 = (w64 * sc).sum(dim=1, keepdim=True) * x64
    (out64 * upstream.to(torch.float64)).sum().backward()
    rtol, atol = TOLERANCES[dtype]
    rtol, atol = rtol * 4, atol * 4 * H  # gradients sum H (for w) or K (for x) rounded terms
    dx = (x.grad.to(torch.float64) - x64.grad).abs()
    dw = (w.grad.to(torch.float64) - w64.grad).abs()
    buf.free()
    return {
        "dx_max": float(dx.max()) if dx.numel() else 0.0, "dw_max": float(dw.max()) if dw.numel() else 0.0,
        "dx_ok": bool((dx <= atol + rtol * x64.grad.abs()).all()),
        "dw_ok": bool((dw <= atol + rtol * w64.grad.abs()).all()),
        "dw_dropped_zero": bool((w.grad[~valid] == 0).all()),
    }


def _recorder(res: dict):
    """catch(key, fn, exc=DitronConfigError): run fn and record under `key` "no error" or the
    expected exception as "<type>: <message>" (any other exception propagates)."""
    from ditron_ep.runtime import DitronConfigError

    def catch(key, fn, exc=DitronConfigError):
        try:
            fn()
            res[key] = "no error"
        except exc as err:
            res[key] = f"{type(err).__name__}: {err}"
    return catch


def _timed_recorder(res: dict):
    """timed(key, fn, exc=DitronConfigError): `_recorder`'s catch, and the seconds the call took
    recorded under key + "_s" (a refusal answers at once; a timeout takes its deadline)."""
    catch = _recorder(res)

    def timed(key, fn, *exc):
        t0 = time.monotonic()
        catch(key, fn, *exc)
        res[key + "_s"] = time.monotonic() - t0
    return timed


def _is_weighted_sum(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """A combine of identity experts: out[t] = sum_k w[t, k] * x[t], to fp32 rounding."""
    return bool(torch.allclose(out, w.sum(dim=1, keepdim=True) * x, rtol=1e-6, atol=1e-6))


def _functional_round_trip(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, E: int) -> bool:
    """ops.dispatch then ops.combine of the received rows unchanged: the weighted sum of x."""
    from ditron_ep.ops import combine, dispatch

    recv_x, handle = dispatch(x, idx, num_experts=E)
    return _is_weighted_sum(combine(recv_x, handle, w, num_experts=E), x, w)


def _refusal_operands(T: int, inputs_seed: int, weights_seed: int):
    """This rank's operands of a refusal case: 2 experts a rank, H=32, I=16, top-2, fp32, T tokens
    a rank, uniform routing. Returns (E, H, I, K, x, idx, w, w1, w2, g); g drew w1 and w2 and can
    draw more."""
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, I, K = 2 * W, 32, 16, 2
    xs, idxs, ws = make_inputs(W, [T] * W, H, E, K, torch.float32, "uniform", seed=inputs_seed)
    g = torch.Generator().manual_seed(weights_seed + rank)
    w1 = torch.randn(E // W, H, 2 * I, generator=g) / H ** 0.5
    w2 = torch.randn(E // W, I, H, generator=g) / I ** 0.5
    return E, H, I, K, xs[rank], idxs[rank], ws[rank], w1, w2, g


def error_cases() -> dict:
    """Bad input: clear errors on every rank before any token moves; graph mode records them."""
    from ditron_ep.ops import CapacityError, RoutingError
    from ditron_ep.runtime import DitronConfigError

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K = 4 * W, 32, 2
    buf = EPBuffer(None, E, H, 8, K, torch.float32)
    x = torch.randn(6, H)
    idx = torch.tensor([[0, 1]] * 6)
    res = {}
    catch = _recorder(res)

    bad_idx = idx.clone()
    if rank == 1:
        bad_idx[2, 1] = E + 3
    catch("bad_expert", lambda: buf.dispatch(x, bad_idx), RoutingError)
    big = torch.randn(12 if rank == 0 else 4, H)
    catch("too_many", lambda: buf.dispatch(big, torch.zeros(big.shape[0], K, dtype=torch.long)), CapacityError)
    # graph mode: recorded, offending slot dropped, raised by the next host-visible call
    recv_x, handle = buf.dispatch(x, bad_idx, sync=False)
    res["graph_rows_dropped"] = int(handle.expert_offsets[-1])
    catch("graph_then_check", buf.check, RoutingError)
    catch("after_check_clean", buf.check, RoutingError)
    catch("hidden", lambda: buf.dispatch(torch.randn(6, H + 1), idx), DitronConfigError)
    catch("dtype", lambda: buf.dispatch(x.to(torch.float16), idx), DitronConfigError)
    catch("topk_shape", lambda: buf.dispatch(x, idx[:, :1]), DitronConfigError)
    catch("idx_dtype", lambda: buf.dispatch(x, idx.float()), DitronConfigError)
    catch("non_contig", lambda: buf.dispatch(torch.randn(H, 6).t(), idx), DitronConfigError)
    recv_x, handle = buf.dispatch(x, idx)
    catch("y_rows", lambda: buf.combine(torch.zeros(recv_x.shape[0] + 1, H), handle), DitronConfigError)
    catch("bad_handle", lambda: buf.combine(recv_x, object()), DitronConfigError)
    catch("experts_not_multiple", lambda: EPBuffer(None, E + 1, H, 8, K, torch.float32), DitronConfigError)
    catch("block_hidden", lambda: EPBuffer(None, E, H, 8, K, torch.float32, block_hidden=48), DitronConfigError)
    catch("num_warps", lambda: EPBuffer(None, E, H, 8, K, torch.float32, num_warps=3), DitronConfigError)
    # a bad argument on one rank only: every rank raises (none is left waiting in a collective)
    catch("one_rank_bad", lambda: EPBuffer(None, E, H, 8, K, torch.float32, block_hidden=24 if rank == 1 else 16),
          DitronConfigError)
    catch("one_rank_bad_slices", lambda: EPBuffer(None, E, H, 8, K, torch.float32,
                                                  hidden_slices=0 if rank == 0 else None), DitronConfigError)
    buf.free()
    return res


def no_collectives_case() -> dict:
    """After set-up, dispatch and combine must not call any torch.distributed collective."""
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K = 2 * W, 48, 2
    buf = EPBuffer(None, E, H, 10, K, torch.float32)
    xs, idxs, ws = make_inputs(W, [10] * W, H, E, K, torch.float32, "uniform", seed=5)
    names = ["all_to_all_single", "all_to_all", "all_gather", "all_gather_object", "all_reduce", "broadcast",
             "broadcast_object_list", "send", "recv", "isend", "irecv", "reduce_scatter", "gather",
             "scatter", "barrier", "all_gather_into_tensor", "reduce_scatter_tensor"]
    saved = {n: getattr(dist, n) for n in names}

    def forbidden(*a, **k):
        raise AssertionError("a torch.distributed collective was called during dispatch/combine")

    try:
        for n in names:
            setattr(dist, n, forbidden)
        recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        out = buf.combine(recv_x, handle, ws[rank])
        recv_g, handle_g = buf.dispatch(xs[rank], idxs[rank], sync=False)
        out_g = buf.combine(recv_g, handle_g, ws[rank])
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    ok = torch.equal(out, out_g)
    buf.free()
    return {"ok": ok}


def functional_regrow_case() -> dict:
    """Functional wrappers: cached buffer sized at first use, regrown when a call exceeds it."""
    from ditron_ep.ops import clear_cache, combine, dispatch, get_buffer

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K = 2 * W, 32, 2
    res = {}
    for call, T in enumerate([3, 5, 40]):  # the third exceeds the first size
        tokens = [T if r == 0 else 2 for r in range(W)]
        xs, idxs, ws = make_inputs(W, tokens, H, E, K, torch.float32, "uniform", seed=call)
        recv_x, handle = dispatch(xs[rank], idxs[rank], num_experts=E)
        out = combine(recv_x, handle, ws[rank], num_experts=E)
        exp = (ws[rank].sum(dim=1, keepdim=True) * xs[rank])  # y = x for every expert
        res[call] = (get_buffer().max_tokens,
                     bool(torch.allclose(out, exp, rtol=1e-6, atol=1e-6)))
    clear_cache()
    return res


def tiling_mismatch_case() -> str:
    """Ranks asking for different column tilings (block_hidden) with the same slice count: the
    signal counts agree, so only the tiling check can stop a silent column mix-up."""
    from ditron_ep.runtime import DitronConfigError
    rank = dist.get_rank()
    try:
        EPBuffer(None, 4, 48, 8, 2, torch.float32, block_hidden=16 if rank == 0 else 32, hidden_slices=2)
    except DitronConfigError as e:
        return f"DitronConfigError: {e}"
    return "no error"


def layout_halves_case(W: int, E: int, K: int, calls: int, seed: int = 0) -> dict:
    """Back-to-back counts exchanges, a different routing each. First `calls` in lock step (a
    barrier after each): call number c lands in half c % 2 of the landing buffer and leaves the
    other half as it was. Then `calls` more with the ranks skewed by random sleeps and no barrier (a
    rank may run an exchange ahead): every receive layout must still be its own call's."""
    import random
    import time

    rank = dist.get_rank()
    e_local = E // W
    T = 12
    buf = EPBuffer(None, E, 32, T, K, torch.float32)
    landing = buf.heap.local_view("ep/layout")  # [2, W, E_local + LAYOUT_EXTRA] int32
    landing.fill_(-7)
    dist.barrier()
    rng = random.Random(seed * 100 + rank)
    rep = {"recv_ok": [], "halves_ok": [], "seq": []}
    previous = torch.full_like(landing[0], -7)
    for n in range(2 * calls):
        lock_step = n < calls
        idxs = [make_routing(T, E, K, "zipf" if (n + s) % 2 else "uniform",
                             generator=torch.Generator().manual_seed(seed * 1000 + n * 10 + s), num_ranks=W)[0]
                for s in range(W)]
        if not lock_step:
            time.sleep(rng.random() * 0.05)
        send, recv = buf._launch_layout(idxs[rank])
        counts = torch.stack([torch.bincount(i[i >= 0].reshape(-1), minlength=E)[rank * e_local:(rank + 1) * e_local]
                              for i in idxs]).to(torch.int32)  # [source, local expert]
        rep["recv_ok"].append(torch.equal(recv.num_recv.cpu(), counts.sum(0).to(torch.int32))
                              and torch.equal(recv.src_off.cpu(), (counts.cumsum(0) - counts).to(torch.int32)))
        if lock_step:
            dist.barrier()  # every rank's exchange n has finished: no write of exchange n + 1 yet
            rep["halves_ok"].append(torch.equal(landing[(n + 1) % 2, :, :e_local], counts)
                                    and torch.equal(landing[n % 2], previous))
            previous = landing[(n + 1) % 2].clone()
            dist.barrier()
        rep["seq"].append(buf.heap.call_number)
    buf.free()
    return rep


class _RerunGraph:
    """Stands in for a CUDA graph on the CPU: `replay()` reruns the captured launches."""

    def __init__(self, launches) -> None:
        self.launches = launches
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.launches()


class _DoneEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:  # CPU kernels have finished when they return
        pass


def _cpu_capture_layout(buf: EPBuffer, rows: int, dtype: torch.dtype, lent: bool = False):
    """EPBuffer._capture_layout for the CPU: the buffer's own static tensors and launch sequence
    (`_layout_statics`, `_layout_launches`), with a "graph" that reruns that sequence on every
    replay. Nothing runs at capture, as with a CUDA graph (ranks may capture on different calls)."""
    c = buf._layout_statics(rows, dtype, lent)
    c.topk_idx.fill_(E_POISON)  # poison: the routing rows past a call's must be set to -1 by the replay
    c.arena.flat.fill_(-12345)  # poison: a layout word the launches do not write shows

    def launches() -> None:
        # a CUDA graph's layout objects are made once, at capture; the rerun makes new views of
        # the same arena words (the same allocations in the same order): keep the first ones
        first = (c.send, c.recv)
        buf._layout_launches(c)
        if first[0] is not None:
            c.send, c.recv = first

    c.graph = _RerunGraph(launches)
    c.ready = _DoneEvent()
    return c


def replayed_layout_case(tokens: list[int], H: int, E: int, K: int, calls: int, seed: int = 0,
                         reuse: bool = True) -> dict:
    """A buffer replaying its layout (graph_cache, with the CPU stand-in for the graph) against
    one launching directly: `calls` dispatches per mode with fresh routings (the same T), every
    handle kept and combined only after all of them (a replay must not rewrite an earlier call's
    layout); graph mode (sync=False) never replays. Then a replayed call with a bad expert id on
    rank 0 raises on every rank, and so does `check()` after a graph-mode call with one."""
    from ditron_ep.ops.ep.buffer import RoutingError

    rank, W = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32
    direct = EPBuffer(None, E, H, max(tokens), K, dtype, graph_cache=0)
    cached = EPBuffer(None, E, H, max(tokens), K, dtype, graph_cache=2)
    cached._can_capture = lambda: True
    cached._capture_layout = lambda rows, dtype, lent=False: _cpu_capture_layout(cached, rows, dtype, lent)
    report = {"same": [], "replays": 0}
    for sync in (True, False):
        runs = {"direct": [], "cached": []}
        for i in range(calls):
            xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, "uniform", seed * 100 + i + 50 * sync)
            for name, buf in (("direct", direct), ("cached", cached)):
                recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank], sync=sync)
                runs[name].append((recv_x.clone(), handle, ws[rank]))
        for (rx_d, h_d, w), (rx_c, h_c, _) in zip(runs["direct"], runs["cached"]):
            out_d = direct.combine(rx_d * 1.5, h_d, w)
            out_c = cached.combine(rx_c * 1.5, h_c, w)
            n = int(h_d.expert_offsets[-1])  # graph mode: rows past the valid extent are unwritten
            report["same"].append(torch.equal(rx_d[:n], rx_c[:n]) and torch.equal(out_d, out_c)
                                  and torch.equal(h_d.expert_offsets, h_c.expert_offsets)
                                  and torch.equal(h_d.send.slot, h_c.send.slot))
    report["captured"] = len(cached._layouts)
    report["replays"] = sum(c.replays for c in cached._layouts._entries.values())
    # Handles dropped after their combine give their captured copy back: the loop replays one
    # copy. A view taken of a handle's layout holds its copy after the handle is gone: that
    # copy is not replayed over (the view keeps its values).
    entry = next(iter(cached._layouts._entries.values()))
    report["copies"] = len(entry.copies)
    report["shared_copy"] = entry.shared is not None
    report["reuse_same"], kept, used = [], None, []
    for i in range(4 if reuse else 0):
        xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, "uniform", seed * 100 + 70 + i)
        rx_d, h_d = direct.dispatch(xs[rank], idxs[rank], ws[rank])
        rx_c, h_c = cached.dispatch(xs[rank], idxs[rank], ws[rank])
        report["reuse_same"].append(torch.equal(rx_d, rx_c) and torch.equal(
            direct.combine(rx_d, h_d, ws[rank]), cached.combine(rx_c, h_c, ws[rank])))
        used.append(next(j for j, c in enumerate(entry.copies)  # the copy whose arena holds the call's layout
                         if c.arena.flat.untyped_storage().data_ptr() == h_c.send.slot.untyped_storage().data_ptr()))
        if i == 0:
            view = h_c.expert_offsets[1:]
            kept = (view, view.clone())
        del rx_d, h_d, rx_c, h_c
    report["copies_after_reuse"] = len(entry.copies)
    report["copies_used"] = used
    if reuse:
        report["kept_view_intact"] = torch.equal(*kept)
        del kept, view
    # token-major default mode launches its data kernel before the host read of the status,
    # which a replayed layout gives from its copy (with its event)
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, "uniform", seed + 998)
    tok_d, _ = direct.dispatch(xs[rank], idxs[rank], ws[rank], layout="token_major")
    tok_c, _ = cached.dispatch(xs[rank], idxs[rank], ws[rank], layout="token_major")
    report["token_major_same"] = torch.equal(tok_d, tok_c)
    del tok_d, tok_c
    report["replays_before_bad"] = sum(c.replays for c in cached._layouts._entries.values())
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, "uniform", seed + 999)
    if rank == 0 and tokens[0]:
        idxs[0][0, 0] = E + 3
    try:
        cached.dispatch(xs[rank], idxs[rank], ws[rank])
        report["bad"] = "no error"
    except RoutingError as err:
        report["bad"] = f"RoutingError: {err}"
    try:  # ... and raises there, after its (empty) kernel
        cached.dispatch(xs[rank], idxs[rank], ws[rank], layout="token_major")
        report["bad_token_major"] = "no error"
    except RoutingError as err:
        report["bad_token_major"] = f"RoutingError: {err}"
    report["replays_after_bad"] = sum(c.replays for c in cached._layouts._entries.values())
    cached.dispatch(xs[rank], idxs[rank], ws[rank], sync=False)
    try:
        cached.check()
        report["bad_graph_mode"] = "no error"
    except RoutingError as err:
        report["bad_graph_mode"] = f"RoutingError: {err}"
    report["replays_after_graph_mode"] = sum(c.replays for c in cached._layouts._entries.values())
    direct.free()
    cached.free()
    return report


E_POISON = 1 << 20  # an expert id no buffer has: routed rows left in a captured layout would flag it


def varying_tokens_replay_case(calls: list[list[int]], H: int, E: int, K: int, max_tokens: int) -> dict:
    """Default-mode dispatches whose token count changes from call to call (calls[i][rank]) on a
    buffer replaying its layout (the CPU stand-in for the CUDA graph) against one launching
    directly: a call replays the capture of layout_rows(T) routing rows with the rows past its
    own routed nowhere, so its rows, handle and combine are the direct call's bit for bit, in
    both layouts, while the token count shrinks and grows within a capture's rows."""
    from ditron_ep.ops.ep.layout_replay import layout_rows

    rank, W = dist.get_rank(), dist.get_world_size()
    dtype = torch.float32
    direct = EPBuffer(None, E, H, max_tokens, K, dtype, graph_cache=0)
    cached = EPBuffer(None, E, H, max_tokens, K, dtype, graph_cache=4)
    cached._can_capture = lambda: True
    cached._capture_layout = lambda rows, dt, lent=False: _cpu_capture_layout(cached, rows, dt, lent)
    report = {"same": [], "rows": sorted({layout_rows(c[rank], max_tokens) for c in calls})}
    for i, tokens in enumerate(calls):
        xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, "uniform", 700 + i)
        token_major = i % 3 == 2
        layout = "token_major" if token_major else "expert_major"
        rx_d, h_d = direct.dispatch(xs[rank], idxs[rank], ws[rank], layout=layout)
        rx_c, h_c = cached.dispatch(xs[rank], idxs[rank], ws[rank], layout=layout)
        y_d = rx_d[h_d.row_index] if token_major else rx_d
        y_c = rx_c[h_c.row_index] if token_major else rx_c
        same = (torch.equal(rx_d, rx_c) and torch.equal(h_d.expert_offsets, h_c.expert_offsets)
                and torch.equal(h_d.send.slot, h_c.send.slot) and torch.equal(h_d.send.topk_idx, h_c.send.topk_idx)
                and torch.equal(direct.combine(y_d * 1.5, h_d, ws[rank]), cached.combine(y_c * 1.5, h_c, ws[rank])))
        report["same"].append(same)
    report["captured"] = sorted(key[0] for key in cached._layouts._entries)
    report["replays"] = sum(c.replays for c in cached._layouts._entries.values())
    direct.free()
    cached.free()
    return report


def api_misuse_cases() -> dict:
    """Misuse found by probing the public API: each must give a clear error on every rank (or
    reach the user), never garbage or a swallowed problem."""
    from ditron_ep.ops import CapacityError, clear_cache, clear_layers, combine, dispatch, moe
    from ditron_ep.ops.ep import functional as F
    from ditron_ep.ops.moe_layer.functional import _group_slots
    from ditron_ep.ops.moe_layer.fused import FusedMoE

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K = 2 * W, 32, 2
    res: dict = {}
    catch = _recorder(res)

    # constructor arguments that must match on every rank: named, on every rank
    catch("hidden_differs", lambda: EPBuffer(None, E, H if rank == 0 else 2 * H, 8, K, torch.float32))
    catch("fused_topk_differs", lambda: FusedMoE(None, E, H, 16, 8, K if rank == 0 else 1, torch.float32))
    # bf16 GEMMs are wrong under the interpreter: refused instead of returning garbage
    catch("fused_bf16", lambda: FusedMoE(None, E, H, 16, 8, K, torch.bfloat16))
    # a bad argument on one rank only (default mode): that rank raises its reason, every peer a
    # DitronConfigError naming it at once (not a timeout in the counts exchange); then a valid
    # call on every rank works (the ranks stayed in step)
    buf = EPBuffer(None, E, H, 8, K, torch.float32)
    xs, idxs, ws = make_inputs(W, [5] * W, H, E, K, torch.float32, "uniform", seed=2)
    bad_x = torch.randn(5, H + 1) if rank == 1 else xs[rank]
    t0 = time.monotonic()
    catch("one_rank_bad_call", lambda: buf.dispatch(bad_x, idxs[rank], ws[rank]))
    res["one_rank_bad_call_s"] = time.monotonic() - t0
    recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    out = buf.combine(recv_x, handle, ws[rank])  # y = x for every expert
    res["in_step_after"] = _is_weighted_sum(out, xs[rank], ws[rank])
    # the same for combine, whose launch enters through a barrier: the rank with a bad y takes part
    # in it flagged, so its peer raises a DitronConfigError naming it at once, and both stay in step
    recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    bad_y = recv_x.double() if rank == 1 else recv_x
    t0 = time.monotonic()
    catch("one_rank_bad_combine", lambda: buf.combine(bad_y, handle, ws[rank]))
    res["one_rank_bad_combine_s"] = time.monotonic() - t0
    recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    out = buf.combine(recv_x, handle, ws[rank])
    res["in_step_after_combine"] = _is_weighted_sum(out, xs[rank], ws[rank])
    # a heap restarted just below the int32 wrap-around takes calls across call number 0 with
    # no false stop
    buf.heap.reset(call=-4)
    across = []
    for _ in range(3):  # a dispatch and a combine are a call each: calls -3 .. 2
        recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
        out = buf.combine(recv_x, handle, ws[rank])
        across.append(_is_weighted_sum(out, xs[rank], ws[rank]))
    res["across_wrap"] = all(across) and buf.heap.call_number == 2
    # a refusal its peer does not read at once (check_errors=False): the peer's combine returns
    # (its output unwritten), and the next dispatch raises on every rank (the peer's record
    # carries FLAG_UNREAD), before moving anything;
    # the call after that is right on both (the ranks stayed in step)
    lax = EPBuffer(None, E, H, 8, K, torch.float32, check_errors=False)
    recv_x, handle = lax.dispatch(xs[rank], idxs[rank], ws[rank])
    catch("lax_bad_combine", lambda: lax.combine(recv_x.double() if rank == 1 else recv_x, handle, ws[rank]))
    catch("lax_next_dispatch", lambda: lax.dispatch(xs[rank], idxs[rank], ws[rank]))
    recv_x, handle = lax.dispatch(xs[rank], idxs[rank], ws[rank])
    out = lax.combine(recv_x, handle, ws[rank])
    res["lax_in_step_after"] = _is_weighted_sum(out, xs[rank], ws[rank])
    lax.free()
    # graph mode: different problems of two ranks in one call are both kept (the flags are bit
    # sets, OR-ed), and check() raises them one at a time
    from ditron_ep.ops import RoutingError
    g_buf = EPBuffer(None, E, H, 8, K, torch.float32)
    gx, gi, _ = make_inputs(W, [5] + [10] * (W - 1), H, E, K, torch.float32, "uniform", seed=6)
    g_idx = gi[rank].clone()
    if rank == 0:
        g_idx[0, 0] = E + 3
    g_buf.dispatch(gx[rank], g_idx, sync=False)
    for key in ("pending_first", "pending_second", "pending_third"):
        catch(key, g_buf.check, (CapacityError, RoutingError))
    g_buf.free()
    # a freed buffer
    buf.free()
    catch("after_free", lambda: buf.dispatch(torch.randn(4, H), torch.zeros(4, K, dtype=torch.long)))

    # a graph-mode call over capacity: the functional API must not swallow the recorded problem
    xs, idxs, ws = make_inputs(W, [4] * W, H, E, K, torch.float32, "uniform", seed=3)
    dispatch(xs[rank], idxs[rank], num_experts=E)  # the cached buffer: 4 tokens
    big_x, big_i, big_w = make_inputs(W, [12] * W, H, E, K, torch.float32, "uniform", seed=4)
    dispatch(big_x[rank], big_i[rank], num_experts=E, sync=False)
    catch("pending_capacity", lambda: dispatch(xs[rank], idxs[rank], num_experts=E), CapacityError)
    res["max_tokens_after"] = F.get_buffer().max_tokens
    # the functional combine names what is wrong with y, not the cache lookup
    recv_x, handle = dispatch(xs[rank], idxs[rank], num_experts=E)
    catch("combine_bad_y", lambda: combine(torch.zeros(recv_x.shape[0], H // 2), handle, ws[rank], num_experts=E))
    # a num_experts that does not match the handle's buffer on one rank: it refuses through that
    # buffer, so its peer raises at once; then both combine along the handle
    t0 = time.monotonic()
    catch("functional_one_rank_bad_E", lambda: combine(recv_x, handle, ws[rank], num_experts=E + (W if rank else 0)))
    res["functional_one_rank_bad_E_s"] = time.monotonic() - t0
    out = combine(recv_x, handle, ws[rank], num_experts=E)
    res["functional_in_step_after"] = _is_weighted_sum(out, xs[rank], ws[rank])
    catch("dispatch_1d_idx", lambda: dispatch(xs[rank], idxs[rank][:, 0].contiguous(), num_experts=E))
    clear_cache()

    # moe: missing weights, and the staged schedule refusing bad weights before dispatching
    e_local = E // W
    w1 = torch.randn(e_local, H, 32) / H ** 0.5
    w2 = torch.randn(e_local, 16, H) / 4.0
    with torch.no_grad():
        catch("moe_no_weights", lambda: moe(xs[rank], idxs[rank], None, w1, w2))
        catch("staged_bad_w1", lambda: moe(xs[rank], idxs[rank], ws[rank], w1.half(), w2, schedule="staged"))
        res["staged_dispatched"] = int(_group_slots(None).buffer.buffer is not None)
        # bad weights on one rank only: its peer, about to dispatch, raises at once, naming it
        first = moe(xs[rank], idxs[rank], ws[rank], w1, w2, schedule="staged")
        t0 = time.monotonic()
        catch("staged_one_rank_bad", lambda: moe(xs[rank], idxs[rank], ws[rank], w1.half() if rank == 1 else w1, w2,
                                                 schedule="staged"))
        res["staged_one_rank_bad_s"] = time.monotonic() - t0
        res["staged_in_step_after"] = bool(torch.equal(moe(xs[rank], idxs[rank], ws[rank], w1, w2, schedule="staged"),
                                                       first))
    clear_layers()
    clear_cache()
    return res


def two_refusers_combine_case() -> dict:
    """Three ranks; ranks 1 and 2 reject their y in the same combine: rank 0 raises at once,
    naming rank 1 and one other rank; the next call is right on every rank."""
    from ditron_ep.runtime import DitronConfigError

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K = 2 * W, 32, 2
    res: dict = {}
    catch = _recorder(res)
    buf = EPBuffer(None, E, H, 8, K, torch.float32)
    xs, idxs, ws = make_inputs(W, [5] * W, H, E, K, torch.float32, "uniform", seed=4)
    recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    catch("combine", lambda: buf.combine(recv_x.double() if rank > 0 else recv_x, handle, ws[rank]), DitronConfigError)
    recv_x, handle = buf.dispatch(xs[rank], idxs[rank], ws[rank])
    out = buf.combine(recv_x, handle, ws[rank])
    res["after"] = _is_weighted_sum(out, xs[rank], ws[rank])
    buf.free()
    return res


def max_recv_rows_case() -> dict:
    """Graph mode with max_recv_rows: a cap at or above the rows received gives the default
    mode's rows and offsets bit for bit in a recv_x of the cap's size, and combine's output; a cap
    below drops the rows past it (offsets stop there), and the next sync call raises
    CapacityError on every rank (the overflow was one rank's); the call after is right."""
    from ditron_ep.ops import CapacityError
    from ditron_ep.runtime import DitronConfigError

    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K = 2 * W, 24, 2
    buf = EPBuffer(None, E, H, 10, K, torch.float32)
    xs, idxs, ws = make_inputs(W, [9, 4] + [5] * (W - 2), H, E, K, torch.float32, "one_rank", seed=3)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    ref_x, ref_h = buf.dispatch(x, idx, w)
    ref_out = buf.combine(ref_x, ref_h, w)
    rows = [int(r) for r in torch.tensor([ref_h.num_rows])]
    res: dict = {"rows": rows[0]}
    cap = 30
    got_x, got_h = buf.dispatch(x, idx, w, sync=False, max_recv_rows=cap)
    n = ref_h.num_rows
    res["fits"] = (got_x.shape[0] == cap and torch.equal(got_x[:n], ref_x)
                   and torch.equal(got_h.expert_offsets, ref_h.expert_offsets)
                   and torch.equal(buf.combine(got_x, got_h, w), ref_out)) if n <= cap else None
    small = 3
    cut_x, cut_h = buf.dispatch(x, idx, w, sync=False, max_recv_rows=small)
    res["cut_offsets"] = cut_h.expert_offsets.tolist()
    res["cut_rows_kept"] = bool(torch.equal(cut_x[:min(n, small)], ref_x[:min(n, small)]))
    try:
        buf.dispatch(x, idx, w)
        res["next_sync"] = "no error"
    except (CapacityError, DitronConfigError) as err:
        res["next_sync"] = f"{type(err).__name__}: {err}"
    res["after"] = bool(torch.equal(buf.combine(*buf.dispatch(x, idx, w), w), ref_out))
    try:
        buf.dispatch(x, idx, w, max_recv_rows=5)
        res["sync_cap"] = "no error"
    except Exception as err:  # noqa: BLE001
        res["sync_cap"] = f"{type(err).__name__}: {err}"
    buf.free()
    return res


def cast_like_kernels(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t (fp32) cast to dtype as the kernels cast: round to nearest even, except fp32 -> bf16 under
    the Triton interpreter, which truncates (compiled kernels round to nearest even)."""
    from ditron_ep.runtime import kernels_interpreted
    if dtype == torch.bfloat16 and t.dtype == torch.float32 and kernels_interpreted():
        return (t.contiguous().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def rank_reduced_case(tokens: list[int], H: int, E: int, K: int, dtype: torch.dtype, kind: str, seed: int,
                      drop_prob: float, partial_dtype: torch.dtype | None, weighted: bool,
                      num_programs: int | None = None, block_rows: int = 16, block_hidden: int | None = None) -> dict:
    """combine(topk_sum="expert_rank") against (1) its sequential schedule written with torch ops
    (each expert rank's k-ordered fp32 sum, cast to the partial dtype; the token rank's rank-ordered
    fp32 sum, cast once), bit for bit; (2) the float64 oracle; (3) itself, run twice and in graph
    mode; (4) the gradient of y against its formula, bit for bit."""
    rank, W = dist.get_rank(), dist.get_world_size()
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, kind, seed, drop_prob)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    buf = EPBuffer(None, E, H, max(max(tokens), 1), K, dtype, num_programs=num_programs, block_rows=block_rows,
                   block_hidden=block_hidden)
    order = recv_order(idxs, rank, E)
    part_dt = partial_dtype or dtype
    report: dict = {}

    def run(sync: bool, y_grad: bool = False):
        recv_x, handle = buf.dispatch(x, idx, w if weighted else None, sync=sync)
        n = len(order)
        scale = torch.tensor([row_scale(int(idxs[s][t, k])) for s, t, k in order] + [0.0] * (recv_x.shape[0] - n))
        y = (recv_x.to(torch.float32) * scale[:, None]).to(dtype).requires_grad_(y_grad)
        out = buf.combine(y, handle, topk_sum="expert_rank", partial_dtype=partial_dtype)
        return y, handle, out

    y, handle, out = run(True)
    # the sequential schedule, stage by stage: partial sums on this (expert) rank ...
    terms: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for row, (s, t, k) in enumerate(order):  # rows are expert-major: collect, then add in k order
        terms.setdefault((s, t), {})[k] = y[row].to(torch.float32) * (float(ws[s][t, k]) if weighted else 1.0)
    partials = {}
    for key, by_k in terms.items():
        acc = torch.zeros(H, dtype=torch.float32)
        for k in sorted(by_k):
            acc = acc + by_k[k]
        partials[key] = cast_like_kernels(acc, part_dt)
    gathered = [None] * W
    dist.all_gather_object(gathered, partials)
    # ... then the token rank adds each rank's partial in rank order
    seq = torch.zeros(tokens[rank], H, dtype=torch.float32)
    for t in range(tokens[rank]):
        acc = torch.zeros(H, dtype=torch.float32)
        for r in range(W):
            p = gathered[r].get((rank, t))
            if p is not None:
                acc = acc + p.to(torch.float32)
        seq[t] = acc
    seq = cast_like_kernels(seq, dtype)
    report["sequential_bitwise"] = torch.equal(out, seq)
    report["sequential_max_abs"] = float((out.float() - seq.float()).abs().max()) if out.numel() else 0.0
    # float64 oracle
    exp = torch.zeros(tokens[rank], H, dtype=torch.float64)
    ys = [None] * W
    dist.all_gather_object(ys, (order, y.detach()))
    for order_d, y_d in ys:
        for row, (s, t, k) in enumerate(order_d):
            if s == rank:
                exp[t] += (float(w[t, k]) if weighted else 1.0) * y_d[row].to(torch.float64)
    err = (out.to(torch.float64) - exp).abs()
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else TOLERANCES[dtype]
    report["oracle_max_abs"] = float(err.max()) if err.numel() else 0.0
    report["oracle_ok"] = bool((err <= 2 * (atol + rtol * exp.abs())).all())
    _, _, out2 = run(True)
    _, handle_g, out_g = run(False)
    report["rerun_bitwise"] = torch.equal(out2, out)
    report["graph_bitwise"] = torch.equal(out_g, out)
    # the gradient of y: row (s, t, k) gets w[t, k] * g[t] (fp32, one rounding), g the upstream
    # gradient on the token's rank s (every rank draws every rank's)
    def upstream(r: int) -> torch.Tensor:
        return torch.randn(tokens[r], H, generator=torch.Generator().manual_seed(seed + 5 + r)).to(dtype)

    y_r, handle_r, out_r = run(True, y_grad=True)
    (out_r.to(torch.float32) * upstream(rank).to(torch.float32)).sum().backward()
    ups = [upstream(r) for r in range(W)]
    want = torch.stack([(ups[s][t].to(torch.float32) * (float(ws[s][t, k]) if weighted else 1.0)).to(dtype)
                        for s, t, k in order]) if order else torch.empty(0, H, dtype=dtype)
    report["grad_y_bitwise"] = torch.equal(y_r.grad[:len(order)], want)
    # graph mode: the capacity rows past the received ones get zero gradients (their weights are 0)
    recv_g2, h_g2 = buf.dispatch(x, idx, w if weighted else None, sync=False)
    y_g = torch.zeros_like(recv_g2).requires_grad_(True)
    out_g2 = buf.combine(y_g, h_g2, topk_sum="expert_rank", partial_dtype=partial_dtype)
    (out_g2.to(torch.float32) * upstream(rank).to(torch.float32)).sum().backward()
    report["graph_grad_clean"] = bool(torch.isfinite(y_g.grad.float()).all()) and \
        torch.equal(y_g.grad[:len(order)], want) and bool((y_g.grad[len(order):] == 0).all())
    buf.free()
    return report


def rank_reduced_errors_case() -> dict:
    """Bad combine modes raise on every rank: a rank asking for another mode than its peers; the
    weights given to combine in the rank-reduced mode; an unknown topk_sum; partial_dtype with the
    exact combine; fp32 partials that the buffer cannot hold."""
    rank, W = dist.get_rank(), dist.get_world_size()
    res: dict = {}
    catch = _recorder(res)
    xs, idxs, ws = make_inputs(W, [6] * W, 32, 4, 2, torch.bfloat16, "uniform", 3)
    buf = EPBuffer(None, 4, 32, 6, 2, torch.bfloat16)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    recv_x, h = buf.dispatch(x, idx, w)
    mode = "expert_rank" if rank == 0 else "token_rank"
    catch("mismatch", lambda: buf.combine(recv_x, h, topk_sum=mode))
    catch("weights", lambda: buf.combine(recv_x, h, w, topk_sum="expert_rank"))
    catch("unknown", lambda: buf.combine(recv_x, h, topk_sum="rank"))
    catch("partial_exact", lambda: buf.combine(recv_x, h, partial_dtype=torch.float32))
    catch("partial_bad", lambda: buf.combine(recv_x, h, topk_sum="expert_rank", partial_dtype=torch.float16))
    catch("partial_room", lambda: buf.combine(recv_x, h, topk_sum="expert_rank", partial_dtype=torch.float32))
    recv_wg, h_wg = buf.dispatch(x, idx, w.clone().requires_grad_(True))
    catch("weights_grad", lambda: buf.combine(recv_wg, h_wg, topk_sum="expert_rank"))
    catch("caller_expert_major", lambda: buf.combine(recv_x, h, topk_sum="caller"))
    tok, h_tok = buf.dispatch(x, idx, w, layout="token_major")
    catch("caller_weights", lambda: buf.combine(tok, h_tok, w, topk_sum="caller"))
    catch("caller_rows", lambda: buf.combine(tok[:-1] if rank == 0 else tok, h_tok, topk_sum="caller"))
    out = buf.combine(recv_x, h, topk_sum="expert_rank")  # the buffer still works afterwards
    res["after_ok"] = bool(torch.isfinite(out.float()).all())
    buf.free()
    return res


def token_major_case(tokens: list[int], H: int, E: int, K: int, dtype: torch.dtype, kind: str, seed: int,
                     drop_prob: float, block_hidden: int | None = None, hidden_slices: int | None = None) -> dict:
    """dispatch(layout="token_major"): each received token once, in (source rank, token) order;
    recv_x[row_index] is the expert-major layout bit for bit; combine along it equals the
    expert-major flow's; graph mode gives the same rows first; the gradient of x is the rank-ordered
    fp32 sum of the token's row gradients, bit for bit."""
    rank, W = dist.get_rank(), dist.get_world_size()
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, dtype, kind, seed, drop_prob)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    buf = EPBuffer(None, E, H, max(max(tokens), 1), K, dtype, block_hidden=block_hidden, hidden_slices=hidden_slices)
    assert block_hidden is None or buf._col_pairs, "the tiling asked for should step two column tiles at a time"
    e_local = E // W
    mine = [[t for t in range(tokens[s]) if any(int(idxs[s][t, k]) // e_local == rank and int(idxs[s][t, k]) >= 0
                                                 for k in range(K))] for s in range(W)]
    report: dict = {}
    tok, h = buf.dispatch(x, idx, w, layout="token_major")
    want_tok = torch.stack([xs[s][t] for s in range(W) for t in mine[s]]) if sum(map(len, mine)) else \
        torch.empty(0, H, dtype=dtype)
    # rows = tokens received; recv_x holds no mostly unused capacity (it is allocated at W * max_tokens
    # rows and sliced after the kernel, copied when the rows fill less than half)
    report["token_rows_exact"] = h.token_rows == want_tok.shape[0] and torch.equal(tok, want_tok) and \
        tok.untyped_storage().nbytes() <= 2 * tok.numel() * tok.element_size()
    rows, he = buf.dispatch(x, idx, w)
    report["row_index_exact"] = torch.equal(tok[h.row_index.long()], rows) and \
        torch.equal(h.expert_offsets, he.expert_offsets) and torch.equal(h.recv_weights, he.recv_weights)
    order = recv_order(idxs, rank, E)
    scale = torch.tensor([row_scale(int(idxs[s][t, k])) for s, t, k in order]).reshape(-1, 1)
    y_tok = (tok[h.row_index.long()].to(torch.float32) * scale).to(dtype)
    y_exp = (rows.to(torch.float32) * scale).to(dtype)
    report["combine_same"] = torch.equal(buf.combine(y_tok, h, w), buf.combine(y_exp, he, w))
    tok_g, h_g = buf.dispatch(x, idx, w, sync=False, layout="token_major")
    n, m = want_tok.shape[0], int(h_g.expert_offsets[-1])
    report["graph_same"] = tok_g.shape[0] == W * buf.max_tokens and torch.equal(tok_g[:n], tok) and \
        torch.equal(h_g.row_index[:m], h.row_index)
    # gradients: upstream R_r on rank r's token rows; x's gradient on source s, token t: the rank-ordered
    # fp32 sum over the ranks r that got t of R_r[its row there], cast once
    def upstream(r: int) -> torch.Tensor:
        n_r = sum(1 for s in range(W) for t in range(tokens[s]) if any(
            int(idxs[s][t, k]) >= 0 and int(idxs[s][t, k]) // e_local == r for k in range(K)))
        return torch.randn(n_r, H, generator=torch.Generator().manual_seed(seed + 9 + r)).to(dtype)

    xg = x.clone().requires_grad_(True)
    tok2, _ = buf.dispatch(xg, idx, w, layout="token_major")
    # under autograd (kept for the backward) recv_x is allocated with exactly the rows received
    report["grad_rows_exact_alloc"] = tok2.untyped_storage().nbytes() == tok2.numel() * tok2.element_size()
    (tok2.to(torch.float32) * upstream(rank).to(torch.float32)).sum().backward()
    want = torch.zeros(tokens[rank], H, dtype=torch.float32)
    for r in range(W):
        got_r = [(s, t) for s in range(W) for t in range(tokens[s]) if any(
            int(idxs[s][t, k]) >= 0 and int(idxs[s][t, k]) // e_local == r for k in range(K))]
        up = upstream(r)
        for j, (s, t) in enumerate(got_r):
            if s == rank:
                want[t] = want[t] + up[j].to(torch.float32)
    report["grad_x_bitwise"] = torch.equal(xg.grad, cast_like_kernels(want, dtype))
    # combine(topk_sum="caller") of the same rows: the same rank-ordered sum, in both modes; y's
    # gradient of the row of (source s, token t) is the output gradient of t on s, as it is
    out_want = cast_like_kernels(want, dtype)
    yc = upstream(rank).requires_grad_(True)
    out = buf.combine(yc, h, topk_sum="caller")
    y_g = torch.zeros(W * buf.max_tokens, H, dtype=dtype)
    y_g[:n] = upstream(rank)
    out_g = buf.combine(y_g, h_g, topk_sum="caller")
    report["caller_sum_bitwise"] = torch.equal(out, out_want) and torch.equal(out_g, out_want)

    def out_grad(s: int) -> torch.Tensor:
        return torch.randn(tokens[s], H, generator=torch.Generator().manual_seed(seed + 31 + s)).to(dtype)

    out.backward(out_grad(rank))
    want_gy = torch.stack([out_grad(s)[t] for s in range(W) for t in mine[s]]) if n else torch.empty(0, H, dtype=dtype)
    report["caller_grad_bitwise"] = torch.equal(yc.grad, want_gy)
    buf.free()
    return report


def fp8_dispatch_case(tokens: list[int], H: int, E: int, K: int, kind: str, seed: int, drop_prob: float) -> dict:
    """FP8 dispatch (dispatch_dtype=float8_e4m3fn): the e4m3 rows and their scales arrive bit for bit
    in both layouts; dequantize=True gives x * scale in fp32, cast once (bit for bit against that
    formula), within e4m3's rounding of the float64 tokens; the token-major e4m3 rows and scales go
    into the grouped GEMM as they are (x_scales=); bad FP8 arguments raise on every rank."""
    from ditron_ep.runtime import DitronConfigError
    rank, W = dist.get_rank(), dist.get_world_size()
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, torch.bfloat16, kind, seed, drop_prob)
    qs = [quantize_fp8(x) for x in xs]
    (q, sc), idx, w = qs[rank], idxs[rank], ws[rank]
    buf = EPBuffer(None, E, H, max(max(tokens), 1), K, torch.bfloat16, dispatch_dtype=torch.float8_e4m3fn)
    order = recv_order(idxs, rank, E)
    e_local = E // W
    mine = [(s, t) for s in range(W) for t in range(tokens[s]) if any(
        int(idxs[s][t, k]) >= 0 and int(idxs[s][t, k]) // e_local == rank for k in range(K))]
    report: dict = {}

    def rows_of(pairs, which):  # which: 0 the e4m3 rows, 1 the scales
        stacked = [qs[s][which][t] for s, t in pairs]
        return torch.stack(stacked) if stacked else torch.empty((0, qs[0][which].shape[1]), dtype=qs[0][which].dtype)

    recv, h = buf.dispatch(q, idx, w, x_scales=sc)
    pairs = [(s, t) for s, t, _ in order]
    report["expert_major_exact"] = recv.dtype == torch.float8_e4m3fn and \
        torch.equal(recv.view(torch.uint8), rows_of(pairs, 0).view(torch.uint8)) and torch.equal(h.recv_scales, rows_of(pairs, 1))
    tok, ht = buf.dispatch(q, idx, w, x_scales=sc, layout="token_major")
    report["token_major_exact"] = torch.equal(tok.view(torch.uint8), rows_of(mine, 0).view(torch.uint8)) and \
        torch.equal(ht.recv_scales, rows_of(mine, 1))
    deq, hd = buf.dispatch(q, idx, w, x_scales=sc, dequantize=True, layout="token_major")
    want = rows_of(mine, 0).to(torch.float32) * rows_of(mine, 1).repeat_interleave(128, dim=1)
    report["dequant_bitwise"] = deq.dtype == torch.bfloat16 and hd.recv_scales is None and \
        torch.equal(deq, cast_like_kernels(want, torch.bfloat16))
    orig = torch.stack([xs[s][t] for s, t in mine]).to(torch.float64) if mine else torch.empty(0, H, dtype=torch.float64)
    err = (deq.to(torch.float64) - orig).abs()
    report["dequant_rel_err"] = float((err.max() / orig.abs().max()).item()) if mine else 0.0
    # the dequantised rows through the experts and back (combine in bf16 on the FP8 buffer)
    out = buf.combine(deq[hd.row_index.long()], hd, w)
    report["combine_finite"] = bool(torch.isfinite(out.float()).all())
    # the e4m3 rows straight into the grouped GEMM (dequantised in its A-load, gathered by row_index):
    # the bits of the GEMM over the rows dequantised beforehand (fp16 experts: the interpreter's dot)
    from ditron_ep.ops.moe_layer.grouped import grouped_mlp
    g = torch.Generator().manual_seed(seed + 3)
    w1 = (torch.randn(e_local, H, 32, generator=g) / H ** 0.5).half()
    w2 = (torch.randn(e_local, 16, H, generator=g) / 4).half()
    y8 = grouped_mlp(tok, ht.expert_offsets, w1, w2, row_index=ht.row_index, x_scales=ht.recv_scales)
    deq16 = cast_like_kernels(tok.to(torch.float32) * ht.recv_scales.repeat_interleave(128, dim=1), torch.float16)
    report["gemm_on_fp8_rows"] = y8.dtype == torch.float16 and torch.equal(
        y8, grouped_mlp(deq16, ht.expert_offsets, w1, w2, row_index=ht.row_index))
    res: dict = {}
    catch = _recorder(res)
    catch("bf16_x", lambda: buf.dispatch(xs[rank], idx, w, x_scales=sc))
    catch("no_scales", lambda: buf.dispatch(q, idx, w))
    catch("bad_scales", lambda: buf.dispatch(q, idx, w, x_scales=sc[:, :1]))
    plain = EPBuffer(None, E, H, max(max(tokens), 1), K, torch.bfloat16)
    catch("scales_on_bf16", lambda: plain.dispatch(xs[rank], idx, w, x_scales=sc))
    res["bad_hidden"] = ""
    try:
        EPBuffer(None, E, 96, 4, K, torch.bfloat16, dispatch_dtype=torch.float8_e4m3fn)
    except DitronConfigError as err:
        res["bad_hidden"] = str(err)
    report["errors"] = res
    plain.free()
    buf.free()
    return report


def token_major_training_case(tokens: list[int], H: int, I: int, E: int, K: int, seed: int) -> dict:
    """A staged MoE step on the token-major layout: dispatch(layout="token_major") ->
    grouped_mlp(recv_x, row_index=handle.row_index) -> combine; output and every gradient (x,
    weights, w1, w2) against the float64 oracle, and bit for bit run to run."""
    from ditron_ep.ops.moe_layer.grouped import grouped_mlp
    from ditron_ep.ops.moe_layer.naive import ep_moe_oracle, ep_moe_oracle_grads
    rank, W = dist.get_rank(), dist.get_world_size()
    xs, idxs, ws = make_inputs(W, tokens, H, E, K, torch.float32, "uniform", seed, 0.1)
    g = torch.Generator().manual_seed(seed + 1)
    el = E // W
    w1s = [torch.randn(el, H, 2 * I, generator=g) / H ** 0.5 for _ in range(W)]
    w2s = [torch.randn(el, I, H, generator=g) / I ** 0.5 for _ in range(W)]
    ups = [torch.randn(t, H, generator=g) for t in tokens]
    buf = EPBuffer(None, E, H, max(max(tokens), 1), K, torch.float32)

    def step(sync=True):
        x = xs[rank].clone().requires_grad_(True)
        w = ws[rank].clone().requires_grad_(True)
        w1, w2 = w1s[rank].clone().requires_grad_(True), w2s[rank].clone().requires_grad_(True)
        tok, h = buf.dispatch(x, idxs[rank], layout="token_major", sync=sync)
        y = grouped_mlp(tok, h.expert_offsets, w1, w2, row_index=h.row_index, check=False)
        out = buf.combine(y, h, w)
        (out * ups[rank]).sum().backward()
        return out.detach(), x.grad, w.grad, w1.grad, w2.grad

    got = step()
    again = step()
    graph = step(sync=False)  # capacity-sized rows whose row_index tail the dispatch did not write
    want_out = ep_moe_oracle(xs, idxs, ws, w1s, w2s)[rank]
    want = ep_moe_oracle_grads(xs, idxs, ws, w1s, w2s, ups)[rank]
    report = {"rerun_bitwise": all(torch.equal(a, b) for a, b in zip(got, again)),
              "graph_bitwise": all(torch.equal(a, b) for a, b in zip(got, graph))}
    errs = []
    for name, a, b in zip(("out", "x", "w", "w1", "w2"), got, (want_out, *want)):
        scale = float(b.abs().max()) if b.numel() else 0.0
        errs.append((name, float((a.double() - b).abs().max()) / max(scale, 1e-30) if b.numel() else 0.0))
    report["rel_errs"] = errs
    buf.free()
    return report


def ep_copy_tuner_case(folder: str) -> dict:
    """tune_ep_copy on every rank (each its own cache file), then EPBuffers built with the copy
    tiling unset: the tuned entry when every rank's cache has it, the defaults when one rank's
    cache misses (rank 1 pointed at an empty file)."""
    import os

    from ditron_ep.compiler import tuner

    rank = dist.get_rank()
    E, H, T, K = 4, 32, 12, 2
    mine = os.path.join(folder, f"rank{rank}.json")
    cands = (tuner.EPCopyConfig(16, 32, 4), tuner.EPCopyConfig(8, 16, 4), tuner.EPCopyConfig(4, 16, 2))
    lines: list[str] = []
    chosen = tuner.tune_ep_copy(None, E, H, T, K, torch.float32, candidates=cands, reps=2, cache=tuner.TuneCache(mine),
                                log=lines.append)
    out = {"chosen": str(chosen), "timed": sum(" ms" in line for line in lines)}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    rows = {}
    for case, path in (("every rank", mine), ("rank 1 misses", os.path.join(folder, "empty.json") if rank else mine)):
        os.environ["DITRON_TUNE_CACHE"] = path
        try:
            buf = EPBuffer(None, E, H, T, K, torch.float32)
            out[case] = (str(buf.tuned_copy) if buf.tuned_copy else None, buf.block_rows, buf.block_hidden,
                         buf.num_warps)
            r, h = buf.dispatch(x, idx, w)
            rows[case] = (r, buf.combine(r, h, w))
            buf.free()
        finally:
            os.environ.pop("DITRON_TUNE_CACHE", None)
    out["same bits"] = all(torch.equal(a, b) for a, b in zip(rows["every rank"], rows["rank 1 misses"]))
    return out
