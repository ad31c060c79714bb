"""The fused EP MoE megakernel on CUDA ranks (bf16), under torchrun (tests/gpu/run_gpu_suite.sh).

overlap == sequential bit for bit, invariant under grid size and Device-level plan fields,
100 repeated runs identical, CUDA-graph capture with new routings, and within bf16 tolerance of
the float64 oracle. Every rank builds every rank's inputs from the same seeds on the host.
Test bodies record problems and assert after their last collective (see conftest.py).
"""
from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist

import ditron_ep  # noqa: F401
from ditron_ep.check import make_routing
from ditron_ep.ops.moe_layer.fused import FusedMoE
from ditron_ep.ops.moe_layer.grouped_ffn import grouped_swiglu_ffn
from ditron_ep.ops.moe_layer.naive import ep_moe_oracle

H, I, K = 1024, 512, 4


@pytest.fixture
def layers(dist_env):
    made: list[FusedMoE] = []
    yield made
    for layer in reversed(made):
        layer.free()


def _inputs(world: int, tokens: list[int], E: int, seed: int, kind: str = "uniform"):
    xs, idxs, ws, w1s, w2s = [], [], [], [], []
    e_local = E // world
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        xs.append(torch.randn(tokens[r], H, generator=g).to(torch.bfloat16))
        idx, w = make_routing(tokens[r], E, K, kind, generator=g, drop_prob=0.05, num_ranks=world)
        idxs.append(idx)
        ws.append(w)
        w1s.append((torch.randn(e_local, H, 2 * I, generator=g) / H ** 0.5).to(torch.bfloat16))
        w2s.append((torch.randn(e_local, I, H, generator=g) / I ** 0.5).to(torch.bfloat16))
    return xs, idxs, ws, w1s, w2s


def _on(dev, *ts):
    return [t.to(dev) for t in ts]


def test_fused_bitwise_across_schedules_grids_and_plan_fields(dist_env, layers):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    tokens = [(300, 0, 517, 64, 129, 1, 256, 77)[r % 8] for r in range(world)]
    xs, idxs, ws, w1s, w2s = _inputs(world, tokens, E, seed=1)
    args = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
    variants = [{}, {"schedule": "sequential"}, {"num_programs": 1}, {"num_programs": 7},
                {"gemm_tile_order": "column_major", "source_order": "reverse_ring", "chunk_rows": 8},
                {"comm_programs": 0}, {"comm_programs": 100, "source_order": "reverse_ring"},
                {"comm_programs": 0, "recv_lag": 0}, {"comm_programs": 8, "recv_lag": 1},
                {"gemm_tile_order": "row_major"}, {"gemm_group_rows": 3, "num_programs": 7},
                {"gemm_group_rows": 2, "schedule": "sequential"}]
    outs, problems = [], []
    for v in variants:
        layer = FusedMoE(None, E, H, I, max(tokens), K, torch.bfloat16, **v)
        layers.append(layer)
        outs.append(layer(*args))
    for v, o in zip(variants, outs):
        if not torch.equal(o, outs[0]):
            problems.append(f"variant {v} differs from overlap by {(o.float() - outs[0].float()).abs().max()}")
    exp = ep_moe_oracle([x.float() for x in xs], idxs, ws, [w.float() for w in w1s], [w.float() for w in w2s])[rank]
    if exp.numel():
        rel = float((outs[0].double().cpu() - exp).abs().max() / exp.abs().max())
        if rel > 2e-2:
            problems.append(f"off the float64 oracle: max|err|/max|expected| = {rel:.3g}")
    assert not problems, problems


