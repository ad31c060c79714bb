"""EP dispatch/combine on CUDA ranks (`EPBuffer`, torch symmetric memory), under torchrun.

The GPU twin of tests/ops/ep/test_ep_dispatch_combine.py (tests/ops/ep/rank_fns_ep.py): the same checks,
at GPU sizes. Run with tests/gpu/run_gpu_suite.sh. Every rank runs every test, in the same order;
test bodies record problems and assert only after their last collective (the conftest then fails
the test on every rank if it failed on any). EPBuffers are freed (collectively) after the
verdict exchange, when all ranks are in step: a test's own by the `ep_buffers` fixture, the
module's (`buf_a`, `buf_b`) when the module ends.

Every rank builds every rank's inputs from the same seeds (on the host), so the expected receive
side (rows of local expert e ordered by (source rank, source token)) is computed locally with
plain torch indexing that shares no code with the library; the combine oracle is float64.

The checking functions (`_*_check`) take the device and a buffer (or a list that collects the
buffers they create), and return their problems.

Compile budget (a cold run is mostly Triton compiling): every buffer has one of three bf16
shapes, SHAPE_A (E=64, H=1000 -- not a multiple of the column block --, K=8, 320 tokens; module
buffer `buf_a`), the production SHAPE_B (E=256, H=7168, K=8, 512 tokens; `buf_b`) and the top-1
SHAPE_C (E=8, K=1, one case), so the buffers of a shape share their compiled kernels; routings,
token counts and graph mode vary per call, not per buffer. The kernels also specialise on the alignment of the sender's `tokens_to` (a
slice of the per-block prefix row: 16-byte aligned when cdiv(T, 16) % 4 == 0) and on token and
row counts (1 / multiple of 16 / other), so every token count here is 0 or a ragged count with
cdiv(T, 16) % 4 == 0 (59-63, 123, 187-191, 250, 311, 500-511), tokens are dispatched with their
weights except in the bad-input test (the unweighted dispatch), and the gradient tests have no
empty rank. On a cold 2xH100 machine each dispatch or combine specialisation took ~5.5 s.
fp16 and fp32 run on emulated ranks only (tests/ops/ep/test_ep_dispatch_combine.py): the kernels
are dtype-generic copies and sums.
"""
from __future__ import annotations

import gc
import json
import os
import types

import pytest
import torch
import torch.distributed as dist

import ditron_ep  # noqa: F401  (decides compiled vs interpreted kernels before any triton.jit)
from ditron_ep.bench.ep_inputs import ranks_reached
from ditron_ep.check import TOLERANCES, make_routing
from ditron_ep.ops import CapacityError, EPBuffer, RoutingError
from ditron_ep.runtime import DitronConfigError

_MAX_PROBLEMS = 30
DTYPE = torch.bfloat16
# (num_experts before rounding to the world size, hidden, max_tokens_per_rank, topk)
SHAPE_A = (64, 1000, 320, 8)
SHAPE_B = (256, 7168, 512, 8)  # DeepSeek-V3's layer
SHAPE_C = (8, 1000, 384, 1)    # top-1 routing (K = 1: the degenerate tiles of the slot loops)
_SHAPES = {"A": SHAPE_A, "B": SHAPE_B, "C": SHAPE_C}


# ---------------------------------------------------------------------------------------------
# Fixture: EPBuffers freed after the test (collective), like make_heap in conftest.py


@pytest.fixture
def ep_buffers(dist_env):
    """A list the test appends its EPBuffers to (see `_new_buffer`); freed in teardown."""
    buffers: list[EPBuffer] = []
    yield buffers
    for buf in reversed(buffers):
        buf.free()
    buffers.clear()


def _new_buffer(buffers: list, num_experts: int, hidden: int, max_tokens: int, topk: int,
                dtype: torch.dtype, **kwargs) -> EPBuffer:
    """Collective: EPBuffer(None, E, H, max_tokens, K, dtype) with backend auto (torch on CUDA)."""
    buf = EPBuffer(None, num_experts, hidden, max_tokens, topk, dtype, **kwargs)
    buffers.append(buf)
    return buf


def _shape(shape: tuple[int, int, int, int], world: int) -> tuple[int, int, int, int]:
    """(E, H, max_tokens, K) of a SHAPE_* on `world` ranks (E rounded up to a multiple of it)."""
    E, H, max_t, K = shape
    return _experts(E, world), H, max_t, K


def _shape_buffer(buffers: list, shape, world: int, **kwargs) -> EPBuffer:
    """Collective: a new bf16 EPBuffer of a SHAPE_* (its kernels are the module buffer's)."""
    E, H, max_t, K = _shape(shape, world)
    return _new_buffer(buffers, E, H, max_t, K, DTYPE, **kwargs)


@pytest.fixture(scope="module")
def buf_a(dist_env):
    """The module's SHAPE_A buffer (default tiling), shared by the tests that need no other."""
    made: list[EPBuffer] = []
    yield _shape_buffer(made, SHAPE_A, dist_env.world)
    for buf in made:
        buf.free()


@pytest.fixture(scope="module")
def buf_b(dist_env):
    """The module's SHAPE_B buffer."""
    made: list[EPBuffer] = []
    yield _shape_buffer(made, SHAPE_B, dist_env.world)
    for buf in made:
        buf.free()


@pytest.fixture(scope="module")
def buf_c(dist_env):
    """The module's SHAPE_C buffer."""
    made: list[EPBuffer] = []
    yield _shape_buffer(made, SHAPE_C, dist_env.world)
    for buf in made:
        buf.free()


# ---------------------------------------------------------------------------------------------
# Inputs, reference and oracle (host-side, shared by no library code)


def _tokens(pattern: list[int], world: int) -> list[int]:
    """Tokens per rank: the pattern repeated over the ranks (whatever torchrun gives)."""
    return [pattern[r % len(pattern)] for r in range(world)]


