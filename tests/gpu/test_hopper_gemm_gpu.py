"""The Hopper path of the expert GEMMs (Gluon: TMA, mbarriers, async wgmma) on each rank's own
GPU, under torchrun (tests/gpu/run_gpu_suite.sh). No collectives: every rank runs the same checks
on its GPU, so plain asserts are safe.

Forward and backward of grouped_mlp(path="hopper") for every activation against float64 autograd
(ragged experts, empty experts, rows past the last expert, rows not a multiple of the tile), bitwise
equal run to run and for every grid size (its sequential schedule: one program); the warp-
specialized variant bitwise equal to the plain one (same tiles, same K order); a dense GEMM (one
expert) against float64; the tuner's search writing a cache that grouped_mlp(path="auto") then
follows. Shapes are small (H=256, I=192): each distinct specialisation compiles once (~1 s).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ditron_ep  # noqa: F401
from ditron_ep.compiler import tuner
from ditron_ep.compiler.core_config import default_gemm_configs
from ditron_ep.ops.moe_layer import hopper_path
from ditron_ep.ops.moe_layer.experts import ACTIVATIONS, width_factor
from ditron_ep.ops.moe_layer.grouped import grouped_mlp, kernel_choices
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map

H, I = 256, 192
SIZES = [0, 1, 130, 257, 64]   # an empty expert, a 1-row expert, ragged ones
EXTRA = 7                      # rows past the last expert: zero outputs, no gradient


def _act(z: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("swiglu", "geglu"):
        g, u = z.chunk(2, dim=-1)
        return (F.silu(g) if name == "swiglu" else F.gelu(g)) * u
    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu,
            "silu": F.silu}[name](z)


def _case(activation: str, sizes=SIZES, extra=EXTRA, seed=0):
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes) + extra
    n = width_factor(activation)
    off = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    x = torch.randn(rows, H, generator=g).to(dev, torch.bfloat16)
    w1 = (torch.randn(len(sizes), H, n * I, generator=g) / H ** 0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(len(sizes), I, H, generator=g) / I ** 0.5).to(dev, torch.bfloat16)
    dy = torch.randn(rows, H, generator=g).to(dev, torch.bfloat16)
    return x, off, w1, w2, dy


def _run(x, off, w1, w2, dy, activation, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    y = grouped_mlp(leaves[0], off, leaves[1], leaves[2], activation=activation, path="hopper", **kw)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in leaves)]


def _oracle(x, off, w1, w2, dy, activation):
    leaves = [t.double().requires_grad_() for t in (x, w1, w2)]
    xd, w1d, w2d = leaves
    outs = [_act(xd[off[e]:off[e + 1]] @ w1d[e], activation) @ w2d[e] for e in range(w1.shape[0])]
    y = torch.cat(outs + [xd.new_zeros(x.shape[0] - int(off[-1]), x.shape[1])])
    y.backward(dy.double())
    return [y.detach(), *(t.grad for t in leaves)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_hopper_path_matches_float64_and_is_bitwise_stable(activation):
    case = _case(activation)
    got = _run(*case, activation)
    want = _oracle(*case, activation)
    valid = int(case[1][-1])
    for name, a, b in zip(("y", "dx", "dw1", "dw2"), got, want):
        if name == "dx":
            a, b = a[:valid], b[:valid]
        assert torch.isfinite(a).all(), f"{activation} {name}: non-finite values"
        assert _rel(a, b) < 2e-2, f"{activation} {name}: rel err {_rel(a, b):.2e}"
    assert torch.equal(got[0][valid:], torch.zeros_like(got[0][valid:])), "rows past the experts must be zero"
    for programs in (1, 7, None):  # one program = the sequential schedule of the tiles
        again = _run(*case, activation, num_programs=programs)
        assert all(torch.equal(a, b) for a, b in zip(got, again)), f"{activation}: bits moved (programs={programs})"


def test_all_experts_empty_and_one_big_expert():
    for sizes, extra in (([0, 0, 0], 5), ([300], 0), ([2000, 0, 3, 900, 1], 129)):
        case = _case("swiglu", sizes, extra, seed=3)
        got, want = _run(*case, "swiglu"), _oracle(*case, "swiglu")
        valid = int(case[1][-1])
        for name, a, b in zip(("y", "dx", "dw1", "dw2"), got, want):
            if name == "dx":
                a, b = a[:valid], b[:valid]
            if b.numel() and b.abs().max() > 0:
                assert _rel(a, b) < 2e-2, f"{sizes} {name}: rel err {_rel(a, b):.2e}"
            else:
                assert torch.count_nonzero(a) == 0, f"{sizes} {name}: expected zeros"


def test_warp_specialized_kernels_equal_the_plain_ones():
    case = _case("swiglu", seed=5)
    plain = _run(*case, "swiglu")
    hopper_path.WARP_SPECIALIZED = True
    try:
        ws = _run(*case, "swiglu")
    finally:
        hopper_path.WARP_SPECIALIZED = False
    assert all(torch.equal(a, b) for a, b in zip(plain, ws))


def test_dense_gemm_is_one_expert():
    dev = torch.device("cuda", torch.cuda.current_device())
    for m, k, n in ((1000, 512, 384), (128, 256, 256)):
        a = torch.randn(m, k, device=dev).to(torch.bfloat16)
        b = (torch.randn(k, n, device=dev) / k ** 0.5).to(torch.bfloat16)
        c = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
        off = torch.tensor([0, m], dtype=torch.int32, device=dev)
        cfg = hopper_path.default_hopper_configs()["down"]
        hopper_path.launch_down(a, b[None], c, off, build_tile_map(off, cfg.block_m), cfg, 132)
        assert _rel(c, a.double() @ b.double()) < 1e-2


def test_tuner_search_is_followed_by_auto(tmp_path):
    x, off, w1, w2, _ = _case("swiglu", [512, 384, 640], 0, seed=9)
    cache = tuner.TuneCache(tmp_path / "tuned.json")
    log: list[str] = []
    chosen = tuner.tune_grouped_mlp(x, off, w1, w2, reps=3, cache=cache, log=log.append)
    assert set(chosen) == set(tuner.KERNELS)
    assert any(line.startswith("up hopper:") for line in log), log
    tuned = tuner.tuned_choices(x.dtype, x.device, rows=x.shape[0], hidden=H, inter=I, num_local=3, cache=cache)
    assert tuned == chosen
    tuner._CACHES[cache.path] = cache
    import os
    old = os.environ.get(tuner.CACHE_ENV)
    os.environ[tuner.CACHE_ENV] = str(cache.path)
    try:
        got = kernel_choices("auto", x, w1, w2, None, 3, 0, default_gemm_configs(x.dtype, "cuda"))
    finally:
        if old is None:
            del os.environ[tuner.CACHE_ENV]
        else:
            os.environ[tuner.CACHE_ENV] = old
    assert got == chosen