def test_fused_prefill_sized_layer_on_smaller_calls(dist_env, layers):
    """Layers sized for 2048 tokens serving calls of a few tokens (the combine's spare tasks take
    column slices; plan.combine_task_split): every call, direct and graph-replayed, equals the
    layer sized for the call, overlap and sequential, bit for bit."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    problems = []
    for seed, pattern in ((3, (37, 0, 128, 5)), (4, (1, 16, 17, 100))):
        tokens = [pattern[r % 4] for r in range(world)]
        xs, idxs, ws, w1s, w2s = _inputs(world, tokens, E, seed=seed)
        args = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
        exact = FusedMoE(None, E, H, I, max(tokens), K, torch.bfloat16)
        layers.append(exact)
        want = exact(*args)
        for v in ({}, {"block_h": 128}, {"block_h": 128, "schedule": "sequential"}):
            big = FusedMoE(None, E, H, I, 2048, K, torch.bfloat16, **v)
            layers.append(big)
            for i in range(4):  # the third and fourth calls replay the captured graphs
                got = big(*args, sync=i % 2 == 1)
                if not torch.equal(got, want):
                    problems.append(f"tokens {tokens} {v} call {i}: differs by {(got.float() - want.float()).abs().max()}")
            big.check()
    assert not problems, problems


def test_fused_hundred_runs_bitwise(dist_env, layers):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    tokens = [200 + 37 * r for r in range(world)]
    xs, idxs, ws, w1s, w2s = _inputs(world, tokens, E, seed=2, kind="zipf")
    args = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
    layer = FusedMoE(None, E, H, I, max(tokens), K, torch.bfloat16)
    layers.append(layer)
    first = layer(*args)
    bad = 0
    for _ in range(100):
        bad += int(not torch.equal(layer(*args, sync=False), first))
    layer.check()
    layer.heap.check_error()
    assert bad == 0, f"{bad} of 100 runs differ"


def test_fused_lone_rank_refusal(dist_env, layers):
    """Bad weights on one rank only: that rank runs the call flagged with no tokens, so every
    peer raises a DitronConfigError naming it (not a timeout), while its peers replay the call
    from a captured graph; the next call is bitwise the first."""
    from ditron_ep.runtime import DitronConfigError

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    tokens = [96 + 5 * r for r in range(world)]
    xs, idxs, ws, w1s, w2s = _inputs(world, tokens, E, seed=5)
    x, idx, w, w1, w2 = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
    layer = FusedMoE(None, E, H, I, max(tokens), K, torch.bfloat16)
    layers.append(layer)
    first = layer(x, idx, w, w1, w2)
    layer(x, idx, w, w1, w2)  # the second call captures the signature: the refused call below replays
    bad_rank = world - 1
    got = "no error"
    try:
        layer(x, idx, w, w1[:, :, :I].contiguous() if rank == bad_rank else w1, w2)
    except DitronConfigError as err:
        got = str(err)
    want = ["w1"] if rank == bad_rank else ["rejected its own arguments", f"(ranks {bad_rank})"]
    problems = [f"refused call: {got!r} lacks one of {want}"] if not all(wd in got for wd in want) else []
    after = layer(x, idx, w, w1, w2)
    layer.heap.check_error()
    if not torch.equal(after, first):
        problems.append("the call after the refused one differs from the first")
    assert not problems, problems


def test_fused_cuda_graph_replays_new_routings(dist_env, layers):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    T = 160
    layer = FusedMoE(None, E, H, I, T, K, torch.bfloat16)
    layers.append(layer)
    xs, idxs, ws, w1s, w2s = _inputs(world, [T] * world, E, seed=3)
    x_s, idx_s, w_s, w1, w2 = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
    layer(x_s, idx_s, w_s, w1, w2, sync=False)  # warm-up: compile outside the capture
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_s = layer(x_s, idx_s, w_s, w1, w2, sync=False)
    finally:
        gc.enable()
    problems = []
    for replay in range(5):
        xs, idxs, ws, _, _ = _inputs(world, [T] * world, E, seed=10 + replay, kind="zipf" if replay % 2 else "uniform")
        x_n, idx_n, w_n = _on(dev, xs[rank], idxs[rank], ws[rank])
        x_s.copy_(x_n)
        idx_s.copy_(idx_n)
        w_s.copy_(w_n)
        graph.replay()
        eager = layer(x_n, idx_n, w_n, w1, w2)
        if not torch.equal(out_s, eager):
            problems.append(f"replay {replay}: graph output differs from eager")
    layer.heap.check_error()
    assert not problems, problems


def test_fused_overlap_is_measured(dist_env, layers):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    T = 1024
    xs, idxs, ws, w1s, w2s = _inputs(world, [T] * world, E, seed=4)
    layer = FusedMoE(None, E, H, I, T, K, torch.bfloat16)
    layers.append(layer)
    layer(*_on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank]), trace=True)
    rep = layer.overlap_report()
    print(f"[rank {rank}] overlap report: {rep}")
    assert rep["gate_up_tiles"] > 0 and rep["last_remote_chunk_clock"] >= 0, rep


def test_fused_timeline_from_the_device_timer(dist_env, layers):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    xs, idxs, ws, w1s, w2s = _inputs(world, [512] * world, E, seed=5)
    layer = FusedMoE(None, E, H, I, 512, K, torch.bfloat16)
    layers.append(layer)
    args = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
    plain = layer(*args)
    # The first traced call compiles the traced variant on each rank, at each rank's own pace: a
    # rank done first waits inside its launch for the other's rows (once 1.2 s on 2xH200 from a
    # cold cache). The timed call follows a warm-up and a barrier.
    layer(*args, trace=True)
    torch.cuda.synchronize(dev)
    dist.barrier()
    traced = layer(*args, trace=True)
    rows = layer.timeline()
    print(f"[rank {rank}] timeline: {rows}")
    assert torch.equal(plain, traced)  # tracing changes no result bit
    assert [r["stage"] for r in rows] == ["call_barrier"] + [s.name for s in layer.plan.device.stages if s.num_tasks]
    assert rows[0]["first_start_us"] == 0.0
    for r in rows:
        assert 0.0 <= r["first_start_us"] <= r["last_end_us"] < 1e6, r  # a launch of well under a second
        assert r["busy_us_per_program"] >= 0.0, r
        if r["stage"] != "call_barrier":  # task durations: ordered, none longer than the stage's span
            assert 0.0 <= r["task_min_us"] <= r["task_p50_us"] <= r["task_p90_us"] <= r["task_max_us"], r
            assert r["task_max_us"] <= r["last_end_us"] - r["first_start_us"] + 1e-6, r
    gemm = next(r for r in rows if r["stage"] == "gemm_gate_up")
    assert gemm["busy_us_per_program"] > 0.0, gemm


_SLEEP_CYCLES = 2_000_000  # torch.cuda._sleep: ~1 ms at an H200's clock


@pytest.mark.parametrize("side_copy", [False, True], ids=["x-copy-inline", "x-copy-side-stream"])
def test_default_mode_graph_replay_matches_direct_launches(dist_env, layers, monkeypatch, side_copy):
    """FusedMoE(graph_cache=1) replays captured graphs from a signature's second call: every
    call, with fresh input tensors, new routings and a signature evicted and recaptured, is
    bitwise equal to a layer launching directly (graph_cache=0), also when x is produced late and
    overwritten right after the call (x is copied into the replay's static buffer on this stream,
    or on a side stream beside the layout graph: both paths run); an earlier output is not rewritten by
    later replays; bad input raises on every rank through the replay path and the layer then
    goes on correctly."""
    from ditron_ep.ops.ep.buffer import RoutingError
    from ditron_ep.ops.moe_layer import fused as fused_moe

    monkeypatch.setattr(fused_moe, "_SIDE_COPY_BYTES", 0 if side_copy else 1 << 62)

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    cached = FusedMoE(None, E, H, I, 256, K, torch.bfloat16, graph_cache=1)
    direct = FusedMoE(None, E, H, I, 256, K, torch.bfloat16, graph_cache=0)
    layers += [cached, direct]
    _, _, _, w1s, w2s = _inputs(world, [1] * world, E, seed=6)
    w1, w2 = _on(dev, w1s[rank], w2s[rank])
    problems = []
    kept = None
    # T per call: 96 is captured on its second call, 33 evicts it (capacity 1), 96 is recaptured.
    for call, T in enumerate((96, 96, 96, 33, 33, 96, 96, 96)):
        xs, idxs, ws, _, _ = _inputs(world, [T] * world, E, seed=20 + call, kind="zipf" if call % 2 else "uniform")
        args = _on(dev, xs[rank], idxs[rank], ws[rank])
        want = direct(*args, w1, w2)
        # Widen every race the replay's stream order must close: x is produced behind a ~1 ms
        # sleep on the caller's stream (a copy not ordered after x's producer reads NaN), the
        # side copy stream is held back by another (a megakernel not waiting for the copy reads
        # the previous call's x), and the caller overwrites x as soon as the call returns.
        x_late = torch.full_like(args[0], float("nan"))
        torch.cuda._sleep(_SLEEP_CYCLES)
        x_late.copy_(args[0])
        for captured in cached._graphs._entries.values():
            with torch.cuda.stream(captured.copy_stream):
                torch.cuda._sleep(_SLEEP_CYCLES)
        got = cached(x_late, *args[1:], w1, w2)
        x_late.fill_(float("nan"))
        if not torch.equal(got, want):
            problems.append(f"call {call} (T={T}): graph replay differs from direct launches by "
                            f"{(got.float() - want.float()).abs().max()}")
        if call == 1:
            kept, kept_copy = got, got.clone()
    if len(cached._graphs) != 1 or len(direct._graphs) != 0:
        problems.append(f"captured signatures: cached {len(cached._graphs)} (want 1), direct {len(direct._graphs)}")
    if not torch.equal(kept, kept_copy):
        problems.append("an earlier output was rewritten by a later replay")
    # bad input on rank 0 only, through the captured T=96 signature: every rank raises
    xs, idxs, ws, _, _ = _inputs(world, [96] * world, E, seed=40)
    if rank == 0:
        idxs[0][5, 1] = E + 3
    try:
        cached(*_on(dev, xs[rank], idxs[rank], ws[rank]), w1, w2)
        problems.append("bad expert id on rank 0: no error through the replay path")
    except RoutingError:
        pass
    xs, idxs, ws, _, _ = _inputs(world, [96] * world, E, seed=41)
    args = _on(dev, xs[rank], idxs[rank], ws[rank])
    if not torch.equal(cached(*args, w1, w2), direct(*args, w1, w2)):
        problems.append("after the bad call, the replayed layer differs from direct launches")
    cached.check()
    assert not problems, problems


def test_grouped_ffn_tile_orders_and_grids_bitwise(dist_env):
    """The standalone grouped SwiGLU FFN (bf16, gathered rows, ragged experts, an empty one): tile
    orders (group_rows 1, 2, 8, all M-tiles) and grid sizes give the same bits, within bf16
    tolerance of a float64 reference."""
    dev = dist_env.device
    g = torch.Generator().manual_seed(11)
    sizes = [300, 0, 517, 64, 129, 1, 256, 77, 1000, 3]
    E, n_x = len(sizes), 900
    x = torch.randn(n_x, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, I, H, generator=g) / I ** 0.5).to(torch.bfloat16)
    idx = torch.randint(0, n_x, (sum(sizes),), generator=g, dtype=torch.int32)
    off = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    args = _on(dev, x, off, w1, w2)
    runs = {(p, gr): grouped_swiglu_ffn(*args, row_index=idx.to(dev), num_programs=p, group_rows=gr)
            for p, gr in ((132, 1), (132, 2), (132, 8), (132, 10**6), (7, 8), (1, 3))}
    ref_y = []
    for e in range(E):
        a = x[idx[off[e]:off[e + 1]].long()].double()
        gu = a @ w1[e].double()
        h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(torch.bfloat16).double()
        ref_y.append(h @ w2[e].double())
    ref = torch.cat(ref_y)
    first = next(iter(runs.values()))
    problems = [f"{k} differs from {next(iter(runs))}" for k, y in runs.items() if not torch.equal(y, first)]
    rel = float((first.double().cpu() - ref).abs().max() / ref.abs().max())
    if rel > 2e-2:
        problems.append(f"off the float64 reference: max|err|/max|ref| = {rel:.3g}")
    assert not problems, problems


def test_grouped_ffn_bad_values_repaired_on_device(dist_env):
    """By default a GPU call checks no values on the host (no sync): bad offsets and an
    out-of-range row_index are repaired on the device, giving the result of the repaired inputs
    (no fault, no unwritten rows); valid inputs give the same bits as check=False; check=True
    raises."""
    from ditron_ep.ops.moe_layer.grouped_ffn import _made_valid
    dev = dist_env.device
    g = torch.Generator().manual_seed(12)
    n_x, E = 200, 3
    x = torch.randn(n_x, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, I, H, generator=g) / I ** 0.5).to(torch.bfloat16)
    idx = torch.randint(0, n_x, (300,), generator=g, dtype=torch.int32)
    x, w1, w2, idx = _on(dev, x, w1, w2, idx)
    problems = []
    good = torch.tensor([0, 120, 120, 300], dtype=torch.int32, device=dev)
    if not torch.equal(grouped_swiglu_ffn(x, good, w1, w2, row_index=idx),
                       grouped_swiglu_ffn(x, good, w1, w2, row_index=idx, check=False)):
        problems.append("valid inputs: check=None and check=False differ")
    bad_idx = idx.clone()
    bad_idx[5], bad_idx[77] = 10**6, -4
    for bad in ([40, 250, 100, 900], [-7, 0, 300, 290]):
        off = torch.tensor(bad, dtype=torch.int32, device=dev)
        y = grouped_swiglu_ffn(x, off, w1, w2, row_index=bad_idx)
        fixed_off, fixed_idx = _made_valid(off, bad_idx, 300, n_x)
        if not torch.equal(y, grouped_swiglu_ffn(x, fixed_off, w1, w2, row_index=fixed_idx, check=False)):
            problems.append(f"offsets {bad}: differs from the repaired inputs' result")
        if not torch.isfinite(y).all():
            problems.append(f"offsets {bad}: non-finite rows (unwritten memory?)")
        try:
            grouped_swiglu_ffn(x, off, w1, w2, row_index=bad_idx, check=True)
            problems.append(f"offsets {bad}: check=True did not raise")
        except ValueError:
            pass
    torch.cuda.synchronize()
    assert not problems, problems


def test_epmoe_builds_on_gpu_and_equals_moe(dist_env):
    """EPMoE built on the GPU (experts drawn there, one generator per global expert): seeded
    alike, the ranks' experts differ and the routers agree; a forward equals `moe` with the
    layer's own routing, bit for bit, twice."""
    import torch.nn.functional as F

    from ditron_ep.ops import EPMoE, clear_layers, moe
    from ditron_ep.ops.moe_layer.module import _route
    dev, rank, world = dist_env.device, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(5)
    layer = EPMoE(H, I, 4 * world, K, dtype=torch.bfloat16, device=dev)
    w1s = [torch.empty_like(layer.w1) for _ in range(world)]
    routers = [torch.empty_like(layer.router_weight) for _ in range(world)]
    dist.all_gather(w1s, layer.w1.detach().contiguous())
    dist.all_gather(routers, layer.router_weight.detach().contiguous())
    problems = []
    if any(torch.equal(w1s[a], w1s[b]) for a in range(world) for b in range(a + 1, world)):
        problems.append("two ranks drew the same experts")
    if not all(torch.equal(r, routers[0]) for r in routers):
        problems.append("routers differ although every rank was seeded alike")
    g = torch.Generator().manual_seed(90 + rank)
    x = torch.randn(96 + 7 * rank, H, generator=g).to(torch.bfloat16).to(dev)
    with torch.no_grad():
        out, aux = layer(x)
        out2, _ = layer(x)
        idx, w, _ = _route(F.linear(x.float(), layer.router_weight.float()), K, "softmax", True)
        ref = moe(x, idx, w.float(), layer.w1, layer.w2)
    if not (torch.equal(out, ref) and torch.equal(out, out2)):
        problems.append("EPMoE's output differs from moe with its routing, or between two calls")
    if not torch.isfinite(out).all() or aux.dim() != 0:
        problems.append("non-finite output or a non-scalar aux loss")
    torch.cuda.synchronize()
    clear_layers()  # later tests refuse through "the group's only cached layer"
    assert not problems, problems