def _experts(num_experts: int, world: int) -> int:
    """num_experts rounded up to a multiple of the world size (E must be one)."""
    return -(-num_experts // world) * world


def _make_inputs(W: int, tokens: list[int], H: int, E: int, K: int, dtype: torch.dtype, kind: str,
                 seed: int, drop: float = 0.0):
    """Every rank's (x, topk_idx, topk_weights), on the host, as rank_fns_ep.make_inputs."""
    xs, idxs, ws = [], [], []
    for r in range(W):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        xs.append(torch.randn(tokens[r], H, generator=g).to(dtype))
        idx, w = make_routing(tokens[r], E, K, kind, generator=g, drop_prob=drop, num_ranks=W)
        idxs.append(idx)
        ws.append(w)
    return xs, idxs, ws


def _scale_of(e: torch.Tensor) -> torch.Tensor:
    """The test's expert "FFN" is a per-expert scale 1 + (e mod 64) / 64 (0 for dropped slots).

    Exact in bf16, fp16 and fp32 (at most 8 significant bits), in [1, 2), and different for the
    experts of a token unless they agree mod 64, so a row returned to the wrong (t, k) shows.
    """
    e = e.to(torch.int64)
    return torch.where(e >= 0, 1.0 + (e.clamp(min=0) % 64).to(torch.float32) / 64.0,
                       torch.zeros((), dtype=torch.float32))


def _reference(xs, idxs, ws, rank: int, W: int, E: int) -> types.SimpleNamespace:
    """What `rank` must receive: rows of local expert e at offsets[e]:offsets[e+1], ordered by
    (source rank, source token, k); the routing weight of every row; per-expert counts."""
    e_local = E // W
    lo = rank * e_local
    K = idxs[0].shape[1]
    max_t = max([1] + [int(i.shape[0]) for i in idxs])
    src, tok, kk, ee = [], [], [], []
    for s, idx in enumerate(idxs):
        t, k = ((idx >= lo) & (idx < lo + e_local)).nonzero(as_tuple=True)
        src.append(torch.full_like(t, s))
        tok.append(t)
        kk.append(k)
        ee.append(idx[t, k])
    src, tok, kk, ee = (torch.cat(v).to(torch.int64) for v in (src, tok, kk, ee))
    order = torch.argsort((((ee - lo) * W + src) * max_t + tok) * K + kk)
    src, tok, kk, ee = src[order], tok[order], kk[order], ee[order]
    first = torch.tensor([0] + [int(i.shape[0]) for i in idxs]).cumsum(0)[:-1]
    g = first[src] + tok  # row of (source, token) in the concatenation of every rank's tokens
    counts = torch.bincount(ee - lo, minlength=e_local)  # ids lie in [lo, lo + e_local)
    return types.SimpleNamespace(
        rows=torch.cat(xs)[g], weights=torch.cat(ws)[g, kk].to(torch.float32), expert=ee, src=src, tok=tok,
        k=kk, n=int(ee.numel()), counts=counts.tolist(),
        offsets=[0] + counts.cumsum(0).tolist())


def _expert_forward(recv_x: torch.Tensor, expert: torch.Tensor, n_valid: int, dtype: torch.dtype) -> torch.Tensor:
    """y = x * scale(expert of the row) in fp32, cast once; rows past the valid extent get 0 scale."""
    scale = torch.zeros(recv_x.shape[0], dtype=torch.float32)
    c = min(n_valid, int(expert.numel()), recv_x.shape[0])
    scale[:c] = _scale_of(expert[:c])
    return (recv_x.to(torch.float32) * scale.to(recv_x.device)[:, None]).to(dtype)


def _combine_oracle(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 out[t] = sum_k w[t, k] * y(t, k), y(t, k) = dtype(x[t] * scale(e_k)) as the experts
    compute it (same fp32 product, same cast); dropped slots contribute nothing."""
    sc = _scale_of(idx).to(x.device)
    y = (x.to(torch.float32)[:, None, :] * sc[:, :, None]).to(dtype)
    valid = (idx >= 0).to(x.device)[:, :, None]
    y64 = torch.where(valid, y.to(torch.float64), torch.zeros((), dtype=torch.float64, device=x.device))
    return (w.to(torch.float64).to(x.device)[:, :, None] * y64).sum(dim=1)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    if a.device != b.device:
        b = b.to(a.device)
    return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


def _close(got: torch.Tensor, want64: torch.Tensor, rtol: float, atol: float,
           mag: torch.Tensor | None = None) -> tuple[bool, float]:
    """|got - want| <= atol + rtol * mag (mag = |want| by default), NaN/inf failing; (ok, max err)."""
    if got.shape != want64.shape:
        return False, float("inf")
    if got.numel() == 0:
        return True, 0.0
    g = got.detach().to(torch.float64).to(want64.device)
    err = (g - want64).abs()
    err = torch.where(torch.isfinite(g) & torch.isfinite(want64), err, torch.full_like(err, float("inf")))
    mag = want64.abs() if mag is None else mag
    return bool((err <= atol + rtol * mag).all()), float(err.max())


def _describe_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    bad = (got.to(torch.float64) != want.to(got.device).to(torch.float64))
    if got.dim() > 1:
        bad = bad.reshape(got.shape[0], -1).any(dim=1)
    rows = bad.nonzero().flatten()[:8].tolist()
    return f"{int(bad.sum())} of {got.shape[0]} rows differ (first: {rows})"


def _fail(problems: list[str]) -> str:
    more = f"\n... and {len(problems) - _MAX_PROBLEMS} more" if len(problems) > _MAX_PROBLEMS else ""
    return "\n".join(problems[:_MAX_PROBLEMS]) + more


# ---------------------------------------------------------------------------------------------
# Dispatch + combine: exact permutation, counts, weights, combine vs float64, reruns, graph mode


def _dispatch_combine_check(dev, buf: EPBuffer, tokens: list[int], kind: str, seed: int,
                            drop: float = 0.0) -> tuple[list[str], dict]:
    """Three dispatch+combine runs on `buf` (default, default again, graph mode), all checked.

    Returns (problems, {"recv_x", "out", "recv_w"}) of the first default-mode run, on the device.
    """
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K, dtype, max_t = buf.num_experts, buf.hidden, buf.topk, buf.dtype, buf.max_tokens
    xs, idxs, ws = _make_inputs(W, tokens, H, E, K, dtype, kind, seed, drop)
    ref = _reference(xs, idxs, ws, rank, W, E)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    problems: list[str] = []
    tag = (f"[programs={buf.num_programs} block_rows={buf.block_rows} slices={buf.n_slices} "
           f"block_hidden={buf.block_hidden}]")

    def run(sync: bool):
        recv_x, handle = buf.dispatch(x, idx, w, sync=sync)
        n = int(handle.expert_offsets[-1])
        y = _expert_forward(recv_x, ref.expert, n, dtype)
        out = buf.combine(y, handle, w)
        return recv_x, handle, n, out

    # ---- default mode
    recv_x, handle, n, out = run(True)
    if recv_x.shape != (ref.n, H) or recv_x.dtype != dtype or recv_x.device != x.device:
        problems.append(f"{tag} recv_x is {tuple(recv_x.shape)} {recv_x.dtype} on {recv_x.device}, "
                        f"want ({ref.n}, {H}) {dtype} on {x.device}")
    if n != ref.n or handle.num_rows != ref.n:
        problems.append(f"{tag} expert_offsets[-1] = {n}, num_rows = {handle.num_rows}, want {ref.n}")
    if not _bits_equal(recv_x, ref.rows):
        problems.append(f"{tag} recv_x differs from the reference permutation: "
                        f"{_describe_mismatch(recv_x, ref.rows)}")
    if handle.num_recv_per_expert.tolist() != ref.counts:
        problems.append(f"{tag} num_recv_per_expert {handle.num_recv_per_expert.tolist()} != {ref.counts}")
    if handle.expert_offsets.tolist() != ref.offsets:
        problems.append(f"{tag} expert_offsets {handle.expert_offsets.tolist()} != {ref.offsets}")
    if handle.grouped_mm_offs.tolist() != ref.offsets[1:]:
        problems.append(f"{tag} grouped_mm_offs {handle.grouped_mm_offs.tolist()} != {ref.offsets[1:]}")
    if handle.recv_weights is None or not _bits_equal(handle.recv_weights, ref.weights):
        problems.append(f"{tag} carried weights (handle.recv_weights) differ from the routing weights")
    exp = _combine_oracle(x, idx, w, dtype)
    if out.shape != (tokens[rank], H) or out.dtype != dtype:
        problems.append(f"{tag} combine out is {tuple(out.shape)} {out.dtype}, want ({tokens[rank]}, {H}) {dtype}")
    else:
        rtol, atol = TOLERANCES[dtype]
        ok, max_err = _close(out, exp, rtol, atol)
        if not ok:
            problems.append(f"{tag} combine off the float64 oracle by up to {max_err:.3e} (rtol={rtol}, atol={atol})")

    # ---- run to run: bitwise identical
    recv_x2, handle2, n2, out2 = run(True)
    if not (n2 == n and _bits_equal(recv_x2, recv_x) and _bits_equal(out2, out)
            and handle2.recv_weights is not None and handle.recv_weights is not None
            and _bits_equal(handle2.recv_weights, handle.recv_weights)):
        problems.append(f"{tag} a second default-mode run differs bitwise from the first")

    # ---- graph mode (sync=False): capacity rows, valid extent on the device, same bits
    recv_g, handle_g, n_g, out_g = run(False)
    cap = W * max_t * K
    if recv_g.shape != (cap, H) or handle_g.num_rows is not None or handle_g.rows_cap != cap:
        problems.append(f"{tag} graph mode: recv_x {tuple(recv_g.shape)}, num_rows {handle_g.num_rows}, "
                        f"rows_cap {handle_g.rows_cap}; want ({cap}, {H}), None, {cap}")
    if n_g != n or handle_g.expert_offsets.tolist() != handle.expert_offsets.tolist():
        problems.append(f"{tag} graph mode: expert_offsets {handle_g.expert_offsets.tolist()} != default "
                        f"{handle.expert_offsets.tolist()}")
    elif not _bits_equal(recv_g[:n], recv_x):
        problems.append(f"{tag} graph mode: valid rows differ from default mode: "
                        f"{_describe_mismatch(recv_g[:n], recv_x)}")
    elif handle_g.recv_weights is None or not _bits_equal(handle_g.recv_weights[:n], ref.weights):
        problems.append(f"{tag} graph mode: carried weights differ")
    if not _bits_equal(out_g, out):
        problems.append(f"{tag} graph mode: combine output differs bitwise from default mode")
    return problems, {"recv_x": recv_x, "out": out, "recv_w": handle.recv_weights}


CASES = [  # (name, shape, tokens per rank (pattern), routing, drop_prob); buffers of 320 / 512 / 384 tokens
    ("uniform", "A", [311, 61, 250, 187], "uniform", 0.0),
    ("zipf-empty-rank", "A", [250, 0, 123, 61], "zipf", 0.1),
    ("one_expert", "A", [187, 189, 190, 191], "one_expert", 0.0),
    ("one_rank", "A", [123, 61, 250, 59], "one_rank", 0.0),
    ("drops-empty-rank", "A", [123, 0, 61, 187], "uniform", 0.3),
    ("heavy-drops", "A", [61, 59, 0, 123], "zipf", 0.5),
    ("large", "B", [512, 505, 500, 511], "zipf", 0.05),  # the buffer's capacity on rank 0
    ("large-empty-rank", "B", [123, 0, 61, 187], "uniform", 0.3),
    ("top1", "C", [187, 123, 311, 61], "uniform", 0.1),
]


def _case_id(c) -> str:
    E, H, _, K = _SHAPES[c[1]]
    return f"{c[0]}-T{max(c[2])}-H{H}-E{E}-K{K}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_dispatch_combine(dist_env, request, case):
    name, shape, pattern, kind, drop = case
    buf = request.getfixturevalue(f"buf_{shape.lower()}")
    problems, _ = _dispatch_combine_check(dist_env.device, buf, _tokens(pattern, dist_env.world), kind,
                                          seed=CASES.index(case) + 1, drop=drop)
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# Determinism across grid sizes (and chunk size)

# (num_programs, block_rows, hidden_slices, block_hidden) after the SHAPE_B module buffer's
# defaults (every SM; two column slices per chunk). These grid sizes keep its kernels (their
# lags fall in the same specialisation classes). Grids of 1 program, other chunk sizes, column
# steps and slicings compile more kernels: emulated ranks
# (tests/ops/ep/test_ep_dispatch_combine.py::test_grid_chunk_and_slice_sizes_do_not_change_bits).
GRID_CONFIGS = [(33, 16, None, None), (9, 16, None, None)]


def _grid_check(dev, buffers: list, base_buf: EPBuffer, tokens, kind, drop, seed) -> list[str]:
    problems, base = _dispatch_combine_check(dev, base_buf, tokens, kind, seed, drop)
    for programs, block, slices, block_h in GRID_CONFIGS:
        buf = _new_buffer(buffers, base_buf.num_experts, base_buf.hidden, base_buf.max_tokens, base_buf.topk,
                          base_buf.dtype, num_programs=programs, block_rows=block, hidden_slices=slices,
                          block_hidden=block_h)
        probs, res = _dispatch_combine_check(dev, buf, tokens, kind, seed, drop)
        problems += probs
        for key in ("recv_x", "out", "recv_w"):
            if res[key] is None or base[key] is None or not _bits_equal(res[key], base[key]):
                problems.append(f"{key} with num_programs={programs}, block_rows={block}, hidden_slices={slices}, "
                                f"block_hidden={block_h} differs bitwise from the defaults")
    return problems


def test_grid_sizes_do_not_change_bits(dist_env, ep_buffers, buf_b):
    problems = _grid_check(dist_env.device, ep_buffers, buf_b, _tokens([311, 61, 0, 187], dist_env.world), "zipf",
                           0.1, seed=100)
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# CUDA graph: capture dispatch -> elementwise -> combine once, replay with new routings

REPLAY_ROUTINGS = [("uniform", 0.0), ("zipf", 0.0), ("one_rank", 0.0), ("one_expert", 0.0), ("uniform", 0.5),
                   ("zipf", 0.2), ("uniform", 0.0)]


def _cuda_graph_capture(step):
    """Capture `step()` in a CUDA graph; returns (its outputs: static tensors, replay, graph)."""
    torch.cuda.synchronize()
    gc.collect()  # nothing (an earlier test's symmetric arena) may be freed during the capture
    graph = torch.cuda.CUDAGraph()
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            statics = step()
    finally:
        gc.enable()
    return statics, graph.replay, graph


def _graph_capture_check(dev, buf: EPBuffer, tokens: list[int], seed: int,
                         capture=_cuda_graph_capture) -> list[str]:
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K, dtype = buf.num_experts, buf.hidden, buf.topk, buf.dtype
    T = tokens[rank]
    problems: list[str] = []
    x_s = torch.zeros(T, H, dtype=dtype, device=dev)
    idx_s = torch.full((T, K), -1, dtype=torch.int64, device=dev)
    w_s = torch.zeros(T, K, dtype=torch.float32, device=dev)

    def load(i: int):
        kind, drop = REPLAY_ROUTINGS[i % len(REPLAY_ROUTINGS)]
        xs, idxs, ws = _make_inputs(W, tokens, H, E, K, dtype, kind, seed * 100 + i, drop)
        x_s.copy_(xs[rank])
        idx_s.copy_(idxs[rank])
        w_s.copy_(ws[rank])
        return xs, idxs, ws

    def step():
        recv_x, handle = buf.dispatch(x_s, idx_s, w_s, sync=False)
        y = recv_x * 2
        out = buf.combine(y, handle, w_s)
        return recv_x, handle.expert_offsets, handle.recv_weights, out

    load(0)
    step()  # eager warm-up in graph mode: compiles the kernels, no collective host work left
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    call0 = buf.heap.call_number
    statics, replay, graph = capture(step)
    if buf.heap.call_number != call0:
        problems.append(f"capture ran kernels: call {call0} -> {buf.heap.call_number}")
    recv_g, off_g, w_g, out_g = statics
    rows_seen = []
    n_replays = len(REPLAY_ROUTINGS)
    for i in range(1, n_replays + 1):
        xs, idxs, ws = load(i)
        replay()
        n = int(off_g[-1])
        rows_seen.append(n)
        # eager default mode on the same (static) inputs
        recv_e, h_e = buf.dispatch(x_s, idx_s, w_s)
        out_e = buf.combine(recv_e * 2, h_e, w_s)
        ref = _reference(xs, idxs, ws, rank, W, E)
        what = f"replay {i} ({REPLAY_ROUTINGS[i % len(REPLAY_ROUTINGS)]})"
        if h_e.expert_offsets.tolist() != ref.offsets or not _bits_equal(recv_e, ref.rows):
            problems.append(f"{what}: eager dispatch differs from the reference permutation")
        if n != h_e.num_rows or off_g.tolist() != h_e.expert_offsets.tolist():
            problems.append(f"{what}: replayed expert_offsets {off_g.tolist()} != eager {h_e.expert_offsets.tolist()}")
            continue
        if not _bits_equal(recv_g[:n], recv_e):
            problems.append(f"{what}: replayed recv_x differs from eager: {_describe_mismatch(recv_g[:n], recv_e)}")
        if w_g is None or h_e.recv_weights is None or not _bits_equal(w_g[:n], h_e.recv_weights):
            problems.append(f"{what}: replayed carried weights differ from eager")
        if not _bits_equal(out_g, out_e):
            problems.append(f"{what}: replayed combine output differs bitwise from eager default mode")
    if rank == 0 and len(set(rows_seen)) < 2:
        problems.append(f"the replays did not change the received row count ({rows_seen}): test inputs too uniform")
    call = buf.heap.call_number
    want_call = (call0 + 4 * n_replays + 2**31) % 2**32 - 2**31  # replay: dispatch and combine, eager: the same
    if call != want_call:
        problems.append(f"call number after {n_replays} replays + eager calls is {call}, want {want_call}")
    try:
        buf.check()
        buf.heap.check_error()
    except Exception as err:
        problems.append(f"after the replays: {type(err).__name__}: {err}")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    del replay, graph, statics, recv_g, off_g, w_g, out_g
    return problems


GRAPH_CASES = [[187, 123, 250, 61], [61, 0, 123, 59]]  # tokens per rank (pattern), on the SHAPE_A buffer


@pytest.mark.parametrize("pattern", GRAPH_CASES, ids=[f"T{max(c)}-{'empty-rank' if 0 in c[:2] else 'ragged'}"
                                                      for c in GRAPH_CASES])
def test_cuda_graph_replays_follow_new_routings(dist_env, buf_a, pattern):
    problems = _graph_capture_check(dist_env.device, buf_a, _tokens(pattern, dist_env.world),
                                    seed=200 + GRAPH_CASES.index(pattern))
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# Gradients: dispatch -> per-expert scale -> combine, vs float64 autograd


def _gradient_check(dev, buf: EPBuffer, tokens: list[int], kind: str, seed: int, sync: bool) -> list[str]:
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K, dtype = buf.num_experts, buf.hidden, buf.topk, buf.dtype
    xs, idxs, ws = _make_inputs(W, tokens, H, E, K, dtype, kind, seed, drop=0.1)
    ref = _reference(xs, idxs, ws, rank, W, E)
    idx = idxs[rank].to(dev)
    g = torch.Generator().manual_seed(seed + 77 + rank)
    upstream = torch.randn(tokens[rank], H, generator=g).to(dtype).to(dev)
    problems: list[str] = []

    def run():
        x = xs[rank].to(dev).clone().requires_grad_(True)
        w = ws[rank].to(dev).clone().requires_grad_(True)
        # the weights ride along (their gradient comes from combine alone): the weighted dispatch's kernels
        recv_x, handle = buf.dispatch(x, idx, w.detach(), sync=sync)
        n = int(handle.expert_offsets[-1])
        scale = torch.zeros(recv_x.shape[0], dtype=torch.float32)
        c = min(n, ref.n, recv_x.shape[0])
        scale[:c] = _scale_of(ref.expert[:c])
        y = recv_x * scale.to(dev)[:, None].to(dtype)
        out = buf.combine(y, handle, w)
        (out.to(torch.float32) * upstream.to(torch.float32)).sum().backward()
        return out.detach(), x.grad, w.grad, n

    out, gx, gw, n = run()
    if n != ref.n:
        problems.append(f"received {n} rows, want {ref.n}")
    # float64 oracle: out[t] = sum_k w[t, k] * scale(e_k) * x[t]
    x64 = xs[rank].to(dev).to(torch.float64).clone().requires_grad_(True)
    w64 = ws[rank].to(dev).to(torch.float64).clone().requires_grad_(True)
    sc = _scale_of(idx).to(torch.float64)
    u64 = upstream.to(torch.float64)
    ((w64 * sc).sum(dim=1, keepdim=True) * x64 * u64).sum().backward()
    # Bounds scale with the sum of the magnitudes of the terms each gradient adds up (K terms for
    # x, H terms for w): every term carries a few roundings of the dtype, with 4x margin.
    rtol, atol = TOLERANCES[dtype]
    with torch.no_grad():
        mag_x = (w64.abs() * sc).sum(dim=1, keepdim=True) * u64.abs()
        mag_w = sc * (u64.abs() * x64.abs()).sum(dim=1, keepdim=True)
    if gx is None or gw is None:
        problems.append(f"no gradient: x.grad {'set' if gx is not None else None}, "
                        f"w.grad {'set' if gw is not None else None}")
    else:
        ok, err = _close(gx, x64.grad, 4 * rtol, 4 * atol, mag_x)
        if not ok or gx.dtype != dtype:
            problems.append(f"dispatch backward (x.grad, {gx.dtype}) off the float64 oracle by up to {err:.3e}")
        ok, err = _close(gw, w64.grad, 4 * rtol, 4 * atol, mag_w)
        if not ok or gw.dtype != torch.float32:
            problems.append(f"combine weight gradient (w.grad, {gw.dtype}) off the float64 oracle by up to {err:.3e}")
        if not bool((gw[idx < 0] == 0).all()):
            problems.append("w.grad of dropped slots is not 0")
        out2, gx2, gw2, _ = run()
        if not (_bits_equal(out2, out) and gx2 is not None and _bits_equal(gx2, gx)
                and gw2 is not None and _bits_equal(gw2, gw)):
            problems.append("a second forward + backward differs bitwise from the first")
    return problems


GRAD_CASES = [  # (tokens pattern, routing, sync), on the SHAPE_A buffer; fp32 and empty ranks: emulated ranks
    ([250, 123, 187, 61], "uniform", True),
    ([61, 187, 123, 250], "zipf", False),
]


@pytest.mark.parametrize("case", GRAD_CASES,
                         ids=[f"T{max(c[0])}-{c[1]}-{'default' if c[2] else 'graph'}" for c in GRAD_CASES])
def test_gradients(dist_env, buf_a, case):
    pattern, kind, sync = case
    problems = _gradient_check(dist_env.device, buf_a, _tokens(pattern, dist_env.world), kind,
                               seed=300 + GRAD_CASES.index(case), sync=sync)
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# No torch.distributed collective on the data path

_COLLECTIVES = ["all_to_all_single", "all_to_all", "all_gather", "all_gather_object", "all_reduce", "broadcast",
                "broadcast_object_list", "send", "recv", "isend", "irecv", "reduce", "reduce_scatter", "gather",
                "gather_object", "scatter", "scatter_object_list", "barrier", "monitored_barrier",
                "all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv", "new_group"]


def _no_collectives_check(dev, buf: EPBuffer) -> list[str]:
    """buf: built before (its set-up is collective)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, K, T = buf.num_experts, buf.hidden, buf.topk, 61
    xs, idxs, ws = _make_inputs(W, [T] * W, H, E, K, buf.dtype, "uniform", seed=5)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    problems: list[str] = []
    called: list[str] = []
    modules = [dist, torch.distributed.distributed_c10d]
    saved = [(m, n, getattr(m, n)) for m in modules for n in _COLLECTIVES if hasattr(m, n)]

    def forbid(name):
        def forbidden(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"torch.distributed.{name} was called during dispatch/combine")
        return forbidden

    out = out_g = None
    try:
        for m, n, _ in saved:
            setattr(m, n, forbid(n))
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)
        recv_x, handle = buf.dispatch(xg, idx, wg)
        out = buf.combine(recv_x, handle, wg)
        out.to(torch.float32).sum().backward()
        recv_g, handle_g = buf.dispatch(x, idx, w, sync=False)
        out_g = buf.combine(recv_g, handle_g, w)
        buf.check()
    except Exception as err:  # recorded: every rank takes the same path
        problems.append(f"{type(err).__name__}: {err}")
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
    if called:
        problems.append(f"collectives called on the data path: {sorted(set(called))}")
    if out is not None and out_g is not None and not _bits_equal(out.detach(), out_g):
        problems.append("graph-mode combine differs from default mode")
    return problems


def test_no_collectives_on_the_data_path(dist_env, buf_a):
    problems = _no_collectives_check(dist_env.device, buf_a)
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# Replayed layouts (graph_cache): the bits of direct launches, handles valid past later replays


_SLEEP_CYCLES = 2_000_000  # torch.cuda._sleep: ~1 ms at an H200's clock


def _replayed_layout_check(dev, buffers: list, calls: int = 5) -> list[str]:
    """A buffer that replays its default-mode layout from a CUDA graph (from a signature's second
    call on) against one launching directly, `calls` dispatches per mode with fresh routings at
    the same T. Every handle is combined only after all of its mode's dispatches (the replays
    rewrote the graph's buffers meanwhile): rows, offsets and combine bitwise equal to the direct
    buffer's and the rows exact against the reference. Before every other cached call the stream
    sleeps ~1 ms, so a host that read the status before the replay finished would size recv_x from
    the previous call's. Graph mode never replays. Then bad expert ids on a replayed call raise on
    every rank, a graph-mode call with them raises at `check()`, and a valid replay is right."""
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, _, K = _shape(SHAPE_A, W)
    dtype = DTYPE
    tokens = _tokens([61, 123, 0, 59], W)
    direct = _shape_buffer(buffers, SHAPE_A, W, graph_cache=0)
    cached = _shape_buffer(buffers, SHAPE_A, W, graph_cache=2)
    problems: list[str] = []

    def inputs(seed: int, bad: bool = False):
        xs, idxs, ws = _make_inputs(W, tokens, H, E, K, dtype, "uniform", seed)
        if bad and tokens[0]:
            idxs[0][tokens[0] // 2, 1] = E + 7  # rank 0's slot out of range
        return xs, idxs, ws

    for sync in (True, False):
        runs: dict[str, list] = {"direct": [], "cached": []}
        refs = []
        for i in range(calls):
            xs, idxs, ws = inputs(300 + 10 * i + int(sync))
            refs.append((_reference(xs, idxs, ws, rank, W, E), xs[rank], idxs[rank], ws[rank]))
            for name, buf in (("direct", direct), ("cached", cached)):
                args = (xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
                if name == "cached" and i % 2 and dev.type == "cuda":
                    torch.cuda._sleep(_SLEEP_CYCLES)  # the replay (and its status copy) runs late
                recv_x, handle = buf.dispatch(*args, sync=sync)
                runs[name].append((recv_x, handle))
        for i, ((rx_d, h_d), (rx_c, h_c), (ref, x, idx, w)) in enumerate(zip(runs["direct"], runs["cached"], refs)):
            tag = f"{'default' if sync else 'graph'} mode call {i}"
            n = int(h_c.expert_offsets[-1])
            if n != ref.n or not _bits_equal(rx_c[:n], ref.rows):
                problems.append(f"{tag}: replayed rows wrong: {n} rows, want {ref.n}")
            if not (_bits_equal(rx_c[:n], rx_d[:n]) and _bits_equal(h_c.expert_offsets, h_d.expert_offsets)
                    and _bits_equal(h_c.send.slot, h_d.send.slot)):
                problems.append(f"{tag}: replayed layout or rows differ from direct launches")
            y_c = _expert_forward(rx_c, ref.expert, n, dtype)
            y_d = _expert_forward(rx_d, ref.expert, n, dtype)
            out_c = cached.combine(y_c, h_c, w.to(dev))
            out_d = direct.combine(y_d, h_d, w.to(dev))
            if not _bits_equal(out_c, out_d):
                problems.append(f"{tag}: combine along a replayed handle differs: {_describe_mismatch(out_c, out_d)}")
            ok, err = _close(out_c, _combine_oracle(x.to(dev), idx, w, dtype), *TOLERANCES[dtype])
            if not ok:
                problems.append(f"{tag}: combine off the float64 oracle by {err:.3g}")
    if dev.type == "cuda" and len(cached._layouts) != 1:  # CUDA graphs need a GPU: elsewhere none
        problems.append(f"expected one captured layout (default mode), found {len(cached._layouts)}")

    xs, idxs, ws = inputs(999, bad=True)
    try:
        cached.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
        problems.append("a replayed default-mode call with a bad expert id did not raise")
    except RoutingError as err:
        if "ranks 0" not in str(err):
            problems.append(f"RoutingError does not name rank 0: {err}")
    cached.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev), sync=False)
    try:
        cached.check()
        problems.append("a graph-mode call with a bad expert id was not recorded")
    except RoutingError:
        pass
    xs, idxs, ws = inputs(1001)
    ref = _reference(xs, idxs, ws, rank, W, E)
    recv_x, handle = cached.dispatch(xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev))
    if not _bits_equal(recv_x, ref.rows):
        problems.append("a valid replayed call after the bad ones received the wrong rows")
    return problems


