"""Grouped expert MLPs under the Triton interpreter: float64 oracle, ragged experts (empty, one
expert holding every row), gathered rows, rows past the last expert, grid-size independence,
every activation with and without biases forward and backward, bad input, tile configs, and
NVIDIA's default tiles compiling for sm_90."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditron_ep.check import assert_close_to_oracle
from ditron_ep.compiler.core_config import DEVICE_TYPES, GemmTileConfig, default_gemm_configs
from ditron_ep.ops.moe_layer.experts import expert_activation, width_factor
from ditron_ep.ops.moe_layer.grouped import grouped_mlp, launch_grouped_down, launch_grouped_up
from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map
from ditron_ep.ops.moe_layer.naive import ep_moe_oracle

REPO = Path(__file__).resolve().parents[3]


def make_inputs(sizes: list[int], H: int, I: int, *, rows: int | None = None, n_x: int | None = None,
                dtype: torch.dtype = torch.float32, seed: int = 0, activation: str = "swiglu") -> dict:
    """Expert-major rows: expert e owns `sizes[e]` rows; `rows` >= sum(sizes) is the output capacity.
    With `n_x`, rows are gathered from x [n_x, H] through a row_index with repeats."""
    g = torch.Generator().manual_seed(seed)
    E, total = len(sizes), sum(sizes)
    rows = total if rows is None else rows
    offsets = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int32)
    row_index = None
    if n_x is not None:
        row_index = torch.randint(0, n_x, (rows,), generator=g, dtype=torch.int32)
        if rows:
            row_index[1::3] = row_index[0]  # repeats, within and across experts
    x = torch.randn(n_x if n_x is not None else rows, H, generator=g).to(dtype)
    w1 = (torch.randn(E, H, width_factor(activation) * I, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, I, H, generator=g) / I**0.5).to(dtype)
    return {"x": x, "expert_offsets": offsets, "w1": w1, "w2": w2, "row_index": row_index}


def oracle(inp: dict) -> torch.Tensor:
    """float64 y [rows, H] from the single-process MoE oracle: one rank, top-1, weight 1, row r routed
    to its expert (rows past the last expert are dropped slots, hence zero)."""
    x, off, row_index = inp["x"], inp["expert_offsets"].tolist(), inp["row_index"]
    rows = x.shape[0] if row_index is None else row_index.shape[0]
    expert = torch.full((rows, 1), -1, dtype=torch.int64)
    for e in range(len(off) - 1):
        expert[off[e]:off[e + 1]] = e
    x_rows = x if row_index is None else x[row_index.long()]
    return ep_moe_oracle([x_rows], [expert], [torch.ones(rows, 1)], [inp["w1"]], [inp["w2"]])[0]


CASES = {  # id: (sizes, H, I, rows, n_x, dtype, config)
    "empty-expert": ([13, 0, 27], 48, 24, None, None, torch.float32, None),  # ragged in every dim
    "one-expert-all-rows": ([0, 40, 0], 48, 24, None, None, torch.float32, None),
    "capacity-past-last-expert": ([5, 11, 3], 48, 24, 30, None, torch.float32, None),
    "gather-repeats": ([7, 9, 4, 0, 12], 48, 24, 37, 25, torch.float32, None),
    "block-multiples": ([16, 16, 16], 64, 32, None, None, torch.float32, None),
    "E1-gather": ([37], 40, 20, None, 11, torch.float32, None),
    "E17-sparse": ([3, 0, 0, 9, 1, 0, 0, 0, 5, 0, 2, 0, 0, 4, 0, 0, 6], 40, 20, None, None, torch.float32, None),
    "fp16-gather": ([13, 0, 27], 48, 24, None, 29, torch.float16, None),
    "BM32-gather": ([21, 2, 17], 48, 24, 45, 31, torch.float32,  # rows not a multiple of BM = 32
                    (GemmTileConfig(32, 16, 16, 4, 1), GemmTileConfig(32, 64, 32, 4, 1))),
    "no-rows-routed": ([0, 0, 0], 48, 24, 8, None, torch.float32, None),
    # I below the gate-up block: the [gate | up] weight tile of width 2*BN is mostly masked columns
    "I-below-block": ([13, 0, 27], 48, 8, None, 29, torch.float32, None),
}


@pytest.mark.parametrize("sizes,H,I,rows,n_x,dtype,config", CASES.values(), ids=CASES.keys())
def test_matches_float64_oracle(sizes, H, I, rows, n_x, dtype, config):
    inp = make_inputs(sizes, H, I, rows=rows, n_x=n_x, dtype=dtype)
    y = grouped_mlp(**inp, config=config)
    want = oracle(inp)
    assert y.dtype == dtype
    assert_close_to_oracle(y, want, dtype, f"grouped FFN {sizes}")
    assert torch.equal(y[sum(sizes):], torch.zeros_like(y[sum(sizes):]))


def test_unwritten_rows_poisoned_with_nan():
    """The gate-up kernel leaves h rows past the last expert untouched; the down kernel zeroes them in y."""
    inp = make_inputs([5, 0, 11, 3], 48, 24, rows=30, n_x=17)
    gate_up, down = default_gemm_configs(torch.float32, "cpu")
    h = torch.full((30, 24), float("nan"))
    y = torch.full((30, 48), float("nan"))
    off = inp["expert_offsets"]
    launch_grouped_up(inp["x"], inp["row_index"], inp["w1"], h, off, build_tile_map(off, gate_up.block_m),
                          gate_up, 2, "ieee", 2)
    assert torch.isfinite(h[:19]).all(), "a row of an expert was not written"
    assert torch.isnan(h[19:]).all(), "rows past the last expert were written"
    launch_grouped_down(h, inp["w2"], y, off, build_tile_map(off, down.block_m), down, 2, "ieee", 3)
    assert torch.equal(y[19:], torch.zeros(11, 48))
    assert_close_to_oracle(y, oracle(inp), torch.float32, "poisoned launch")


def test_out_buffer_is_written_and_returned():
    inp = make_inputs([6, 0, 9], 48, 24, rows=20)
    out = torch.full((20, 48), float("nan"))
    assert grouped_mlp(**inp, out=out) is out
    assert_close_to_oracle(out, oracle(inp), torch.float32, "out=")


@pytest.mark.parametrize("offsets", [[0, 10, 50], [-5, 10, 12], [0, 30, 4]], ids=["past-capacity", "negative",
                                                                                 "decreasing"])
def test_bad_offsets_never_write_outside_the_rows(offsets):
    """check=False uses the offsets as given; the kernels still clamp every tile to [0, rows)."""
    inp = {**make_inputs([10, 10], 16, 8), "expert_offsets": torch.tensor(offsets, dtype=torch.int32)}
    canvas = torch.full((26, 16), float("nan"))
    grouped_mlp(**inp, out=canvas[3:23], check=False)
    assert torch.isnan(canvas[:3]).all() and torch.isnan(canvas[23:]).all()


def test_grid_size_and_tile_order_do_not_change_bits():
    """Grid sizes and tile orders (groups of 1 = M-tile major, 2 with a short last group, 3, all
    M-tiles in one group, the per-kernel choice of None: groups of 8 on 3 programs, 1 on 1000)
    give the same bits, and each equals the oracle."""
    inp = make_inputs([13, 0, 27, 1, 40], 48, 24, rows=90, n_x=23, seed=3)  # 7 M-tiles of 16 rows
    runs = [grouped_mlp(**inp, num_programs=p, group_rows=g) for p, g in
            ((1, 1), (3, 1), (1000, 1), (3, 2), (2, 3), (3, 7), (1, 100), (3, None), (1000, None))]
    assert_close_to_oracle(runs[0], oracle(inp), torch.float32, "group_rows=1")
    for y in runs[1:]:
        assert torch.equal(y, runs[0])


def test_no_rows():
    inp = make_inputs([0, 0], 16, 8, n_x=4)
    assert grouped_mlp(**inp).shape == (0, 16)


def test_build_tile_map():
    off = torch.tensor([0, 13, 13, 40, 41], dtype=torch.int32)
    assert build_tile_map(off, 16).tolist() == [0, 1, 1, 3, 4]
    assert build_tile_map(off, 64).dtype == torch.int32


def _float64_mlp(inp: dict, activation: str, b1, b2, grad_y: torch.Tensor) -> tuple:
    """float64 y and autograd gradients through a plain per-expert loop (no kernel code)."""
    x, w1, w2 = (inp[k].to(torch.float64).requires_grad_() for k in ("x", "w1", "w2"))
    b1, b2 = (None if b is None else b.to(torch.float64).requires_grad_() for b in (b1, b2))
    off = inp["expert_offsets"].tolist()
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in range(len(off) - 1):
        z = x[off[e]:off[e + 1]] @ w1[e] + (0 if b1 is None else b1[e])
        rows = expert_activation(z, activation) @ w2[e] + (0 if b2 is None else b2[e])
        y = y.index_add(0, torch.arange(off[e], off[e + 1]), rows)
    y.backward(grad_y.to(torch.float64))
    return y.detach(), [t.grad if t is not None else None for t in (x, w1, w2, b1, b2)]


GRAD_CASES = {  # id: (sizes, H, I, rows, activation, biases)
    "swiglu-empty-expert": ([13, 0, 27], 48, 24, None, "swiglu", False),
    "swiglu-capacity-bias": ([5, 11, 3], 48, 24, 30, "swiglu", True),  # rows past the last expert: zero gradient
    "geglu-bias": ([13, 0, 27], 40, 24, None, "geglu", True),
    "gelu-bias-one-expert": ([0, 40, 0], 48, 20, None, "gelu", True),
    "gelu_tanh": ([7, 9, 4, 0, 12], 40, 24, 37, "gelu_tanh", False),
    "relu-bias": ([13, 0, 27], 48, 24, None, "relu", True),
    "silu-bias-E1": ([37], 40, 20, None, "silu", True),
    "no-rows-routed": ([0, 0, 0], 48, 24, 8, "gelu", True),
}


@pytest.mark.parametrize("sizes,H,I,rows,activation,biases", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_activations_forward_and_gradients_match_float64(sizes, H, I, rows, activation, biases):
    """Every expert MLP with and without biases: y and every gradient against float64 autograd with
    a random upstream gradient; saved or recomputed pre-activation, any grid: the same bits."""
    inp = make_inputs(sizes, H, I, rows=rows, seed=3, activation=activation)
    g = torch.Generator().manual_seed(5)
    width = inp["w1"].shape[2]
    b1, b2 = (torch.randn(len(sizes), width, generator=g), torch.randn(len(sizes), H, generator=g)) if biases \
        else (None, None)
    grad_y = torch.randn(inp["x"].shape[0], H, generator=torch.Generator().manual_seed(4))
    names = ("x", "w1", "w2", "b1", "b2")
    runs = []
    for save, programs in ((True, 1), (True, 1), (False, 3)):
        leaves = [None if t is None else t.clone().requires_grad_() for t in (inp["x"], inp["w1"], inp["w2"], b1, b2)]
        y = grouped_mlp(leaves[0], inp["expert_offsets"], leaves[1], leaves[2], b1=leaves[3], b2=leaves[4],
                        activation=activation, save_preactivation=save, num_programs=programs)
        y.backward(grad_y)
        runs.append([y.detach()] + [None if t is None else t.grad for t in leaves])
    y_ref, grads_ref = _float64_mlp(inp, activation, b1, b2, grad_y)
    assert_close_to_oracle(runs[0][0], y_ref, torch.float32, f"{activation} forward")
    for name, got, want in zip(names, runs[0][1:], grads_ref):
        if want is None:
            continue
        err, ref = float((got.double() - want).abs().max()), float(want.abs().max())
        assert err <= 1e-5 * max(ref, 1.0), f"grad {name}: off float64 by {err} (max {ref})"
    for other in runs[1:]:
        assert all(a is None or torch.equal(a, b) for a, b in zip(runs[0], other)), "backward passes differ"
    assert not runs[0][1][sum(sizes):].any(), "rows past the last expert got a gradient"


def test_partial_gradients_and_the_output_gradient_freed_before_the_first_gemm(monkeypatch):
    """Asking for one gradient at a time gives the bits of that gradient in the full backward; and
    the output's gradient (rows x H) is freed before the first GEMM's backward allocates dx and
    dW1 (two autograd nodes: the step's peak memory)."""
    import weakref

    from ditron_ep.ops.moe_layer import grouped as grouped_mod

    inp = make_inputs([6, 0, 11], 32, 16, seed=12)
    g = torch.Generator().manual_seed(13)
    b1, b2 = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    scale = torch.randn(17, 32, generator=g)
    names = ("x", "w1", "w2", "b1", "b2")
    seen = []
    up_backward = grouped_mod._Launches.up_backward

    def checked_up_backward(self, *args, **kwargs):
        seen.append(all(ref() is None for ref in dy_refs))
        return up_backward(self, *args, **kwargs)

    monkeypatch.setattr(grouped_mod._Launches, "up_backward", checked_up_backward)
    up = grouped_mod._GroupedUp.backward
    h_grads = []

    def recording_up(ctx, dz, dh):  # h is not differentiable: no zeros [rows, I] made for its gradient
        h_grads.append(dh)
        return up(ctx, dz, dh)

    monkeypatch.setattr(grouped_mod._GroupedUp, "backward", staticmethod(recording_up))

    def grads(wanted):
        leaves = {n: t.clone().requires_grad_(n in wanted) for n, t in
                  zip(names, (inp["x"], inp["w1"], inp["w2"], b1, b2))}
        y = grouped_mlp(leaves["x"], inp["expert_offsets"], leaves["w1"], leaves["w2"], b1=leaves["b1"],
                        b2=leaves["b2"])
        y.register_hook(lambda grad: dy_refs.append(weakref.ref(grad)))
        (y * scale).sum().backward()  # y's gradient made inside autograd, held by nobody here
        return {n: leaves[n].grad for n in wanted}

    dy_refs: list = []
    full = grads(names)
    assert seen == [True], "the output's gradient was still alive in the first GEMM's backward"
    assert h_grads == [None], "a gradient of h was materialised"
    for name in names:
        dy_refs = []
        assert torch.equal(grads((name,))[name], full[name]), f"grad {name} alone differs"


def test_x_is_scratch_gives_the_same_gradients_and_guards_a_retained_graph():
    """x_is_scratch=True (rows only this call reads): dx is written over x after dW1 has read it,
    with every gradient bit as without, also with the pre-activation recomputed; a second backward
    through a retained graph raises (autograd's version check) instead of reading dx as x."""
    inp = make_inputs([7, 0, 12, 3], 40, 24, rows=25, seed=21)
    grad_y = torch.randn(25, 40, generator=torch.Generator().manual_seed(22))
    runs = []
    for scratch, save_z in ((False, True), (True, True), (True, False)):  # and with the recomputed z
        leaves = [t.clone().requires_grad_() for t in (inp["x"], inp["w1"], inp["w2"])]
        rows = leaves[0] * 1  # a non-leaf the call owns, like a dispatch's received rows
        y = grouped_mlp(rows, inp["expert_offsets"], leaves[1], leaves[2], x_is_scratch=scratch,
                        save_preactivation=save_z)
        y.backward(grad_y, retain_graph=True)
        runs.append([y.detach()] + [t.grad.clone() for t in leaves])
        if scratch:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward(grad_y)
            if not save_z:  # the recomputation reads x first: nothing computed from dx as x
                assert torch.equal(leaves[2].grad, runs[-1][3]), "a second backward added a gradient before raising"
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_strided_weights_give_the_bits_of_contiguous_ones(activation):
    """nn.Linear-layout weights ([E, n*I, H] and [E, H, I] stacked, passed transposed: views) and
    an expert-strided slice read the same values as contiguous copies: the same output and
    gradient bits (the gradients come back in the views' shapes)."""
    inp = make_inputs([9, 0, 14], 40, 24, seed=8, activation=activation)
    w1_lin = inp["w1"].transpose(1, 2).contiguous()          # [E, n*I, H]: Linear(H, n*I).weight, stacked
    w2_lin = inp["w2"].transpose(1, 2).contiguous()          # [E, H, I]
    wide = torch.zeros(3, 40, 2 * inp["w1"].shape[2])        # every other column: last stride 2
    wide[:, :, ::2] = inp["w1"]
    grad_y = torch.randn(23, 40, generator=torch.Generator().manual_seed(9))
    runs = []
    for w1, w2 in ((inp["w1"], inp["w2"]), (w1_lin.transpose(1, 2), w2_lin.transpose(1, 2)),
                   (wide[:, :, ::2], inp["w2"])):
        leaves = [t.detach().requires_grad_() for t in (inp["x"], w1, w2)]
        y = grouped_mlp(leaves[0], inp["expert_offsets"], leaves[1], leaves[2], activation=activation)
        y.backward(grad_y)
        runs.append([y.detach()] + [t.grad for t in leaves])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0]))