def test_moe_unkeyed_refusal_reaches_peers(dist_env):
    """`moe` on one rank with arguments that cannot key a cached layer (1-D topk_weights) or
    that ask for gradients: that rank refuses through the group's only cached layer, so its peers
    (replaying the call from a captured graph) raise DitronConfigError naming it, not a timeout;
    the next call is bitwise the first."""
    from ditron_ep.ops import clear_layers, moe
    from ditron_ep.runtime import DitronConfigError

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    tokens = [80 + 3 * r for r in range(world)]
    xs, idxs, ws, w1s, w2s = _inputs(world, tokens, E, seed=8)
    x, idx, w, w1, w2 = _on(dev, xs[rank], idxs[rank], ws[rank], w1s[rank], w2s[rank])
    bad_rank = world - 1
    problems = []
    with torch.no_grad():
        first = moe(x, idx, w, w1, w2)
        moe(x, idx, w, w1, w2)  # the second call captures the signature: the calls below replay it
    for name, bad_args, bad_exc in (
            ("1-D topk_weights", (x, idx, w[:, 0], w1, w2), DitronConfigError),
            ("gradients", (x, idx, w, w1.clone().requires_grad_(), w2), NotImplementedError)):
        want_exc = bad_exc if rank == bad_rank else DitronConfigError
        t0 = time.monotonic()
        got = "no error"
        try:
            with torch.set_grad_enabled(name == "gradients"):
                moe(*(bad_args if rank == bad_rank else (x, idx, w, w1, w2)))
        except (DitronConfigError, NotImplementedError) as err:
            got = f"{type(err).__name__}: {err}"
        if not got.startswith(want_exc.__name__) or (rank != bad_rank and f"(ranks {bad_rank})" not in got):
            problems.append(f"{name}: {got!r}")
        if time.monotonic() - t0 > 10:
            problems.append(f"{name}: took {time.monotonic() - t0:.1f} s (a timeout, not a refusal)")
    with torch.no_grad():
        after = moe(x, idx, w, w1, w2)
    torch.cuda.synchronize()
    if not torch.equal(after, first):
        problems.append("the call after the refused ones differs from the first")
    clear_layers()
    assert not problems, problems