def test_replayed_layouts_give_the_bits_of_direct_launches(dist_env, ep_buffers):
    problems = _replayed_layout_check(dist_env.device, ep_buffers)
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors on every rank, before any token moves; graph mode records them


def _error_check(dev, buffers: list) -> list[str]:
    """On new SHAPE_A buffers (the module buffer's kernels): every one of T tokens goes to experts
    0..K-1, all on rank 0, so rank 0 receives T * K rows from every rank, and an unweighted
    combine of the unchanged rows gives K * x, exact in bf16. The only unweighted dispatch of the
    module (the other tests carry weights: one set of kernels)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    E, H, max_t, K = _shape(SHAPE_A, W)
    dtype = DTYPE
    assert E // W >= K, "experts 0..K-1 must all live on rank 0"
    buf = _shape_buffer(buffers, SHAPE_A, W)
    g = torch.Generator().manual_seed(11 + rank)
    T = 61
    x = torch.randn(T, H, generator=g).to(dtype).to(dev)
    idx = torch.arange(K, dtype=torch.int64, device=dev).repeat(T, 1)  # experts 0..K-1: all on rank 0
    k_times_x = (x.float() * K).to(dtype)  # the unweighted combine of the unchanged rows
    bad_rank = 1 if W > 1 else 0
    res: dict[str, str] = {}

    def catch(key, fn, exc=DitronConfigError):
        try:
            fn()
            res[key] = "no error"
        except exc as err:
            res[key] = f"{type(err).__name__}: {err}"
        except Exception as err:  # the wrong exception type is a failure too (recorded, not raised)
            res[key] = f"wrong exception {type(err).__name__}: {err}"

    bad_idx = idx.clone()
    if rank == bad_rank:
        bad_idx[2, 1] = E + 3
    catch("bad_expert", lambda: buf.dispatch(x, bad_idx), RoutingError)
    neg_idx = idx.clone()
    if rank == bad_rank:
        neg_idx[4, 0] = -2
    catch("negative_expert", lambda: buf.dispatch(x, neg_idx.to(torch.int32)), RoutingError)
    big = torch.randn(max_t + 1 if rank == 0 else 4, H, generator=g).to(dtype).to(dev)
    catch("too_many", lambda: buf.dispatch(big, torch.zeros(big.shape[0], K, dtype=torch.int64, device=dev)),
          CapacityError)
    # graph mode: recorded (the offending slot dropped), raised by the next host-visible call
    graph_rows = -1
    try:
        recv_g, handle_g = buf.dispatch(x, bad_idx, sync=False)
        graph_rows = int(handle_g.expert_offsets[-1])
        res["graph_dispatch"] = "no error"
    except Exception as err:
        res["graph_dispatch"] = f"{type(err).__name__}: {err}"
    catch("graph_then_check", buf.check, RoutingError)
    catch("after_check_clean", buf.check, RoutingError)
    # host-side argument checks (no kernel, no collective)
    catch("hidden", lambda: buf.dispatch(torch.randn(T, H + 1, device=dev).to(dtype), idx))
    catch("dtype", lambda: buf.dispatch(x.to(torch.float16), idx))
    catch("topk_shape", lambda: buf.dispatch(x, idx[:, :1]))
    catch("idx_dtype", lambda: buf.dispatch(x, idx.float()))
    catch("non_contig", lambda: buf.dispatch(torch.randn(H, T, device=dev).to(dtype).t(), idx))
    if dev.type != "cpu":
        catch("x_on_cpu", lambda: buf.dispatch(x.cpu(), idx))
        catch("idx_on_cpu", lambda: buf.dispatch(x, idx.cpu()))
    catch("weights_shape", lambda: buf.dispatch(x, idx, torch.ones(T, K + 1, device=dev)))
    # a bad argument on one rank only: it joins the counts exchange flagged, its peers raise at once
    catch("one_rank_bad_x", lambda: buf.dispatch(torch.randn(T, H + 1, device=dev).to(dtype) if rank == bad_rank
                                                 else x, idx))
    if W > 1:
        catch("experts_not_multiple", lambda: EPBuffer(None, E + 1, H, max_t, K, dtype))
    catch("topk_too_large", lambda: EPBuffer(None, E, H, max_t, E + 1, dtype))
    if W > 1:  # a bad argument on one rank only: every rank raises, none waits in the heap set-up
        catch("one_rank_bad", lambda: EPBuffer(None, E, H, max_t, K, dtype,
                                               block_hidden=24 if rank == W - 1 else None))
    # recovery: a valid call works and is right (out = K * x: exact in bf16)
    recovered = None
    for attempt in range(2):
        try:
            recv_x, handle = buf.dispatch(x, idx)
            recovered = (recv_x, handle)
            break
        except Exception as err:
            res[f"valid_dispatch_{attempt}"] = f"{type(err).__name__}: {err}"
    if recovered is not None:
        recv_x, handle = recovered
        catch("y_rows", lambda: buf.combine(recv_x[:-1].contiguous() if recv_x.shape[0] else
                                            torch.zeros(1, H, device=dev), handle))
        catch("bad_handle", lambda: buf.combine(recv_x, object()))
        # one rank's y only: it takes part in the combine's barrier flagged (primitives.flagged_call_kernel)
        catch("one_rank_bad_y", lambda: buf.combine(recv_x.double() if rank == bad_rank else recv_x, handle))
        out = buf.combine(recv_x, handle)
        res["recovered_rows"] = str(recv_x.shape[0])
        res["recovered_exact"] = str(_bits_equal(out, k_times_x))
    # the same one-rank y where the peers do not read the refusal at once (check_errors=False):
    # their next counts exchange carries it (FLAG_UNREAD), so every rank raises there; the call
    # after is exact
    lax = _shape_buffer(buffers, SHAPE_A, W, check_errors=False)
    r_l, h_l = lax.dispatch(x, idx)
    catch("lax_bad_y", lambda: lax.combine(r_l.double() if rank == bad_rank else r_l, h_l))
    catch("lax_next", lambda: lax.dispatch(x, idx))
    r_l, h_l = lax.dispatch(x, idx)
    res["lax_exact"] = str(_bits_equal(lax.combine(r_l, h_l), k_times_x))

    problems = []
    want_rows = (T * K * W - 1 if rank == 0 else 0)
    expect = {
        "bad_expert": ["RoutingError", f"(ranks {bad_rank})", str(E)],
        "negative_expert": ["RoutingError", f"(ranks {bad_rank})"],
        "too_many": ["CapacityError", f"needed {max_t + 1}", "(ranks 0)", f"max_tokens_per_rank={max_t}"],
        "graph_dispatch": ["no error"],
        "graph_then_check": ["RoutingError"],
        "after_check_clean": ["no error"],
        "hidden": ["DitronConfigError", f"hidden={H}"],
        "dtype": ["DitronConfigError", "float16"],
        "topk_shape": ["DitronConfigError", "topk_idx"],
        "idx_dtype": ["DitronConfigError", "int32 or int64"],
        "non_contig": ["DitronConfigError", "contiguous"],
        "weights_shape": ["DitronConfigError", "topk_weights"],
        "topk_too_large": ["DitronConfigError", "topk"],
        "y_rows": ["DitronConfigError", "rows"],
        "bad_handle": ["DitronConfigError", "handle"],
        "recovered_rows": [str(T * K * W if rank == 0 else 0)],
        "recovered_exact": ["True"],
    }
    lone = rank == bad_rank
    expect["one_rank_bad_x"] = ["DitronConfigError"] + ([f"hidden={H}"] if lone else
                                                       [f"rank(s) {bad_rank} rejected their own arguments"])
    expect["one_rank_bad_y"] = ["DitronConfigError"] + (["y must be bfloat16"] if lone else
                                                       [f"rank(s) {bad_rank} rejected their own arguments"])
    expect["lax_bad_y"] = ["DitronConfigError", "y must be bfloat16"] if lone else ["no error"]
    expect["lax_next"] = (["no error"] if W == 1 else ["DitronConfigError", "held an error of an earlier call"] if lone
                          else ["DitronConfigError", f"rank(s) {bad_rank} rejected their own arguments"])
    expect["lax_exact"] = ["True"]
    if dev.type != "cpu":
        expect["x_on_cpu"] = ["DitronConfigError", "cpu"]
        expect["idx_on_cpu"] = ["DitronConfigError", "cpu"]
    if W > 1:
        expect["experts_not_multiple"] = ["DitronConfigError", "multiple of the world size"]
        expect["one_rank_bad"] = ["DitronConfigError", "block_hidden", f"on rank(s) {W - 1}"]
    for key, words in expect.items():
        got = res.get(key, "(not reached)")
        if not all(wd in got for wd in words):
            problems.append(f"{key}: {got!r} lacks one of {words}")
    if graph_rows != want_rows:
        problems.append(f"graph-mode dispatch with rank {bad_rank}'s bad slot dropped received {graph_rows} rows, "
                        f"want {want_rows}")
    for attempt in range(2):
        if f"valid_dispatch_{attempt}" in res:
            problems.append(f"a valid dispatch after the errors raised (attempt {attempt}): "
                            f"{res[f'valid_dispatch_{attempt}']}")
    return problems


def test_bad_input_raises_on_every_rank(dist_env, ep_buffers):
    problems = _error_check(dist_env.device, ep_buffers)
    assert not problems, f"rank {dist_env.rank}:\n" + _fail(problems)


def _functional_tokens(T: int, hidden: int, E: int, K: int, g: torch.Generator, dev):
    """(x bf16 [T, hidden], topk_idx [T, K] of distinct experts, weights [T, K]) on dev, from g."""
    x = torch.randn(T, hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    return x, idx, torch.rand(T, K, generator=g).to(dev)


def _functional_round_trip_problem(x, idx, w, E: int, what: str) -> str | None:
    """ops.dispatch (weights carried along) then ops.combine of the rows unchanged must give
    sum_k w[t, k] * x[t] (bf16 tolerance); else the problem, named by `what`."""
    from ditron_ep.ops import combine, dispatch
    recv_x, handle = dispatch(x, idx, w, num_experts=E)
    out = combine(recv_x, handle, w, num_experts=E)
    ref = (w.sum(dim=1, keepdim=True) * x.float()).to(torch.bfloat16)
    if torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2):
        return None
    return f"{what} off by {float((out.float() - ref.float()).abs().max()):.3g}"


def _functional_T(rank: int) -> int:
    """Tokens of a functional call: the buffer it sizes (the largest T) has SHAPE_A's 320 tokens."""
    return SHAPE_A[2] if rank == 0 else 61


