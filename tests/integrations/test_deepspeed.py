"""`replace_moe` against DeepSpeed's own MoE layer (the real package, deepspeed==0.19.8) on
emulated gloo ranks: outputs, l_aux, exp_counts and every gradient (input, gate, each expert's
parameters) within fp32 tolerance of DeepSpeed's, bitwise run to run; capacity drops on and off,
k = 1 and 2, distinct experts, every supported expert type; expert- x data-parallel groups;
state_dict round trips; training under deepspeed.initialize (ZeRO 0 and 1) with DeepSpeed's losses."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from tests.integrations import rank_fns_deepspeed as fns  # noqa: E402

# (num_experts, ep_size, k, capacity_factor, drop_tokens, activation, bias, tokens, seed)
CASES_W2 = [  # (gelu, k = 2, biases, capacity factor 1: the W4 cases below)
    (4, 2, 1, 0.5, True, "relu", False, 22, 4),        # capacity drops
    (4, 2, 2, 0.5, True, "swiglu", True, 18, 5),       # drops, gated experts with biases
    (6, 2, 2, 1.0, False, "gelu_tanh", False, 14, 6),  # no drops (infinite capacity)
    (2, 2, 1, 1.0, True, "silu", True, 10, 7),
    # experts="modules": each expert's own forward between our dispatch and combine
    (4, 2, 2, 0.5, True, "swiglu", True, 18, 5, "modules"),     # drops, gated experts
    (6, 2, 1, 1.0, False, "tanh", False, 14, 6, "modules"),     # an expert the kernels do not support
]
CASES_W4 = [(4, 2, 2, 1.0, True, "gelu", True, 12, 8),  # two expert-parallel groups of 2, data-parallel across
            (4, 2, 2, 1.0, True, "gelu", True, 12, 8, "modules")]


def _check(reports: list[dict], cases: list[tuple]) -> None:
    for case, rep in zip(cases, reports):
        assert rep["replaced"] == 1 and rep["same_params"], (case, rep)
        assert rep["counts_equal"], (case, rep)
        assert rep["bitwise"], (case, "two calls of the replaced layer differ")
        for name, err in rep["errors"].items():
            assert err <= 1e-5, (case, name, err)


def test_replaced_layer_equals_deepspeeds(emulated_cluster):
    results = emulated_cluster(2).run(fns.compare_cases, CASES_W2)
    for reports in results:
        _check(reports, CASES_W2)
    assert results[0][0]["dropped"] > 0 and results[0][1]["dropped"] > 0, "the capacity dropped no route"


def test_expert_and_data_parallel_groups(emulated_cluster):
    for reports in emulated_cluster(4).run(fns.compare_cases, CASES_W4):
        _check(reports, CASES_W4)


@pytest.mark.parametrize("zero_stage, experts", [(0, "kernels"), (1, "kernels"), (2, "kernels"), (2, "modules")])
def test_training_under_deepspeed_initialize_matches(emulated_cluster, zero_stage, experts):
    """6 SGD steps of a Linear -> MoE -> Linear model under deepspeed.initialize (ZeRO 0 / 1 / 2,
    CPU): the replaced layer's losses equal DeepSpeed's own within fp32 rounding, and the experts'
    weights are read where they lie (kernels: replace_moe's buffer at stage 0, ZeRO's flat buffers
    after; modules: the expert modules read their own)."""
    for rank, runs in enumerate(emulated_cluster(2).run(fns.engine_case, zero_stage, 6, 9, experts)):
        for step, (ours, theirs) in enumerate(zip(runs["ditron_ep"], runs["deepspeed"])):
            assert abs(ours - theirs) <= 1e-5 * abs(theirs), (rank, step, runs)
        if experts == "kernels":
            assert runs["in_place"], (rank, "the experts' weights were copied (stacked) on every call")


@pytest.mark.parametrize("per_expert", [1, 2], ids=["plain", "gated"])
def test_expert_weights_are_read_in_place_with_their_gradients(per_expert):
    """Weight blocks evenly spaced in one storage (as in a flat buffer, with other parameters
    between experts) are read as one view, no copy; values and every block's gradient equal the
    stacked copy's. Blocks that are not evenly spaced, or overlap, are stacked."""
    from ditron_ep.integrations.deepspeed import _expert_weights

    E, r, c, gap = 3, 4, 5, 7
    step = per_expert * r * c + gap
    flat = torch.randn(E * step, dtype=torch.float64)
    blocks = [flat[e * step + j * r * c: e * step + (j + 1) * r * c].view(r, c).requires_grad_()
              for e in range(E) for j in range(per_expert)]
    leaves = [b.detach().clone().requires_grad_() for b in blocks]
    view, in_place = _expert_weights(blocks, E)
    copy, copied = _expert_weights(leaves, E)
    assert in_place and not copied and view.data_ptr() == flat.data_ptr() and torch.equal(view, copy)
    weight = torch.randn(E, per_expert * r, c, dtype=torch.float64)
    (view * weight).sum().backward()
    (copy * weight).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(blocks, leaves))
    shuffled = blocks[per_expert:] + blocks[:per_expert]  # experts out of storage order
    assert not _expert_weights(shuffled, E)[1]
    overlapping = [flat[e * 3: e * 3 + r * c].view(r, c) for e in range(E * per_expert)]
    assert not _expert_weights(overlapping, E)[1]


