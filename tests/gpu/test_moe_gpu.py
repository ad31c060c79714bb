"""The fused EP MoE megakernel on CUDA ranks (bf16), under torchrun (tests/gpu/run_gpu_suite.sh).

overlap == sequential bit for bit, invariant under grid size and Device-level plan fields, on
layers sized for more tokens than the call, 100 repeated runs identical, CUDA-graph capture with
new routings, and within bf16 tolerance of a float64 oracle. Test bodies record problems and
assert after their last collective (see conftest.py).

Compile budget (a cold run is mostly Triton compiling the megakernel, 5-40 s per binary): every
layer has the shape H=1024, I=512, K=4, E=4*W and 256 tokens (the 2048-token layers set
block_t=1), and the plan variants are chosen so that their integer arguments fall into the same
specialisation classes (1 / multiple of 16 / other). On 2 ranks of 132 SMs the variants below
then compile four binaries, one per family, plus the traced one (trace=True); `moe` and `EPMoE`
size their cached layer to 256 tokens and reuse the first. The megakernel also specialises on
the alignment of the sender's `tokens_to` (a slice of the per-block prefix row, 16-byte aligned
when cdiv(T, 16) % 4 == 0): the variant comparison uses aligned token counts only (0, 123, 187,
250), and the default plan's binary also meets unaligned ones (1, 17, 95, 97, 150, 200, ...), the
class of most production calls. On a cold 2xH100 machine a megakernel binary took ~8 s.
"""
from __future__ import annotations

import gc
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ditron_ep  # noqa: F401
from ditron_ep.check import make_routing
from ditron_ep.ops.moe_layer.fused import FusedMoE
from ditron_ep.ops.moe_layer.grouped import grouped_mlp

H, I, K = 1024, 512, 4
MAX_T = 256      # tokens every layer is sized for (the prefill-sized ones: PREFILL_T)
PREFILL_T = 2048


def _variants(world: int) -> dict[str, tuple[int, dict]]:
    """name -> (max_tokens_per_rank, FusedMoE keyword overrides), by megakernel binary."""
    reverse = {"source_order": "reverse_ring"} if world > 2 else {}  # on 2 ranks both ring orders are one
    grid7 = {"num_programs": 7, "comm_programs": 3, "recv_lag": 3, "block_t": 1}
    return {
        # binary 1: the default plan's
        "default": (MAX_T, {}),
        "grid7": (MAX_T, grid7),
        "comm100": (MAX_T, {"comm_programs": 100, "recv_lag": 5}),
        "group2": (MAX_T, {"gemm_group_rows": 2}),
        "prefill": (PREFILL_T, {"block_t": 1}),
        # binary 2: stage by stage
        "sequential": (MAX_T, {"schedule": "sequential"}),
        "sequential-grid7": (MAX_T, {"schedule": "sequential", "gemm_group_rows": 2, "num_programs": 7,
                                     "comm_programs": 3, "block_t": 1}),  # recv_lag: every send first
        "prefill-sequential": (PREFILL_T, {"schedule": "sequential", "block_t": 1}),
        # binary 3: one queue, no role split, receives right after the sends
        "one-queue": (MAX_T, {"comm_programs": 0, "recv_lag": 0}),
        "one-program": (MAX_T, {"num_programs": 1, "comm_programs": 0, "recv_lag": 0, "block_t": 1}),
        # binary 4: the classic GEMM tile orders (other task counts than the grouped order)
        "row-major": (MAX_T, {"gemm_tile_order": "row_major", **reverse}),
        "column-major-grid7": (MAX_T, {"gemm_tile_order": "column_major", **grid7, **reverse}),
    }


# Layers the graph-replay test compares (binary 1 too); not in the plan-variant comparison.
_GRAPH_CACHE_LAYERS = {"graph-cache-1": (MAX_T, {"graph_cache": 1}), "graph-cache-0": (MAX_T, {"graph_cache": 0})}