def test_functional_first_call_disagreement_raises_on_every_rank(dist_env):
    """The first ops.dispatch builds the group's buffer (one collective): ranks passing different
    hidden sizes, or a rank passing a 3-D x, raise on every rank at once naming it; matching
    calls after that are right."""
    import time

    from ditron_ep.ops import clear_cache, dispatch
    dev, rank, world = dist_env.device, dist.get_rank(), dist.get_world_size()
    E, hidden, _, K = _shape(SHAPE_A, world)
    g = torch.Generator().manual_seed(31 + rank)
    problems = []
    clear_cache()
    x_bad = torch.randn(8, hidden + 64 * rank, generator=g).to(torch.bfloat16).to(dev)
    idx_bad = torch.randint(0, E, (8, K), generator=g).to(dev)
    x, idx, w = _functional_tokens(_functional_T(rank), hidden, E, K, g, dev)
    for what, call, want in (
            ("hidden", lambda: dispatch(x_bad, idx_bad, num_experts=E), f"hidden: rank 0 {hidden}, rank 1 {hidden + 64}"),
            ("3-D x", lambda: dispatch(x[None] if rank == world - 1 else x, idx, num_experts=E), "x must be a 2-D")):
        t0 = time.monotonic()
        try:
            call()
            problems.append(f"{what}: did not raise")
        except DitronConfigError as err:
            if want not in str(err):
                problems.append(f"{what}: unexpected message: {err}")
        if time.monotonic() - t0 > 10:
            problems.append(f"{what}: raised after {time.monotonic() - t0:.0f} s")
    if problem := _functional_round_trip_problem(x, idx, w, E, "dispatch + combine"):
        problems.append(problem)
    torch.cuda.synchronize()
    clear_cache()
    assert not problems, f"rank {rank}: {problems}"