class _CustomForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):  # not SwiGLU: GELU
        return self.down_proj(nn.functional.gelu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("expert, message", [
    (nn.Sequential(nn.Linear(8, 4), nn.GELU(), nn.Dropout(0.1), nn.Linear(4, 8)), "is not supported by replace_moe"),
    (nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 8)), "is not supported by replace_moe"),
    (_CustomForward(), "does not compute swiglu MLP"),
])
def test_unsupported_experts_raise_naming_the_module(expert, message):
    from ditron_ep.integrations.deepspeed import _verify, expert_layout
    from ditron_ep.runtime.errors import DitronConfigError

    with pytest.raises(DitronConfigError, match=message):
        _verify(expert, expert_layout(expert)[0], "layer.experts.0")


def test_unknown_expert_path_raises():
    from ditron_ep.integrations.deepspeed import replace_moe
    from ditron_ep.runtime.errors import DitronConfigError

    with pytest.raises(DitronConfigError, match="experts must be 'kernels'.*or 'modules'.*got 'cublas'"):
        replace_moe(nn.Linear(2, 2), experts="cublas")


def test_importing_ditron_ep_imports_no_framework():
    code = "import sys, ditron_ep, ditron_ep.ops, ditron_ep.integrations; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_unsupported_version_raises(monkeypatch):
    import deepspeed

    from ditron_ep.integrations import deepspeed as integration
    from ditron_ep.runtime.errors import DitronConfigError

    monkeypatch.setattr(deepspeed, "__version__", "0.14.0")
    with pytest.raises(DitronConfigError, match="DeepSpeed 0.14.0 is not supported.*supported: 0.19.8"):
        integration.replace_moe(nn.Linear(2, 2))
    assert torch.nn.Linear  # the model was not touched


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_engine_checkpoints_load_across_the_replacement(emulated_cluster, tmp_path, zero_stage):
    """engine.save_checkpoint of DeepSpeed's own MoE halfway through 6 steps loads into a
    replace_moe'd model under deepspeed.initialize and resumes with the same losses, and the
    other way round (the expert parameters keep their names, tags and optimizer groups)."""
    for rank, runs in enumerate(emulated_cluster(2).run(fns.checkpoint_case, zero_stage, 6, 5, str(tmp_path))):
        for label in ("deepspeed -> ditron_ep", "ditron_ep -> deepspeed"):
            for step, (got, want) in enumerate(zip(runs[label], runs["full"])):
                assert abs(got - want) <= 1e-5 * abs(want), (rank, label, step, runs)
            assert len(runs[label]) == len(runs["full"]) == 3
        assert abs(runs["fresh"][0] - runs["full"][0]) > 1e-3 * abs(runs["full"][0]), "the check cannot fail"


@pytest.mark.parametrize("capacity_factor, sampling, training", [
    (0.25, False, True),   # many drops
    (1.0, True, True),     # DeepSpeed's Gumbel second choice
    (1.0, False, False),   # eval: eval_capacity_factor
    (8.0, True, True),     # no drops
])
def test_top2_routes_equal_deepspeeds_gate(capacity_factor, sampling, training):
    """replace_moe's top-2 routes (`ops.gate.top2_capacity_gate`'s kernels) against DeepSpeed's own
    TopKGate with sparse routes: indices and exp_counts equal; l_aux, gates and the gradients of
    the input and the gate weight within fp32 rounding."""
    from deepspeed.moe.sharded_moe import TopKGate

    from ditron_ep.integrations.deepspeed import _gate_routes

    S, H, E = 96, 16, 8
    torch.manual_seed(11)
    gate = TopKGate(H, E, k=2, capacity_factor=capacity_factor, eval_capacity_factor=0.5, min_capacity=2,
                    drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=sampling).train(training)
    x = torch.randn(S, H)
    r = torch.randn(2, S)

    def ours(t):
        l_aux, idx, weights, counts = _gate_routes(gate, t, None)
        return l_aux, idx.t(), weights.t(), counts

    runs = []
    for fn in (ours, lambda t: (lambda o: (o[0], o[3], o[5], o[6]))(gate(t, None, True))):
        leaf = x.clone().requires_grad_()
        torch.manual_seed(5)  # the Gumbel draw
        l_aux, indices, gates, counts = fn(leaf)
        grads = torch.autograd.grad(l_aux + (gates * r).sum(), [leaf, gate.wg.weight])
        runs.append((l_aux.detach(), indices, gates.detach(), counts, *grads))
    got, want = runs
    names = ("l_aux", "indices", "gates", "exp_counts", "grad x", "grad wg")
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        if name in ("indices", "exp_counts"):
            assert torch.equal(a, b), f"{name} differs from DeepSpeed's gate"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs from DeepSpeed's gate")
    dropped = int((got[1] < 0).sum())
    assert (dropped > 0) == (capacity_factor * 2 * S / E < S), f"{dropped} routes dropped"


def test_top2_routes_under_autocast():
    """Under torch.autocast the gate's linear returns the autocast dtype: the routes still come from
    fp32 logits, the same as outside it (DeepSpeed's engine may run the model under autocast)."""
    from deepspeed.moe.sharded_moe import TopKGate

    from ditron_ep.integrations.deepspeed import _gate_routes

    torch.manual_seed(3)
    gate = TopKGate(16, 8, k=2, capacity_factor=1.0, min_capacity=2, drop_tokens=True, use_rts=False,
                    top2_2nd_expert_sampling=False)
    x = torch.randn(40, 16).bfloat16().float()
    want = _gate_routes(gate, x, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _gate_routes(gate, x, None)
    assert got[2].dtype == torch.float32 and torch.equal(got[1], want[1]) and torch.equal(got[3], want[3])