def test_weight_gradients_in_float32_on_request():
    """grad_dtype=float32 with fp16 weights: the fp32 gradients accumulate into main_grad (two
    backward passes: twice the one), .grad gets none; non-leaf weights are refused."""
    inp = make_inputs([5, 9], 32, 16, seed=6, dtype=torch.float16)
    w1, w2 = inp["w1"].clone().requires_grad_(), inp["w2"].clone().requires_grad_()
    grad_y = torch.randn(14, 32, generator=torch.Generator().manual_seed(2)).half()
    for _ in range(2):
        grouped_mlp(inp["x"], inp["expert_offsets"], w1, w2, grad_dtype=torch.float32).backward(grad_y)
    assert w1.grad is None and w2.grad is None
    assert w1.main_grad.dtype == torch.float32 and w1.main_grad.shape == w1.shape
    _, want = _float64_mlp(inp, "swiglu", None, None, grad_y.float())
    for got, ref in ((w1.main_grad, want[1]), (w2.main_grad, want[2])):
        err = float((got.double() / 2 - ref).abs().max())
        assert err <= 2e-3 * float(ref.abs().max()), err
    with pytest.raises(ValueError, match="must be leaf tensors"):
        grouped_mlp(inp["x"], inp["expert_offsets"], w1 * 1, w2, grad_dtype=torch.float32)
    with pytest.raises(ValueError, match="grad_dtype must be None"):
        grouped_mlp(**inp, grad_dtype=torch.float16)