def test_one_rank_errors_raise_everywhere_and_heal_a_captured_graph(dist_env, buf_a):
    """On the GPU, with a CUDA graph of dispatch + combine (graph mode) captured first: the last
    rank passes x of another dtype; after a first ops.dispatch it passes another hidden size;
    it skips a call (rank 0 alone times out; the last rank arrives late). Every rank raises (the
    refusals at once, naming the rank and what differs), and after each, with no reset, both an
    eager call and a replay of the graph captured before the errors are bitwise right."""
    import time

    from ditron_ep.ops import clear_cache, dispatch

    dev, rank, W = dist_env.device, dist.get_rank(), dist.get_world_size()
    buf, bad = buf_a, W - 1
    E, H, K, T = buf.num_experts, buf.hidden, buf.topk, 64
    xs, idxs, ws = _make_inputs(W, [T] * W, H, E, K, buf.dtype, "uniform", 7)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    ref = _reference(xs, idxs, ws, rank, W, E)

    def step():
        recv_x, handle = buf.dispatch(x, idx, w, sync=False)
        return recv_x, handle.expert_offsets, buf.combine(recv_x, handle, w)

    step()
    torch.cuda.synchronize()
    (recv_g, off_g, out_g), replay, graph = _cuda_graph_capture(step)
    recv_e, h_e = buf.dispatch(x, idx, w)
    out_e = buf.combine(recv_e, h_e, w)
    problems: list[str] = []
    seen: dict[str, tuple[str, float]] = {}  # scenario -> (this rank's error, seconds): the closing note's table

    def healed(after: str) -> None:
        replay()
        recv_e, h_e = buf.dispatch(x, idx, w)
        out_now = buf.combine(recv_e, h_e, w)
        n = int(off_g[-1])
        if n != len(ref.rows) or not _bits_equal(recv_g[:n], ref.rows) or not _bits_equal(out_g, out_e):
            problems.append(f"after {after}: the graph's replay is not exact")
        if not _bits_equal(recv_e, ref.rows) or not _bits_equal(out_now, out_e):
            problems.append(f"after {after}: the eager call is not exact")

    def expect(what, call, rank_wants, within_s=10.0):
        t0 = time.monotonic()
        try:
            call()
            got = "no error"
        except Exception as err:  # noqa: BLE001 - every rank's error is checked
            got = f"{type(err).__name__}: {err}"
        took = time.monotonic() - t0
        seen[what] = (got[:160], round(took, 3))
        if rank_wants and not all(wd in got for wd in rank_wants):
            problems.append(f"{what}: {got!r} lacks one of {rank_wants}")
        if took > within_s:
            problems.append(f"{what}: took {took:.1f} s")
        return got

    healed("capture")
    expect("dtype", lambda: buf.dispatch(x.float() if rank == bad else x, idx, w),
           ["x must be bfloat16"] if rank == bad else [f"rank(s) {bad} rejected their own arguments", "dtype:"])
    healed("a wrong dtype")
    x2, idx2, w2 = _functional_tokens(61, H, E, K, torch.Generator().manual_seed(3 + rank), dev)
    dispatch(x2, idx2, w2, num_experts=E)
    x3 = torch.randn(61, H + 64, device=dev).to(torch.bfloat16)
    expect("functional hidden", lambda: dispatch(x3 if rank == bad else x2, idx2, num_experts=E),
           [f"hidden: rank 0 {H}", f"rank {bad} {H + 64}"])
    if problem := _functional_round_trip_problem(x2, idx2, w2, E, "functional call after another hidden size"):
        problems.append(problem)
    clear_cache()
    healed("another hidden size")
    budget = buf.heap.wait_budget
    if rank == 0:
        buf.heap.wait_budget = 1 << 18
        expect("skipped (alone)", lambda: buf.dispatch(x, idx, w), ["DitronTimeoutError", "for rank 1 to arrive"],
               within_s=30.0)
        buf.heap.wait_budget = budget
    dist.barrier()
    if rank != 0:
        expect("skipped (late)", lambda: buf.dispatch(x, idx, w), ["DitronOutOfStepError", "given up"])
    healed("a skipped call")
    del graph
    if os.environ.get("DITRON_AGREEMENT_LOG"):
        with open(f"{os.environ['DITRON_AGREEMENT_LOG']}.rank{rank}", "w") as f:
            json.dump(seen, f, indent=1)
    assert not problems, f"rank {rank}: {problems}"


