"""The "DeepEP + grouped_mm" baseline layer (bench/deepep.DeepEPMoE) on one CPU rank, against a
float64 MoE, forward and every gradient. DeepEP itself is GPU-only: a stand-in `deep_ep` with its
v1 intranode API and its one-rank semantics (dispatch and combine keep every row; local expert
ids; combine sums the weights' gradients) checks what the layer does around it — the
permutation to expert-major rows, the weighting, the per-token sum, the autograd wiring."""
from __future__ import annotations

import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ditron_ep.bench import torch_moe
from ditron_ep.bench.deepep import DeepEPMoE
from ditron_ep.bench.ranks import RankContext


class _Config:
    def get_nvl_buffer_size_hint(self, row_bytes: int, ranks: int) -> int:
        return row_bytes * ranks


class _Buffer:
    """DeepEP v1's Buffer at one rank: every token stays; ids are local already."""
    num_sms = 20

    def __init__(self, group, nvl_bytes, rdma_bytes, explicitly_destroy=False):
        self.destroyed = False

    @classmethod
    def set_num_sms(cls, n):
        cls.num_sms = n

    @staticmethod
    def get_dispatch_config(ranks):
        return _Config()

    @staticmethod
    def get_combine_config(ranks):
        return _Config()

    def get_dispatch_layout(self, topk_idx, num_experts):
        T = topk_idx.shape[0]
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return torch.tensor([T], dtype=torch.int32), None, per_expert, torch.ones(T, 1, dtype=torch.bool), None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                 topk_idx=None, topk_weights=None, config=None):
        if handle is not None:
            return x.clone(), None, None, None, None, None
        counts = num_tokens_per_expert.tolist()
        return x.clone(), topk_idx.clone(), torch.where(topk_idx >= 0, topk_weights, 0.0), counts, ("h",), None

    def combine(self, x, handle, topk_weights=None, config=None):
        return x.clone(), None if topk_weights is None else topk_weights.clone(), None

    def destroy(self):
        self.destroyed = True


def _float64_moe(x, idx, w, w1, w2):
    inter = w2.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                g = x[t] @ w1[e]
                out[t] = out[t] + w[t, k] * ((F.silu(g[:inter]) * g[inter:]) @ w2[e])
    return out


def test_deepep_layer_matches_float64_forward_and_gradients(monkeypatch, tmp_path):
    fake = types.ModuleType("deep_ep")
    fake.Buffer = _Buffer
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    # torch._grouped_mm's CPU backward is missing: the experts as torch_experts' per-expert loop
    grouped = torch_moe.torch_experts
    monkeypatch.setattr(torch_moe, "torch_experts", lambda rows, offs, w1, w2, loop: grouped(
        rows, offs, w1, w2, [0, *offs.tolist()]))
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(3)
        T, H, I, E, K = 13, 16, 8, 4, 2
        x = torch.randn(T, H, generator=g)
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        idx[3, 1] = -1                      # a dropped slot
        idx[5] = torch.tensor([2, -1])
        w = torch.rand(T, K, generator=g)
        w1, w2 = torch.randn(E, H, 2 * I, generator=g) / H ** .5, torch.randn(E, I, H, generator=g) / I ** .5
        grad_out = torch.randn(T, H, generator=g)
        ctx = RankContext(rank=0, world=1, device=torch.device("cpu"), dtype=torch.float32)
        layer = DeepEPMoE(ctx, E, H)
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
        out = layer(leaves[0], idx, leaves[1], leaves[2], leaves[3])
        got = torch.autograd.grad(out, leaves, grad_out)
        ref_leaves = [t.double().requires_grad_() for t in (x, w, w1, w2)]
        ref = _float64_moe(ref_leaves[0], idx, *ref_leaves[1:])
        want = torch.autograd.grad(ref, ref_leaves, grad_out.double())
        assert torch.allclose(out.double(), ref, atol=1e-5), float((out.double() - ref).abs().max())
        for name, a, b in zip(("x", "topk_weights", "w1", "w2"), got, want):
            assert torch.allclose(a.double(), b, atol=1e-5), f"grad {name}: {float((a.double() - b).abs().max())}"
        assert got[1][3, 1] == 0 and got[1][5, 1] == 0, "a dropped slot's weight got a gradient"
        # the layer's communication alone (the glue-free sum's parts): at one rank both keep the rows
        dispatch, combine = layer.stage_calls(x, idx, w)
        assert torch.equal(dispatch()[0], x) and torch.equal(combine(), x)
        layer.close()
        assert layer.buf.destroyed
    finally:
        if own_group:
            dist.destroy_process_group()


def test_glue_free_sum_adds_the_parts_and_names_the_glue():
    from ditron_ep.bench.moe_layer import DEEPEP_SUM, glue_free_sum
    from ditron_ep.bench.spec import Measurement

    def timed(impl, us):
        return Measurement(impl, times_us=[us * 1.1, us, us * 0.9])

    row = glue_free_sum(timed("layer", 900.0), timed("d", 200.0), timed("e", 500.0), timed("c", 100.0), 1e9)
    assert (row.impl, row.value_us, row.ok) == (DEEPEP_SUM, 800.0, True)
    assert row.check == "dispatch 200 + experts 500 + combine 100 µs; the pipeline's glue 100 µs"
    missing = glue_free_sum(timed("layer", 900.0), Measurement("d", error="failed"), timed("e", 500.0),
                            timed("c", 100.0), 1e9)
    assert not missing.ok and missing.value_us is None and "not derived" in missing.error