def test_epmoe_lone_bad_x_reaches_peers(dist_env):
    """One rank passes EPMoE an x of the wrong width: it raises DitronConfigError and refuses through
    the layer's own cached FusedMoE, so its peers raise DitronConfigError naming it at once; the
    next call is bitwise the first."""
    from ditron_ep.ops import EPMoE, clear_layers
    from ditron_ep.runtime import DitronConfigError

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    bad_rank = world - 1
    torch.manual_seed(6)
    layer = EPMoE(H, I, 4 * world, K, dtype=torch.bfloat16, device=dev)
    x = torch.randn(70 + rank, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
    problems = []
    with torch.no_grad():
        first, _ = layer(x)
        layer(x)  # captured: the peers replay below
        t0 = time.monotonic()
        got = "no error"
        try:
            layer(x[:, :-1] if rank == bad_rank else x)
        except DitronConfigError as err:
            got = f"{type(err).__name__}: {err}"
        want = "x must be [..., hidden=" if rank == bad_rank else f"(ranks {bad_rank})"
        if not got.startswith("DitronConfigError") or want not in got:
            problems.append(f"bad x: {got!r}")
        if time.monotonic() - t0 > 10:
            problems.append(f"bad x: took {time.monotonic() - t0:.1f} s (a timeout, not a refusal)")
        after, _ = layer(x)
    torch.cuda.synchronize()
    if not torch.equal(after, first):
        problems.append("the call after the refused one differs from the first")
    clear_layers()
    assert not problems, problems