# ---------------------------------------------------------------------------------------------
# The rank-reduced combine (topk_sum="expert_rank")


@pytest.mark.parametrize("partial_dtype", [None, torch.float32], ids=["bf16-partials", "fp32-partials"])
def test_rank_reduced_combine(dist_env, buf_a, partial_dtype):
    """Identity experts: within the dtype's rtol of the float64 oracle, bit for bit run to run and in
    graph mode, its y gradient equal to the exact combine's. (Its sequential schedule, bit for bit,
    is tested on emulated ranks: compiled kernels fuse the weight's multiply-add.)"""
    dev, rank, W = dist_env.device, dist.get_rank(), dist.get_world_size()
    E, H, K = buf_a.num_experts, buf_a.hidden, buf_a.topk
    tokens = _tokens([320, 0, 64, 256], W)  # cdiv(T, 16) % 4 == 0: the compiled variants of the other tests
    xs, idxs, ws = _make_inputs(W, tokens, H, E, K, DTYPE, "zipf", seed=41, drop=0.1)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    problems: list[str] = []
    try:
        recv_x, h = buf_a.dispatch(x, idx, w)
        out = buf_a.combine(recv_x, h, topk_sum="expert_rank", partial_dtype=partial_dtype)
        again = buf_a.combine(recv_x, h, topk_sum="expert_rank", partial_dtype=partial_dtype)
        recv_g, h_g = buf_a.dispatch(x, idx, w, sync=False)
        graph = buf_a.combine(recv_g, h_g, topk_sum="expert_rank", partial_dtype=partial_dtype)
        buf_a.check()
        if not (_bits_equal(out, again) and _bits_equal(out, graph)):
            problems.append("not bit for bit run to run / in graph mode")
        oracle = x.double() * torch.where(idx >= 0, w.double(), 0.0).sum(1)[:, None]
        if oracle.numel():
            err = ((out.double() - oracle).abs().max() / oracle.abs().max().clamp_min(1e-30)).item()
            if err > TOLERANCES[DTYPE][0]:
                problems.append(f"off the float64 oracle by {err:.2e} (relative)")
        # gradients of y: the exact combine's, bit for bit
        grads = []
        for mode in ("expert_rank", "token_rank"):
            y = recv_x.detach().clone().requires_grad_(True)
            o = buf_a.combine(y, h, None if mode == "expert_rank" else w, topk_sum=mode,
                              partial_dtype=partial_dtype if mode == "expert_rank" else None)
            (o.float() * (x.float() + 1)).sum().backward()
            grads.append(y.grad)
        if not _bits_equal(grads[0], grads[1]):
            problems.append("y's gradient differs from the exact combine's")
    except Exception as err:  # recorded: every rank takes the same path
        problems.append(f"{type(err).__name__}: {err}")
    assert not problems, f"rank {rank}:\n" + _fail(problems)