@pytest.mark.parametrize("dtype,save_z", [(torch.float32, True), (torch.float16, False)], ids=["fp32", "fp16-recompute"])
def test_gradients_through_row_index(dtype, save_z):
    """Gathered rows (repeats within and across experts, x rows no row reads, an empty expert): every
    gradient equals the one through x[row_index] gathered first — bit for bit in fp32 (both add a
    row's gradients in ascending row order), within tolerance of float64 in fp16 — and the weight
    gradients bit for bit in both."""
    inp = make_inputs([5, 0, 7, 4], 16, 8, n_x=9, dtype=dtype, seed=4)
    g = torch.Generator().manual_seed(9)
    grad_y = torch.randn(16, 16, generator=g).to(dtype)
    grads = []
    for gathered in (False, True):
        x = inp["x"].clone().requires_grad_(True)
        w1, w2 = inp["w1"].clone().requires_grad_(True), inp["w2"].clone().requires_grad_(True)
        if gathered:
            y = grouped_mlp(x[inp["row_index"].long()], inp["expert_offsets"], w1, w2, save_preactivation=save_z)
        else:
            y = grouped_mlp(x, inp["expert_offsets"], w1, w2, row_index=inp["row_index"], save_preactivation=save_z)
        y.backward(grad_y)
        grads.append((y.detach(), x.grad, w1.grad, w2.grad))
    (y_a, dx_a, dw1_a, dw2_a), (y_b, dx_b, dw1_b, dw2_b) = grads
    assert torch.equal(y_a, y_b) and torch.equal(dw1_a, dw1_b) and torch.equal(dw2_a, dw2_b)
    unread = torch.ones(9, dtype=torch.bool)
    unread[inp["row_index"].long()] = False
    assert unread.any() and (dx_a[unread] == 0).all()
    if dtype == torch.float32:
        assert torch.equal(dx_a, dx_b)
    else:
        x64 = inp["x"].double().requires_grad_(True)
        w64 = (inp["w1"].double(), inp["w2"].double())
        ref = grouped_mlp_float64(x64[inp["row_index"].long()], inp["expert_offsets"], *w64)
        ref.backward(grad_y.double())
        err = float((dx_a.double() - x64.grad).abs().max())
        assert err <= 3e-2 * float(x64.grad.abs().max()), err


