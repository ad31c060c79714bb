"""`replace_moe` on DeepSpeed's MoE layer on CUDA ranks (bf16, NCCL), under torchrun
(tests/gpu/run_gpu_suite.sh). DeepSpeed 0.19.8 must be installed (the test extra; on the lent GPU
machines carried as wheels): output, l_aux, exp_counts and every gradient against DeepSpeed's own
layer within bf16 tolerance, bitwise run to run, with capacity drops on; GELU and SwiGLU experts on
the kernels, GELU experts as modules (experts="modules")."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

H, I, T = 256, 512, 512


def _experts(world: int) -> int:
    """8, or 2 per rank past 4 ranks: with one expert per rank the in-place weight view (experts
    spaced in one buffer) would go untested."""
    return max(8, 2 * world)


class _SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(H, I), nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _block(world: int, expert: nn.Module, capacity_factor: float, device) -> nn.Module:
    from deepspeed.moe.layer import MoE

    torch.manual_seed(3)
    block = MoE(H, expert, num_experts=_experts(world), ep_size=world, k=2, capacity_factor=capacity_factor,
                eval_capacity_factor=capacity_factor, min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False)
    block.set_deepspeed_parallelism()
    with torch.no_grad():
        for i, ex in enumerate(block.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(1000 + dist.get_rank() * (_experts(world) // world) + i)
            for p in ex.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return block.to(device, torch.bfloat16)


def _run(block, x, gout):
    leaf = x.clone().requires_grad_()
    out, l_aux, counts = block(leaf)
    grads = torch.autograd.grad((out.float() * gout.float()).sum() + l_aux, [leaf, *block.parameters()])
    return [out.detach(), l_aux.detach(), counts.clone(), *grads]


@pytest.mark.parametrize("kind,capacity_factor,experts", [("gelu", 0.75, "kernels"), ("swiglu", 1.0, "kernels"),
                                                          ("gelu", 0.75, "modules")],
                         ids=["gelu-drops", "swiglu", "gelu-drops-modules"])
def test_replace_moe_matches_deepspeed_in_bf16(dist_env, kind, capacity_factor, experts):
    os.environ.setdefault("LOCAL_RANK", str(dist_env.local_rank))
    try:
        import deepspeed
    except ImportError:
        pytest.fail("DeepSpeed is a test dependency: pip install 'ditron_ep[test]' (on the lent GPU machines, carry "
                    "its wheels: see tests/gpu/run_gpu_suite.sh)")
    from ditron_ep.integrations.deepspeed import replace_moe
    from ditron_ep.ops import clear_cache, clear_layers

    deepspeed.init_distributed(dist_backend="nccl", auto_mpi_discovery=False)
    make = (lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, H))) if kind == "gelu" else _SwiGLU
    theirs = _block(dist_env.world, make(), capacity_factor, dist_env.device)
    ours = _block(dist_env.world, make(), capacity_factor, dist_env.device)
    problems = []
    if replace_moe(ours, experts=experts) != 1:
        problems.append("replace_moe replaced no layer")
    gen = torch.Generator().manual_seed(50 + dist_env.rank)
    x = torch.randn(T, H, generator=gen).to(dist_env.device, torch.bfloat16)
    gout = torch.randn(T, H, generator=gen).to(dist_env.device, torch.bfloat16)
    want, got, again = _run(theirs, x, gout), _run(ours, x, gout), _run(ours, x, gout)
    labels = ["out", "l_aux", "exp_counts", "x", *[n for n, _ in ours.named_parameters()]]
    for label, g, w in zip(labels, got, want):
        if label == "exp_counts" and not torch.equal(g, w):
            problems.append("exp_counts differ from DeepSpeed's")
        if label == "l_aux" and not float((g - w).abs()) <= 1e-5 * float(w.abs()):  # fp32, the gate's kernels
            problems.append(f"l_aux {float(g)} differs from DeepSpeed's {float(w)}")
        if label in ("l_aux", "exp_counts"):
            continue
        rel = float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
        if not rel <= 3e-2:
            problems.append(f"{label}: max|diff|/max|ref| = {rel:.3g}")
    if not all(torch.equal(a, b) for a, b in zip(got, again)):
        problems.append("two calls of the replaced layer differ")
    torch.cuda.synchronize()
    clear_cache()
    clear_layers()
    assert not problems, problems