# ---------------------------------------------------------------------------------------------
# The token-major receive layout (dispatch(layout="token_major"))


def test_token_major_dispatch(dist_env, buf_a):
    """recv_x[row_index] is the expert-major layout bit for bit (rows, offsets, weights), in default
    and graph mode; combine(topk_sum="caller") of the rows as they arrived is x times the ranks
    reached, in both modes; the gradient of x (rank-ordered sum of its rows' gradients) is bitwise
    reproducible and within the dtype's tolerance of float64."""
    dev, rank, W = dist_env.device, dist.get_rank(), dist.get_world_size()
    E, H, K = buf_a.num_experts, buf_a.hidden, buf_a.topk
    tokens = _tokens([320, 0, 64, 256], W)
    xs, idxs, ws = _make_inputs(W, tokens, H, E, K, DTYPE, "uniform", seed=43, drop=0.1)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    problems: list[str] = []
    try:
        tok, h = buf_a.dispatch(x, idx, w, layout="token_major")
        rows, he = buf_a.dispatch(x, idx, w)
        if not (_bits_equal(tok[h.row_index.long()], rows) and torch.equal(h.expert_offsets, he.expert_offsets)
                and _bits_equal(h.recv_weights, he.recv_weights)):
            problems.append("recv_x[row_index] differs from the expert-major layout")
        tok_g, h_g = buf_a.dispatch(x, idx, w, sync=False, layout="token_major")
        buf_a.check()
        if not _bits_equal(tok_g[:tok.shape[0]], tok):
            problems.append("graph mode's token rows differ")
        # combine(topk_sum="caller") of the token rows as they arrived: x times the ranks each token
        # reached, added in fp32 and cast once; in graph mode along the graph handle too
        reached = ranks_reached(idx, E, W)[:, None].float()
        want = torch.where(reached > 0, x.float() * reached, 0.0).to(x.dtype)  # +0.0 where every slot dropped
        if not _bits_equal(buf_a.combine(tok, h, topk_sum="caller"), want):
            problems.append("combine(topk_sum='caller') differs from x times the ranks reached")
        out_g = buf_a.combine(tok_g, h_g, topk_sum="caller")
        buf_a.check()
        if not _bits_equal(out_g, want):
            problems.append("graph mode's combine(topk_sum='caller') differs")
        grads = []
        for _ in range(2):
            xg = x.clone().requires_grad_(True)
            t2, _h = buf_a.dispatch(xg, idx, w, layout="token_major")
            (t2.float() * torch.linspace(-1, 1, t2.shape[0], device=dev)[:, None]).sum().backward()
            grads.append(xg.grad)
        if not _bits_equal(grads[0], grads[1]):
            problems.append("x's gradient differs between two runs")
    except Exception as err:  # recorded: every rank takes the same path
        problems.append(f"{type(err).__name__}: {err}")
    assert not problems, f"rank {rank}:\n" + _fail(problems)


def _count_whole_calls(buf: EPBuffer) -> list[bool]:
    """A list that gets, per `buf._whole_call` from now on, whether that call replayed whole (the
    caller deletes the instance attribute to stop counting)."""
    calls: list[bool] = []
    plain = buf._whole_call

    def counted(*a, **kw):
        r = plain(*a, **kw)
        calls.append(r is not None)
        return r
    buf._whole_call = counted
    return calls


def test_whole_calls_replay_the_bits_of_direct_launches(dist_env, ep_buffers):
    """A small buffer replays default-mode calls whole (EPBuffer._whole_call: inputs copied in,
    layout and data kernel in one graph), in both layouts. Across calls of changing T (one capture
    per power-of-two rows; a rank with no tokens), with and without weights, and with 5 handles of
    one signature held at once (its 3 copies run out: the later calls launch as usual), every
    output -- rows, row_index, weights, offsets -- and the combine along each handle equal a
    buffer that never captures (graph_cache=0), bit for bit; the whole-call graphs did replay."""
    dev, rank, W = dist_env.device, dist.get_rank(), dist.get_world_size()
    E, H, max_t, K = _shape(SHAPE_A, W)
    # room for every signature below (4 a layout, 1 more): a full cache would not evict a recent one
    whole = _new_buffer(ep_buffers, E, H, max_t, K, DTYPE, graph_cache=12)
    direct = _new_buffer(ep_buffers, E, H, max_t, K, DTYPE, graph_cache=0)
    problems: list[str] = []
    replayed = _count_whole_calls(whole)

    def inputs(pattern, seed):
        xs, idxs, ws = _make_inputs(W, _tokens(pattern, W), H, E, K, DTYPE, "zipf", seed=seed, drop=0.1)
        return xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)

    def both(x, idx, w, layout, what):
        got = whole.dispatch(x, idx, w, layout=layout)
        want = direct.dispatch(x, idx, w, layout=layout)
        (rx, h), (rx_d, h_d) = got, want
        same_index = (h.row_index is None) == (h_d.row_index is None) and (
            h.row_index is None or torch.equal(h.row_index, h_d.row_index))
        if not (_bits_equal(rx, rx_d) and same_index and torch.equal(h.expert_offsets, h_d.expert_offsets)
                and h.num_rows == h_d.num_rows and (w is None or _bits_equal(h.recv_weights, h_d.recv_weights))):
            problems.append(f"{what}: the whole-call replay's outputs differ from direct launches")
        return got, want

    def combined(got, want, w, what):
        (rx, h), (rx_d, h_d) = got, want
        y = rx if h.row_index is None else rx[h.row_index.long()]
        y_d = rx_d if h_d.row_index is None else rx_d[h_d.row_index.long()]
        if not _bits_equal(whole.combine(y, h, w), direct.combine(y_d, h_d, w)):
            problems.append(f"{what}: combine along the replayed handle differs")

    try:
        for layout in ("token_major", "expert_major"):
            replayed.clear()
            # the third pattern: fewer tokens on every rank for the first's signatures (rows past T
            # route nowhere; the copy's x rows past T hold an earlier call's tokens)
            for i, pattern in enumerate([[123, 59, 187, 61], [61, 0, 123, 59], [113, 50, 180, 49]] * 2):
                x, idx, w = inputs(pattern, 60 + i)
                w_grad = w.clone().requires_grad_(True)  # the static copy must stay out of its graph
                for weights in (w_grad, None):
                    what = f"{layout} call {i} (T={x.shape[0]}, {'weighted' if weights is not None else 'unweighted'})"
                    combined(*both(x, idx, weights, layout, what), None if weights is None else w, what)
            x, idx, w = inputs([123, 59, 187, 61], 70)
            held = [both(x, idx, w, layout, f"{layout} held call {j}") for j in range(5)]
            for j, (got, want) in enumerate(held):
                combined(got, want, w, f"{layout} held handle {j}")
            del held
            fits = whole._whole_fits[layout == "token_major"]
            if fits and (sum(replayed) < 8 or replayed[-5:].count(True) != 3):
                # 4 signatures seen 3 times or more (the first call of each launches); then 5 handles
                # of one signature held: its 3 copies replay, the other 2 calls launch as usual
                problems.append(f"{layout}: {sum(replayed)} of {len(replayed)} calls replayed whole, of the 5 with "
                                f"handles held {replayed[-5:]}: want >= 8, and 3 of 5")
            if not fits and any(replayed):
                problems.append(f"{layout}: replayed whole though its rows at capacity exceed WHOLE_CALL_BYTES")
        statics = [t for r in whole._calls._entries.values() for c in r.copies for t in c.inputs]
        if any(t.requires_grad for t in statics):
            problems.append("a whole call's static input joined an autograd graph")
        # a signature captured under inference mode replays outside it (its statics are normal tensors)
        x, idx, w = inputs([250, 250, 250, 250], 80)
        with torch.inference_mode():
            for j in range(2):
                both(x, idx, w, "token_major", f"inference-mode call {j}")
        n = len(replayed)
        combined(*both(x, idx, w, "token_major", "after inference mode"), w, "after inference mode")
        if whole._whole_fits[True] and replayed[n:] != [True]:
            problems.append(f"the signature captured under inference mode did not replay outside it: calls "
                            f"{replayed[n - 2:]}, whole-call cache capacity {whole._calls.capacity}")
        # without check_errors no whole call (a timed-out call must leave "no row" for a combine)
        whole.check_errors = False
        n = len(replayed)
        combined(*both(x, idx, w, "token_major", "check_errors=False"), w, "check_errors=False")
        whole.check_errors = True
        if len(replayed) != n:
            problems.append("a call with check_errors=False tried a whole-call replay")
        whole.check()
        direct.check()
    except Exception as err:  # recorded: every rank takes the same path
        problems.append(f"{type(err).__name__}: {err}")
    finally:
        del whole._whole_call
    assert not problems, f"rank {rank}:\n" + _fail(problems)