def grouped_mlp_float64(x_rows, offsets, w1, w2):
    """SwiGLU expert MLPs in float64 with torch autograd (the reference of the row_index test)."""
    outs, off = [], offsets.tolist()
    for e in range(len(off) - 1):
        z = x_rows[off[e]:off[e + 1]] @ w1[e]
        gate, up = z.chunk(2, dim=1)
        outs.append((torch.nn.functional.silu(gate) * up) @ w2[e])
    return torch.cat(outs)


def test_sum_rows_into_adds_in_row_order():
    from ditron_ep.ops.moe_layer.grouped import sum_rows_into
    rows = torch.tensor([[1.0], [2.0**-24], [3.0], [2.0**-24], [5.0]])
    idx = torch.tensor([2, 0, 2, 0, 2], dtype=torch.int32)
    out = sum_rows_into(rows, idx, 4)
    assert out.flatten().tolist() == [2.0**-23, 0.0, 9.0, 0.0]
    assert sum_rows_into(rows[:0], idx[:0], 3).shape == (3, 1)


def test_gradients_refused_where_not_supported():
    inp = make_inputs([3, 4], 16, 8)
    with pytest.raises(ValueError, match="out= cannot be used"):
        grouped_mlp(**{**inp, "x": inp["x"].clone().requires_grad_()}, out=torch.empty(7, 16))
    with torch.no_grad():
        y = grouped_mlp(**inp)
    assert_close_to_oracle(y, oracle({**inp, "x": inp["x"].detach()}), torch.float32, "no_grad")