@pytest.fixture(scope="module")
def moe_layers(dist_env):
    """Every layer of the module, built once (collectively, same order on every rank)."""
    E = 4 * dist_env.world
    made: dict[str, FusedMoE] = {}
    for name, (max_t, overrides) in {**_variants(dist_env.world), **_GRAPH_CACHE_LAYERS}.items():
        made[name] = FusedMoE(None, E, H, I, max_t, K, torch.bfloat16, **overrides)
    yield made
    for layer in reversed(list(made.values())):
        layer.free()


@pytest.fixture(scope="module")
def weights(dist_env):
    """(w1, w2) of this rank's experts on the device (bf16) and every expert's in float64 on the
    device (the oracle's), drawn from per-rank seeds."""
    E, world, dev = 4 * dist_env.world, dist_env.world, dist_env.device
    w1s, w2s = [], []
    for r in range(world):
        g = torch.Generator().manual_seed(7000 + r)
        w1s.append((torch.randn(E // world, H, 2 * I, generator=g) / H ** 0.5).to(torch.bfloat16))
        w2s.append((torch.randn(E // world, I, H, generator=g) / I ** 0.5).to(torch.bfloat16))
    return types.SimpleNamespace(w1=w1s[dist_env.rank].to(dev), w2=w2s[dist_env.rank].to(dev),
                                 w1_64=torch.cat(w1s).to(dev, torch.float64),
                                 w2_64=torch.cat(w2s).to(dev, torch.float64))


def _pattern(pattern: tuple[int, ...], rank: int) -> int:
    return pattern[rank % len(pattern)]


def _inputs(dev, rank: int, T: int, E: int, seed: int, kind: str = "uniform"):
    """This rank's (x bf16 [T, H], topk_idx [T, K], topk_weights fp32 [T, K]) on dev, from seed."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx, w = make_routing(T, E, K, kind, generator=g, drop_prob=0.05, num_ranks=dist.get_world_size())
    return x.to(dev), idx.to(dev), w.to(dev)


def _oracle_problem(out: torch.Tensor, x, idx, w, wts, what: str) -> str | None:
    """out vs the float64 oracle sum_k w[t,k] * (silu(x[t] @ gate_e) * (x[t] @ up_e)) @ down_e
    (plain torch, every expert's weights, this rank's tokens): max|err| / max|expected| <= 2e-2."""
    x64 = x.double()
    exp = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in idx.unique().tolist():
        if e < 0:
            continue
        t, k = (idx == e).nonzero(as_tuple=True)
        h = x64[t] @ wts.w1_64[e]
        act = F.silu(h[:, :I]) * h[:, I:]
        exp.index_add_(0, t, w[t, k].double()[:, None] * (act @ wts.w2_64[e]))
    if not exp.numel() or not exp.abs().max() > 0:
        return None if not out.numel() or torch.equal(out, torch.zeros_like(out)) else f"{what}: nonzero output"
    rel = float((out.double() - exp).abs().max() / exp.abs().max())
    return None if rel <= 2e-2 else f"{what}: off the float64 oracle, max|err|/max|expected| = {rel:.3g}"


def test_fused_plan_variants_bitwise(dist_env, moe_layers, weights):
    """Every plan variant (schedule, grid size, role split, receive lag, GEMM tile order and
    grouping, a layer sized for 2048 tokens) gives the default layer's bits, on a call with an
    empty rank and a ragged one; the default is within bf16 tolerance of the float64 oracle."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    problems = []
    for seed, kind, pattern in ((1, "uniform", (250, 0)), (2, "zipf", (187, 123))):
        x, idx, w = _inputs(dev, rank, _pattern(pattern, rank), E, seed, kind)
        outs = {name: moe_layers[name](x, idx, w, weights.w1, weights.w2) for name in _variants(world)}
        base = outs["default"]
        for name, o in outs.items():
            if not torch.equal(o, base):
                problems.append(f"{kind} {pattern}: {name} differs from the default layer by "
                                f"{(o.float() - base.float()).abs().max()}")
        if problem := _oracle_problem(base, x, idx, w, weights, f"{kind} {pattern}"):
            problems.append(problem)
    assert not problems, problems


def test_fused_small_calls_on_larger_layers(dist_env, moe_layers, weights):
    """Layers sized for 256 and 2048 tokens serving calls of a few tokens (the combine's spare
    tasks take column slices; plan.combine_task_split): every call, direct and graph-replayed,
    overlap and sequential, gives the same bits; so does a call of 250 / 187 tokens, which the
    2048-token layers split into column slices and the 256-token ones do not. The decode-sized
    call (1 / 17 tokens: an unaligned `tokens_to`) runs on the overlap layers only (the
    sequential binary is compiled for aligned calls alone)."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    problems = []
    every = ("default", "sequential", "prefill", "prefill-sequential")
    for seed, pattern, names in ((3, (61, 0), every), (4, (1, 17), ("default", "prefill")),
                                 (5, (250, 187), every)):
        x, idx, w = _inputs(dev, rank, _pattern(pattern, rank), E, seed)
        want = moe_layers["default"](x, idx, w, weights.w1, weights.w2)
        if problem := _oracle_problem(want, x, idx, w, weights, f"tokens {pattern}"):
            problems.append(problem)
        for name in names:
            layer = moe_layers[name]
            for i in range(4):  # graph mode, then default mode; from the second default-mode call on, replays
                got = layer(x, idx, w, weights.w1, weights.w2, sync=i % 2 == 1)
                if not torch.equal(got, want):
                    problems.append(f"tokens {pattern} {name} call {i}: differs by "
                                    f"{(got.float() - want.float()).abs().max()}")
            layer.check()
    assert not problems, problems


def test_fused_hundred_runs_bitwise(dist_env, moe_layers, weights):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    x, idx, w = _inputs(dev, rank, _pattern((200, 237), rank), 4 * world, seed=2, kind="zipf")
    layer = moe_layers["default"]
    first = layer(x, idx, w, weights.w1, weights.w2)
    bad = 0
    for _ in range(100):
        bad += int(not torch.equal(layer(x, idx, w, weights.w1, weights.w2, sync=False), first))
    layer.check()
    layer.heap.check_error()
    assert bad == 0, f"{bad} of 100 runs differ"


def test_fused_lone_rank_refusal(dist_env, moe_layers, weights):
    """Bad weights on one rank only: that rank runs the call flagged with no tokens, so every
    peer raises a DitronConfigError naming it (not a timeout), while its peers replay the call
    from a captured graph; the next call is bitwise the first."""
    from ditron_ep.runtime import DitronConfigError

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    x, idx, w = _inputs(dev, rank, 97 + 4 * rank, 4 * world, seed=5)
    w1, w2 = weights.w1, weights.w2
    layer = moe_layers["default"]
    first = layer(x, idx, w, w1, w2)
    layer(x, idx, w, w1, w2)  # the second call captures the signature: the refused call below replays
    bad_rank = world - 1
    got = "no error"
    try:
        layer(x, idx, w, w1[:, :, :I].contiguous() if rank == bad_rank else w1, w2)
    except DitronConfigError as err:
        got = str(err)
    want = ["w1"] if rank == bad_rank else [f"rank(s) {bad_rank} rejected their own arguments"]
    problems = [f"refused call: {got!r} lacks one of {want}"] if not all(wd in got for wd in want) else []
    after = layer(x, idx, w, w1, w2)
    layer.heap.check_error()
    if not torch.equal(after, first):
        problems.append("the call after the refused one differs from the first")
    assert not problems, problems


def test_fused_cuda_graph_replays_new_routings(dist_env, moe_layers, weights):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E, T = 4 * world, 150
    layer = moe_layers["default"]
    w1, w2 = weights.w1, weights.w2
    x_s, idx_s, w_s = _inputs(dev, rank, T, E, seed=3)
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
        x_n, idx_n, w_n = _inputs(dev, rank, T, E, seed=10 + replay, kind="zipf" if replay % 2 else "uniform")
        x_s.copy_(x_n)
        idx_s.copy_(idx_n)
        w_s.copy_(w_n)
        graph.replay()
        eager = layer(x_n, idx_n, w_n, w1, w2)
        if not torch.equal(out_s, eager):
            problems.append(f"replay {replay}: graph output differs from eager")
    layer.heap.check_error()
    del graph
    assert not problems, problems


def test_fused_timeline_and_overlap_from_a_traced_call(dist_env, moe_layers, weights):
    """trace=True (its own binary) changes no result bit; the device timer gives every stage's
    span and task durations; GEMM tiles start while remote dispatch chunks are still arriving."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    layer = moe_layers["default"]
    args = (*_inputs(dev, rank, MAX_T, 4 * world, seed=6), weights.w1, weights.w2)
    plain = layer(*args)
    # The first traced call compiles the traced variant on each rank, at each rank's own pace: a
    # rank done first waits inside its launch for the other's rows (once 1.2 s on 2xH200 from a
    # cold cache). The timed call follows a warm-up and a barrier.
    layer(*args, trace=True)
    torch.cuda.synchronize(dev)
    dist.barrier()
    traced = layer(*args, trace=True)
    rows = layer.timeline()
    rep = layer.overlap_report()
    print(f"[rank {rank}] timeline: {rows}\n[rank {rank}] overlap report: {rep}")
    assert torch.equal(plain, traced)  # tracing changes no result bit
    # one rank has no remote chunk (the clock of the last one is -1)
    assert rep["gate_up_tiles"] > 0 and (rep["last_remote_chunk_clock"] >= 0) == (world > 1), rep
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
def test_default_mode_graph_replay_matches_direct_launches(dist_env, moe_layers, weights, monkeypatch, side_copy):
    """FusedMoE(graph_cache=1) replays captured graphs from a signature's second call: every
    call, with fresh input tensors, new routings and a signature evicted and recaptured, is
    bitwise equal to a layer launching directly (graph_cache=0), also when x is produced late and
    overwritten right after the call (x is copied into the replay's static buffer on this stream,
    or on a side stream beside the layout graph: both paths run); an earlier output is not rewritten by
    later replays; bad input raises on every rank through the replay path and the layer then
    goes on correctly. (The layers are the module's: the second parametrisation starts with the
    first one's last signature captured, so its first call already replays.)"""
    from ditron_ep.ops.ep.buffer import RoutingError
    from ditron_ep.ops.moe_layer import fused as fused_moe

    monkeypatch.setattr(fused_moe, "_SIDE_COPY_BYTES", 0 if side_copy else 1 << 62)

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    cached, direct = moe_layers["graph-cache-1"], moe_layers["graph-cache-0"]
    w1, w2 = weights.w1, weights.w2
    problems = []
    kept = None
    # T per call: 95's capture (of layout_rows(95) = 128 tokens) is made on its second call, 33 evicts
    # it (capacity 1), 95 is recaptured; then 110, 127 and 128 replay it (the rows past each call's
    # routed nowhere, set back to -1 as T shrinks).
    for call, T in enumerate((95, 95, 95, 33, 33, 95, 95, 95, 110, 127, 100, 128, 97)):
        args = _inputs(dev, rank, T, E, seed=20 + call, kind="zipf" if call % 2 else "uniform")
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
    # bad input on rank 0 only, through the captured T=95 signature: every rank raises
    x, idx, w = _inputs(dev, rank, 95, E, seed=40)
    if rank == 0:
        idx[5, 1] = E + 3
    try:
        cached(x, idx, w, w1, w2)
        problems.append("bad expert id on rank 0: no error through the replay path")
    except RoutingError:
        pass
    args = _inputs(dev, rank, 95, E, seed=41)
    if not torch.equal(cached(*args, w1, w2), direct(*args, w1, w2)):
        problems.append("after the bad call, the replayed layer differs from direct launches")
    cached.check()
    assert not problems, problems


def test_a_call_captured_under_inference_mode_replays_outside_it(dist_env, moe_layers, weights):
    """FusedMoE's graph statics are ordinary tensors even when the capture ran under
    torch.inference_mode, so a later call outside it copies its inputs in and replays, bitwise
    equal to direct launches (an inference tensor would refuse the in-place copy)."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E = 4 * world
    cached, direct = moe_layers["graph-cache-1"], moe_layers["graph-cache-0"]
    w1, w2 = weights.w1, weights.w2
    with torch.inference_mode():  # enough calls of T=60 for its capture to evict the one kept
        for call in range(6):
            cached(*_inputs(dev, rank, 60, E, seed=50 + call), w1, w2)
    args = _inputs(dev, rank, 60, E, seed=60)
    got, want = cached(*args, w1, w2), direct(*args, w1, w2)
    kept = [c.x.shape[0] for c in cached._graphs._entries.values()]
    assert torch.equal(got, want) and kept == [64], (kept, (got.float() - want.float()).abs().max())


def test_grouped_mlp_tile_orders_and_grids_bitwise(dist_env):
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
    args = [t.to(dev) for t in (x, off, w1, w2)]
    runs = {(p, gr): grouped_mlp(*args, row_index=idx.to(dev), num_programs=p, group_rows=gr)
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


def test_grouped_mlp_bad_values_repaired_on_device(dist_env):
    """By default a GPU call checks no values on the host (no sync): bad offsets and an
    out-of-range row_index are repaired on the device, giving the result of the repaired inputs
    (no fault, no unwritten rows); valid inputs give the same bits as check=False; check=True
    raises."""
    from ditron_ep.ops.moe_layer.grouped import _made_valid
    dev = dist_env.device
    g = torch.Generator().manual_seed(12)
    n_x, E = 200, 3
    x = torch.randn(n_x, H, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, I, H, generator=g) / I ** 0.5).to(torch.bfloat16)
    idx = torch.randint(0, n_x, (300,), generator=g, dtype=torch.int32)
    x, w1, w2, idx = (t.to(dev) for t in (x, w1, w2, idx))
    problems = []
    good = torch.tensor([0, 120, 120, 300], dtype=torch.int32, device=dev)
    if not torch.equal(grouped_mlp(x, good, w1, w2, row_index=idx),
                       grouped_mlp(x, good, w1, w2, row_index=idx, check=False)):
        problems.append("valid inputs: check=None and check=False differ")
    bad_idx = idx.clone()
    bad_idx[5], bad_idx[77] = 10**6, -4
    for bad in ([40, 250, 100, 900], [-7, 0, 300, 290]):
        off = torch.tensor(bad, dtype=torch.int32, device=dev)
        y = grouped_mlp(x, off, w1, w2, row_index=bad_idx)
        fixed_off, fixed_idx = _made_valid(off, bad_idx, 300, n_x)
        if not torch.equal(y, grouped_mlp(x, fixed_off, w1, w2, row_index=fixed_idx, check=False)):
            problems.append(f"offsets {bad}: differs from the repaired inputs' result")
        if not torch.isfinite(y).all():
            problems.append(f"offsets {bad}: non-finite rows (unwritten memory?)")
        try:
            grouped_mlp(x, off, w1, w2, row_index=bad_idx, check=True)
            problems.append(f"offsets {bad}: check=True did not raise")
        except ValueError:
            pass
    torch.cuda.synchronize()
    assert not problems, problems


# Tokens per rank of the `moe` / `EPMoE` tests: rank 0's 256 sizes their cached layer to the
# module's 256 tokens, so it runs binary 1 (the default plan's) again.
_MODULE_TOKENS = (256, 200, 129, 37)


def test_epmoe_builds_on_gpu_and_equals_moe(dist_env):
    """EPMoE built on the GPU (experts drawn there, one generator per global expert): seeded
    alike, the ranks' experts differ and the routers agree; a forward equals `moe` with the
    layer's own routing, bit for bit, twice."""
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
    x = torch.randn(_pattern(_MODULE_TOKENS, rank), H, generator=g).to(torch.bfloat16).to(dev)
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
    layer.free_buffers()
    clear_layers()
    assert not problems, problems


def test_moe_one_rank_bad_arguments_reach_peers(dist_env, weights):
    """`moe` on one rank with malformed arguments (1-D topk_weights), a bias of the wrong shape or
    another hidden size: that rank joins the call on the group's layer flagged, so its peers
    (replaying the call from a captured graph) raise DitronConfigError naming it at once, not a
    timeout; the next call is bitwise the first."""
    from ditron_ep.ops import clear_layers, moe
    from ditron_ep.runtime import DitronConfigError

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    x, idx, w = _inputs(dev, rank, _pattern(_MODULE_TOKENS, rank), 4 * world, seed=8)
    w1, w2 = weights.w1, weights.w2
    bad_rank = world - 1
    problems = []
    with torch.no_grad():
        first = moe(x, idx, w, w1, w2)
        moe(x, idx, w, w1, w2)  # the second call captures the signature: the calls below replay it
    bad_b1 = torch.zeros(w1.shape[0], 3, dtype=w1.dtype, device=dev)  # a bias of the wrong shape
    wide = [torch.cat([t, t[..., :64]], dim=-1) for t in (x, w2)]  # hidden + 64
    w1_wide = torch.cat([w1, w1[:, :64]], dim=1)
    for name, bad_args, bad_kwargs, bad_exc in (
            ("1-D topk_weights", (x, idx, w[:, 0], w1, w2), {}, DitronConfigError),
            ("b1 of the wrong shape", (x, idx, w, w1, w2), {"b1": bad_b1}, DitronConfigError),
            ("another hidden size", (wide[0], idx, w, w1_wide, wide[1]), {}, DitronConfigError)):
        want_exc = bad_exc if rank == bad_rank else DitronConfigError
        t0 = time.monotonic()
        got = "no error"
        try:
            with torch.no_grad():
                if rank == bad_rank:
                    moe(*bad_args, **bad_kwargs)
                else:
                    moe(x, idx, w, w1, w2)
        except (DitronConfigError, NotImplementedError) as err:
            got = f"{type(err).__name__}: {err}"
        named = f"rank(s) {bad_rank} rejected" in got or f"rank {bad_rank} {H + 64}" in got
        if not got.startswith(want_exc.__name__) or (rank != bad_rank and not named):
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
    """One rank passes EPMoE an x of the wrong width: it raises DitronConfigError and joins the
    call on the layer's own FusedMoE flagged, so its peers raise DitronConfigError naming it at
    once; the next call is bitwise the first."""
    from ditron_ep.ops import EPMoE
    from ditron_ep.runtime import DitronConfigError

    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    bad_rank = world - 1
    torch.manual_seed(6)
    layer = EPMoE(H, I, 4 * world, K, dtype=torch.bfloat16, device=dev)
    T = _pattern(_MODULE_TOKENS, rank)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
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
        want = "x must be [..., hidden=" if rank == bad_rank else f"rank(s) {bad_rank} rejected"
        if not got.startswith("DitronConfigError") or want not in got:
            problems.append(f"bad x: {got!r}")
        if time.monotonic() - t0 > 10:
            problems.append(f"bad x: took {time.monotonic() - t0:.1f} s (a timeout, not a refusal)")
        after, _ = layer(x)
    torch.cuda.synchronize()
    if not torch.equal(after, first):
        problems.append("the call after the refused one differs from the first")
    layer.free_buffers()
    assert not problems, problems