def test_an_error_a_kernel_records_raises_from_its_own_call(dist_env, buf_a):
    """An error recorded by a call's kernel (a timeout, stood in for by setting the error flag on
    the stream after the call's launches, on every rank) raises DitronTimeoutError from that call
    in both dispatch layouts (the token-major one reads its layout's status and the kernel's error
    words in one wait, replayed whole from a graph from a signature's second call) and from
    combine; the read consumes it, and the next call gives the bits of a clean one."""
    from ditron_ep.runtime import DitronTimeoutError
    from ditron_ep.runtime import control as C

    dev, rank, W = dist_env.device, dist.get_rank(), dist.get_world_size()
    E, H, K = buf_a.num_experts, buf_a.hidden, buf_a.topk
    xs, idxs, ws = _make_inputs(W, _tokens([123, 59, 187, 61], W), H, E, K, DTYPE, "uniform", seed=47)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    problems: list[str] = []
    heap = buf_a.heap

    def fails(what, call):
        """call() with the flag set right before the call's error-slot read (once), as its kernel
        would have set it; it must raise."""
        def read():
            del heap.host_words  # one shot
            heap._ctrl[C.ERR_FLAG] = 1
            return heap.host_words()
        heap.host_words = read
        try:
            call()
            problems.append(f"{what}: the recorded error did not raise")
        except DitronTimeoutError:
            pass
        finally:
            heap.__dict__.pop("host_words", None)

    wholes = _count_whole_calls(buf_a)
    try:
        clean = {layout: buf_a.dispatch(x, idx, w, layout=layout) for layout in ("expert_major", "token_major")}
        clean_out = buf_a.combine(clean["expert_major"][0], clean["expert_major"][1])
        for layout in ("token_major", "expert_major", "token_major", "token_major"):
            fails(f"{layout} dispatch", lambda: buf_a.dispatch(x, idx, w, layout=layout))
            again, _h = buf_a.dispatch(x, idx, w, layout=layout)
            if not _bits_equal(again, clean[layout][0]):
                problems.append(f"{layout} dispatch after the error: rows differ from a clean call")
        recv, h = buf_a.dispatch(x, idx, w)
        fails("combine", lambda: buf_a.combine(recv, h))
        if not _bits_equal(buf_a.combine(recv, h), clean_out):
            problems.append("combine after the error differs from a clean call")
        buf_a.check()
    except Exception as err:  # recorded: every rank takes the same path
        problems.append(f"{type(err).__name__}: {err}")
    finally:
        del buf_a._whole_call
    if buf_a._whole_fits[False] and sum(wholes) < 5:  # every dispatch after a signature's first
        problems.append(f"only {sum(wholes)} of the {len(wholes)} dispatches replayed whole: the whole-call "
                        f"path went untested")
    assert not problems, f"rank {rank}:\n" + _fail(problems)


def test_fp8_dispatch_into_the_grouped_gemm(dist_env, ep_buffers):
    """FP8 dispatch (SHAPE_B's hidden, a multiple of 128): the token-major e4m3 rows and scales are the
    sender's bytes; grouped_mlp(x_scales=) on them (dequantised in the A-load) is bit for bit
    grouped_mlp over the dispatch(dequantize=True) rows, on the portable path."""
    from ditron_ep.ops.ep.buffer import quantize_fp8
    from ditron_ep.ops.moe_layer.grouped import grouped_mlp

    dev, rank, W = dist_env.device, dist.get_rank(), dist.get_world_size()
    E, H, max_t, K = _shape(SHAPE_B, W)
    tokens = _tokens([500, 0, 123, 311], W)
    xs, idxs, ws = _make_inputs(W, tokens, H, E, K, DTYPE, "uniform", seed=47, drop=0.1)
    x, idx, w = xs[rank].to(dev), idxs[rank].to(dev), ws[rank].to(dev)
    problems: list[str] = []
    try:
        buf = _new_buffer(ep_buffers, E, H, max_t, K, DTYPE, dispatch_dtype=torch.float8_e4m3fn)
        q, sc = quantize_fp8(x)
        tok, h = buf.dispatch(q, idx, w, x_scales=sc, layout="token_major")
        deq, hd = buf.dispatch(q, idx, w, x_scales=sc, dequantize=True, layout="token_major")
        want = (tok.float() * h.recv_scales.repeat_interleave(128, dim=1)).to(DTYPE)
        if not _bits_equal(deq, want):
            problems.append("dequantize=True rows differ from e4m3 x scale (fp32, cast once)")
        g = torch.Generator().manual_seed(5)
        el = E // W
        w1 = (torch.randn(el, H, 2 * 256, generator=g) / H ** 0.5).to(DTYPE).to(dev)
        w2 = (torch.randn(el, 256, H, generator=g) / 16).to(DTYPE).to(dev)
        y8 = grouped_mlp(tok, h.expert_offsets, w1, w2, row_index=h.row_index, x_scales=h.recv_scales)
        y = grouped_mlp(deq, hd.expert_offsets, w1, w2, row_index=hd.row_index, path="portable")
        if not _bits_equal(y8, y):
            problems.append("grouped_mlp(x_scales=) differs from it on the dequantised rows")
    except Exception as err:  # recorded: every rank takes the same path
        problems.append(f"{type(err).__name__}: {err}")
    assert not problems, f"rank {rank}:\n" + _fail(problems)


def test_tuned_copy_tiling_on_gpus(dist_env):
    """tune_ep_copy on CUDA ranks (CUDA-graph timing; two candidates, one shared cache file):
    one choice on every rank, and an EPBuffer with the tiling unset takes it, with the default
    buffer's bits."""
    from ditron_ep.compiler import tuner

    rank, dev = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    E, H, T, K = 16, 1024, 256, 4
    path = f"/tmp/ditron_ep_copy_tune_{os.getppid()}.json"  # torchrun's agent: the same on every rank
    cands = (tuner.EPCopyConfig(16, 1024, 16), tuner.EPCopyConfig(32, 512, 8))
    chosen = tuner.tune_ep_copy(None, E, H, T, K, torch.bfloat16, candidates=cands, reps=3, cache=tuner.TuneCache(path))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, str(chosen))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    outs = {}
    for name, kw in (("default", {"block_rows": 16}), ("tuned", {})):
        os.environ[tuner.CACHE_ENV] = path
        try:
            buf = EPBuffer(None, E, H, T, K, torch.bfloat16, **kw)
            r, h = buf.dispatch(x, idx, w)
            outs[name] = (r, buf.combine(r, h, w), buf.tuned_copy)
            buf.free()
        finally:
            os.environ.pop(tuner.CACHE_ENV, None)
    dist.barrier()
    if rank == 0:
        os.remove(path)
    assert len(set(every)) == 1, every
    assert outs["tuned"][2] == chosen and outs["default"][2] is None, (outs["tuned"][2], chosen)
    assert torch.equal(outs["tuned"][0], outs["default"][0]) and torch.equal(outs["tuned"][1], outs["default"][1])