def _bad_inputs() -> list[tuple[str, dict, str]]:
    base = make_inputs([3, 4], 16, 8, n_x=5)
    cfg = default_gemm_configs(torch.float32, "cpu")
    return [
        ("x-3d", {"x": base["x"][None]}, "x must be 2-D"),
        ("x-int", {"x": base["x"].long()}, "x must be bfloat16, float16 or float32"),
        ("w1-dtype", {"w1": base["w1"].double()}, "w1 has dtype torch.float64"),
        ("w1-hidden", {"w1": torch.zeros(2, 15, 16)}, "w1 must have shape [E_local, H=16, 2I (gate ‖ up)]"),
        ("w1-odd", {"w1": torch.zeros(2, 16, 15)}, "activation='swiglu'"),
        ("activation", {"activation": "tanh"}, "activation='tanh' is not supported; supported: ('swiglu'"),
        ("b1-shape", {"b1": torch.zeros(2, 8)}, "= [2, 16], got (2, 8)"),
        ("b2-dtype", {"b2": torch.zeros(2, 16, dtype=torch.float64)}, "b2 has dtype torch.float64"),
        ("w2-shape", {"w2": torch.zeros(2, 16, 8)}, "w2 must have shape [E_local=2, I=8, H=16]"),
        ("w1-device", {"w1": base["w1"].to("meta")}, "w1 is on meta but x is on cpu"),
        ("offsets-int64", {"expert_offsets": base["expert_offsets"].long()}, "expert_offsets must be a 1-D int32"),
        ("offsets-E", {"expert_offsets": torch.tensor([0, 3, 5, 7], dtype=torch.int32)},
         "expert_offsets has 4 entries but w1 holds E_local=2"),
        ("row_index-int64", {"row_index": base["row_index"].long()}, "row_index must be a 1-D int32"),
        ("x-strided", {"x": base["x"].t().contiguous().t()}, "x must be contiguous"),
        ("bf16", {k: base[k].bfloat16() for k in ("x", "w1", "w2")}, "not supported under the Triton interpreter"),
        ("config", {"config": (cfg[0], None)}, "config must be a pair of GemmTileConfig"),
        ("config-single", {"config": cfg[0]}, "config must be a pair of GemmTileConfig"),
        ("programs", {"num_programs": 0}, "num_programs must be a positive int"),
        ("group_rows", {"group_rows": 0}, "group_rows must be None (chosen per kernel) or a positive int"),
        ("precision", {"input_precision": "tf32x3"}, "input_precision must be one of"),
        ("out", {"out": torch.empty(7, 15)}, "out must be a contiguous torch.float32 tensor of shape [rows=7, H=16]"),
        ("offsets-start", {"expert_offsets": torch.tensor([2, 5, 7], dtype=torch.int32)},
         "expert_offsets must start at 0, never decrease and end at most at rows=7, got [2, 5, 7]"),
        ("offsets-negative", {"expert_offsets": torch.tensor([-3, 5, 7], dtype=torch.int32)}, "must start at 0"),
        ("offsets-decrease", {"expert_offsets": torch.tensor([0, 6, 3], dtype=torch.int32)}, "never decrease"),
        ("offsets-past-rows", {"expert_offsets": torch.tensor([0, 3, 8], dtype=torch.int32)}, "at most at rows=7"),
        ("row_index-high", {"row_index": torch.tensor([0, 1, 2, 3, 4, 0, 100_000], dtype=torch.int32)},
         "row_index values must be in [0, N=5) (rows of x), got values from 0 to 100000"),
        ("row_index-negative", {"row_index": torch.tensor([0, 1, -2, 3, 4, 0, 1], dtype=torch.int32)},
         "got values from -2 to 4"),
        ("row_index-no-x", {"x": torch.zeros(0, 16)}, "row_index has 7 rows to gather but x has none"),
        ("check", {"check": "yes"}, "check must be True, False or None"),
    ]


@pytest.mark.parametrize("name,change,message", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_bad_input(name, change, message):
    inp = {**make_inputs([3, 4], 16, 8, n_x=5), **change}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        grouped_mlp(**inp)


def test_tile_config_validation():
    cfg = GemmTileConfig(128, 256, 64, 8, 4)
    assert str(cfg) == "BM128-BN256-BK64-w8-s4"
    assert GemmTileConfig.parse(str(cfg)) == cfg
    for text, message in [("BM128-BN256-BK64-w8", "expected BM<m>-BN<n>-BK<k>-w<warps>-s<stages>"),
                          ("BM96-BN256-BK64-w8-s4", "block_m must be a power of two")]:
        with pytest.raises(ValueError, match=message):
            GemmTileConfig.parse(text)
    assert cfg.launch_options() == {"num_warps": 8, "num_stages": 4}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_m = 64
    for args, message in [((96, 64, 64, 4, 2), "block_m must be a power of two"),
                          ((64, 8, 64, 4, 2), "block_n must be a power of two in \\[16, 512\\]"),
                          ((64, 64, 64, 3, 2), "num_warps must be 1, 2, 4, 8 or 16"),
                          ((64, 64, 64, 4, 0), "num_stages must be in \\[1, 8\\]"),
                          ((64, 64, 64.0, 4, 2), "block_k must be an int")]:
        with pytest.raises(ValueError, match=message):
            GemmTileConfig(*args)
    for dtype, device in itertools.product((torch.bfloat16, torch.float16, torch.float32), DEVICE_TYPES):
        assert all(isinstance(c, GemmTileConfig) for c in default_gemm_configs(dtype, device))
    with pytest.raises(ValueError, match="no GEMM config for torch.int8"):
        default_gemm_configs(torch.int8, "cuda")
    with pytest.raises(ValueError, match="device_type must be one of"):
        default_gemm_configs(torch.bfloat16, "rocm")


_SM90_COMPILE = """
import json, sys, torch
from triton.backends.compiler import GPUTarget
from ditron_ep.compiler.core_config import default_backward_configs, default_gemm_configs
from tools.portability import compile_registered
from ditron_ep.ops.moe_layer import grouped_gemm_kernels as grouped_gemm
for dtype in (torch.bfloat16, torch.float32):
    grouped_gemm.register_ffn_configs(dtype, *default_gemm_configs(dtype, "cuda"), label=f"cuda-default-{dtype}",
                                      shape=(7168, 2048),
                                      backward=default_backward_configs(dtype, "cuda") if dtype == torch.bfloat16 else None)
from ditron_ep.compiler.core_config import PLAIN_UP_CUDA_HALF
from ditron_ep.ops.moe_layer.experts import activation_code
grouped_gemm.register_ffn_configs(torch.bfloat16, PLAIN_UP_CUDA_HALF, default_gemm_configs(torch.bfloat16, "cuda")[1],
                                  label="cuda-default-plain-up", shape=(4096, 16384), activation=activation_code("gelu"))
results = compile_registered([GPUTarget("cuda", 90, 32)], modules={grouped_gemm.__name__})
json.dump([[r.label, r.ok, r.shared_bytes, r.error, r.spill_bytes] for r in results if "cuda-default" in r.label],
          sys.stdout)
"""


def test_nvidia_default_configs_compile_for_sm90(tmp_path):
    """The portability check compiles every signature for gfx942 too, whose 64 KiB of LDS the
    NVIDIA defaults (192 KiB) exceed: compile those (and the backward kernels with them, and a
    plain activation's first-GEMM tile) for sm_90 alone here, shared memory and register spills
    checked (act_grad's 128 x 256 tile with its whole epilogue at once spilled 3,776 bytes a thread
    and ran 2x slower than its GEMM; on halves 472)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout)
    assert len(results) == 9, results  # bf16: 2 forward + 3 backward kernels; fp32: 2 forward; plain-activation bf16: 2
    for label, ok, shared, error, spills in results:
        assert ok, f"{label}: {error}"
        assert spills is not None and spills <= 512, f"{label}: {spills} bytes of stack a thread (register spills)"
    assert max(r[2] for r in results) == 196608  # 4 stages x 48 KiB: the K-loop is pipelined


def test_values_made_valid_without_host_sync():
    """GPU default (check=None): bad offsets / row_index are repaired on the device so every row
    is written once; valid ones pass unchanged (the same bits)."""
    from ditron_ep.ops.moe_layer.grouped import _made_valid
    good_off = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    good_idx = torch.tensor([4, 0, 1, 2, 3, 0, 1], dtype=torch.int32)
    off, idx = _made_valid(good_off, good_idx, 7, 5)
    assert torch.equal(off, good_off) and off.dtype == torch.int32 and torch.equal(idx, good_idx)
    cases = [([2, 5, 7, 7], [0, 5, 7, 7]), ([-3, 5, 4, 9], [0, 5, 5, 7]), ([0, 6, 3, 2], [0, 6, 6, 6])]
    for bad, fixed in cases:
        assert _made_valid(torch.tensor(bad, dtype=torch.int32), None, 7, 5)[0].tolist() == fixed
    assert _made_valid(good_off, torch.tensor([-1, 5, 100, 2], dtype=torch.int32), 7, 5)[1].tolist() == [0, 4, 4, 2]
    # the repaired offsets drive the kernels like valid ones: checked against the oracle
    inp = make_inputs([3, 4], 16, 8, n_x=5)
    off, _ = _made_valid(torch.tensor([0, 6, 3], dtype=torch.int32), None, 7, 5)
    y = grouped_mlp(**{**inp, "expert_offsets": off}, check=False)
    assert_close_to_oracle(y, oracle({**inp, "expert_offsets": off}), torch.float32, "repaired offsets")


def test_tile_map_kernel_equals_the_torch_ops():
    """The one-launch tile map (what GPUs run) equals build_tile_map's torch ops (what the CPU runs):
    ragged experts, empty ones, offsets that go down (no tiles), several tile heights."""
    from ditron_ep.ops.moe_layer.grouped_gemm_kernels import build_tile_map, tile_map_kernel

    off = torch.tensor([0, 13, 13, 40, 41, 41, 30, 95, 96, 200], dtype=torch.int32)
    for bm in (16, 64, 128):
        want = build_tile_map(off, bm)
        got = torch.full_like(off, -7)
        tile_map_kernel[(1,)](off, got, off.shape[0] - 1, BM=bm, BLOCK_E=16)
        assert torch.equal(got, want), (bm, got, want)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_act_grad_split_epilogue_gives_the_same_bits(activation):
    """act_grad's epilogue on halves or quarters of a tile's columns (tiles of >= 256 columns take
    quarters on a GPU) gives the bits of the whole tile at once, and both match the float64 activation backward:
    ragged experts, rows past the last expert, I not a multiple of the tile (masked columns)."""
    from ditron_ep.ops.moe_layer.experts import activation_code
    from ditron_ep.ops.moe_layer.grouped_gemm_kernels import grouped_act_grad_kernel, max_m_tiles

    g = torch.Generator().manual_seed(5)
    off = torch.tensor([0, 13, 13, 40], dtype=torch.int32)
    rows, E, H, I, nj = 44, 3, 32, 48, width_factor(activation)
    dy, z = torch.randn(rows, H, generator=g), torch.randn(rows, nj * I, generator=g)
    w2 = torch.randn(E, I, H, generator=g) / H**0.5
    outs = []
    for parts in (1, 2, 4):
        dz, h = torch.full((rows, nj * I), float("nan")), torch.full((rows, I), float("nan"))
        m_cap = max_m_tiles(rows, E, 16)
        grouped_act_grad_kernel[(3,)](dy, w2, z, dz, h, build_tile_map(off, 16), off, rows, m_cap, H, I, E, 1,
                                      *w2.stride(), BM=16, BN=32, BK=16, BLOCK_E=4, INPUT_PRECISION="ieee",
                                      ACT=activation_code(activation), EPILOGUE_PARTS=parts)
        outs.append((dz[:40], h[:40]))
    for dz, h in outs[1:]:
        assert torch.equal(dz, outs[0][0]) and torch.equal(h, outs[0][1])
    zd = z[:40].double().requires_grad_()
    dh = torch.cat([dy[off[e]:off[e + 1]].double() @ w2[e].double().T for e in range(E)])
    h_ref = expert_activation(zd, activation)
    (dz_ref,) = torch.autograd.grad(h_ref, zd, dh)
    torch.testing.assert_close(outs[0][0].double(), dz_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1].double(), h_ref.detach(), rtol=1e-5, atol=1e-5)


FP8_CASES = {  # id: (sizes, H, I, rows, n_x, dtype, activation, config)
    # gathered rows (the token-major dispatch's row_index), an empty expert, rows past the last
    "gather-fp16-swiglu": ([9, 0, 14], 256, 40, 27, 11, torch.float16, "swiglu", None),
    # K steps of 32 columns: four per scale block; fp32 weights (ieee dot)
    "fp32-gelu-bk32": ([7, 12], 384, 24, None, None, torch.float32, "gelu", (GemmTileConfig(16, 32, 32, 4, 2),
                                                                              GemmTileConfig(16, 32, 32, 4, 2))),
}


@pytest.mark.parametrize("sizes,H,I,rows,n_x,dtype,activation,config", FP8_CASES.values(), ids=FP8_CASES.keys())
def test_fp8_rows_dequantised_in_the_load(sizes, H, I, rows, n_x, dtype, activation, config):
    """x_scales: FP8 (e4m3) rows with a fp32 scale per 128 columns, dequantised in the first GEMM's
    A-load, give bit for bit grouped_mlp of the rows dequantised beforehand as the EP dispatch's
    dequantize=True writes them (x * scale in fp32, cast once); against the float64 oracle of
    those rows within the dtype's tolerance."""
    from ditron_ep.ops.ep.buffer import quantize_fp8

    inp = make_inputs(sizes, H, I, rows=rows, n_x=n_x, dtype=dtype, seed=5, activation=activation)
    x8, sc = quantize_fp8(inp["x"].to(torch.float32))
    x_deq = (x8.to(torch.float32) * sc.repeat_interleave(128, dim=1)).to(dtype)
    kw = {"row_index": inp["row_index"], "activation": activation, "config": config}
    want = grouped_mlp(x_deq, inp["expert_offsets"], inp["w1"], inp["w2"], **kw)
    got = grouped_mlp(x8, inp["expert_offsets"], inp["w1"], inp["w2"], x_scales=sc, **kw)
    assert got.dtype == dtype and torch.equal(got, want)
    if activation == "swiglu":
        assert_close_to_oracle(got, oracle({**inp, "x": x_deq}), dtype, f"FP8 rows {sizes}")


def test_fp8_rows_bad_input():
    from ditron_ep.ops.ep.buffer import quantize_fp8
    from ditron_ep.runtime.errors import DitronConfigError

    inp = make_inputs([5, 3], 256, 16, dtype=torch.float16)
    x8, sc = quantize_fp8(inp["x"].to(torch.float32))
    args = (inp["expert_offsets"], inp["w1"], inp["w2"])
    with pytest.raises(ValueError, match="FP8 rows: pass their x_scales"):
        grouped_mlp(x8, *args)
    with pytest.raises(ValueError, match="x must be float8_e4m3fn"):
        grouped_mlp(inp["x"], *args, x_scales=sc)
    with pytest.raises(ValueError, match=r"x_scales fp32 \[N, H / 128\]"):
        grouped_mlp(x8, *args, x_scales=sc[:, :1])
    with pytest.raises(ValueError, match="block_k must divide 128"):
        grouped_mlp(x8, *args, x_scales=sc, config=(GemmTileConfig(16, 32, 256, 4, 2), GemmTileConfig(16, 32, 32, 4, 2)))
    with pytest.raises(DitronConfigError, match="path='hopper' cannot run FP8 rows"):
        grouped_mlp(x8, *args, x_scales=sc, path="hopper")
    w1 = inp["w1"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="forward only"):
        grouped_mlp(x8, inp["expert_offsets"], w1, inp["w2"], x_scales=sc)
    with torch.no_grad():  # ... and runs without gradients
        assert grouped_mlp(x8, inp["expert_offsets"], w1, inp["w2"], x_scales=sc).shape == (8, 256)
