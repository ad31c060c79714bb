"""Training through the MoE layer on CUDA ranks (bf16), under torchrun (tests/gpu/run_gpu_suite.sh).

Every gradient (x, topk_weights, w1, w2, and b1, b2 where the experts have biases) of
`moe(..., schedule=S)` for S in overlap / sequential / staged, keeping the activations or
recomputing them: bit for bit the same under every schedule, 100 repeated backward passes identical, and within bf16 tolerance of float64 autograd
over every rank's tokens. The layer shape is test_moe_gpu.py's (H=1024, I=512, K=4, E=4*W, 256
tokens), so the SwiGLU megakernel binary is shared with it; the GELU-with-biases case compiles one
more. Test bodies record problems and assert after their last collective (see conftest.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ditron_ep  # noqa: F401
from ditron_ep.check import make_routing
from ditron_ep.ops import clear_cache, clear_layers, moe
from ditron_ep.ops.moe_layer.experts import expert_activation, width_factor

H, I, K, T = 1024, 512, 4, 256
RUNS = {"staged": ("staged", False), "overlap": ("overlap", False), "overlap recompute": ("overlap", True),
        "sequential recompute": ("sequential", True)}  # name: (schedule, recompute)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _case(dev, activation: str, bias: bool, seed: int) -> dict:
    """This rank's inputs and experts (bf16) and every rank's, gathered, for the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E = 4 * world
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T - 37 * (rank % 4), H, generator=g).to(torch.bfloat16)  # ragged T per rank (any world size)
    idx, w = make_routing(x.shape[0], E, K, "zipf", generator=g, drop_prob=0.05, num_ranks=world)
    width = width_factor(activation) * I
    w1 = (torch.randn(E // world, H, width, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E // world, I, H, generator=g) / I ** 0.5).to(torch.bfloat16)
    b1 = (0.1 * torch.randn(E // world, width, generator=g)).to(torch.bfloat16) if bias else None
    b2 = (0.1 * torch.randn(E // world, H, generator=g)).to(torch.bfloat16) if bias else None
    gout = torch.randn(x.shape, generator=g).to(torch.bfloat16)
    mine = {"x": x, "idx": idx, "w": w, "w1": w1, "w2": w2, "b1": b1, "b2": b2, "gout": gout}
    return {k: (v.to(dev) if v is not None else None) for k, v in mine.items()}


def _grads(c: dict, activation: str, schedule: str, recompute: bool = False) -> list[torch.Tensor]:
    names = ["x", "w", "w1", "w2"] + (["b1", "b2"] if c["b1"] is not None else [])
    leaves = {n: c[n].detach().clone().requires_grad_() for n in names}
    out = moe(leaves["x"], c["idx"], leaves["w"], leaves["w1"], leaves["w2"], b1=leaves.get("b1"),
              b2=leaves.get("b2"), activation=activation, schedule=schedule, recompute=recompute)
    return [out.detach(), *torch.autograd.grad(out, list(leaves.values()), c["gout"])]


def _oracle_grads(c: dict, activation: str) -> list[torch.Tensor]:
    """float64 [out, grads...] of sum_r <out_r, gout_r> for this rank's tensors (every rank's data
    gathered; per-expert vectorised torch, no ditron_ep kernel)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = _gather(torch.tensor([c["x"].shape[0]], device=c["x"].device))
    t_max = int(max(s.item() for s in sizes))

    def pad(t):
        return torch.cat([t, t.new_zeros((t_max - t.shape[0], *t.shape[1:]))]) if t.shape[0] < t_max else t

    xs, idxs, ws, gouts = (_gather(pad(c[n])) for n in ("x", "idx", "w", "gout"))
    idxs = [i.masked_fill(torch.arange(t_max, device=i.device)[:, None] >= s.item(), -1) for i, s in zip(idxs, sizes)]
    experts = {n: _gather(c[n]) for n in ("w1", "w2", "b1", "b2") if c[n] is not None}
    leaf = {n: [t.double().requires_grad_() for t in ts] for n, ts in
            {"x": xs, "w": ws, **experts}.items()}
    e_local = c["w1"].shape[0]
    loss = torch.zeros((), dtype=torch.float64, device=c["x"].device)
    out_mine = None
    for r in range(world):
        out = torch.zeros(t_max, H, dtype=torch.float64, device=c["x"].device)
        for e in idxs[r].unique().tolist():
            if e < 0:
                continue
            owner, local = divmod(e, e_local)
            t, k = (idxs[r] == e).nonzero(as_tuple=True)
            z = leaf["x"][r][t] @ leaf["w1"][owner][local] + (leaf["b1"][owner][local] if "b1" in leaf else 0)
            y = expert_activation(z, activation) @ leaf["w2"][owner][local] + (
                leaf["b2"][owner][local] if "b2" in leaf else 0)
            out = out.index_add(0, t, leaf["w"][r][t, k][:, None] * y)
        loss = loss + (out * gouts[r].double()).sum()
        if r == rank:
            out_mine = out.detach()
    names = ["x", "w", "w1", "w2"] + (["b1", "b2"] if "b1" in leaf else [])
    wanted = [leaf[n][rank] for n in names]
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    n_rows = c["x"].shape[0]
    return [out_mine[:n_rows], *((g if g is not None else torch.zeros_like(t))[:n_rows] if n in ("x", "w")
                                 else (g if g is not None else torch.zeros_like(t))
                                 for n, g, t in zip(names, grads, wanted))]


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)], ids=["swiglu", "gelu-bias"])
def test_moe_gradients_bitwise_across_schedules_and_close_to_float64(dist_env, activation, bias):
    c = _case(dist_env.device, activation, bias, seed=11)
    runs = {name: _grads(c, activation, *how) for name, how in RUNS.items()}
    want = _oracle_grads(c, activation)
    problems = []
    names = ["out", "x", "topk_weights", "w1", "w2", "b1", "b2"]
    for S, got in runs.items():
        if S != "staged" and not all(torch.equal(a, b) for a, b in zip(got[1:], runs["staged"][1:])):
            problems.append(f"{S}: gradients differ from staged's")
    for S in ("overlap recompute", "staged"):
        for name, g, ref in zip(names, runs[S], want):
            scale = float(ref.abs().max()) if ref.numel() else 0.0
            err = float((g.double() - ref).abs().max()) if ref.numel() else 0.0
            if not err <= 3e-2 * max(scale, 1e-6):
                problems.append(f"{S} {name}: max|err| {err:.3g} vs max|ref| {scale:.3g}")
    torch.cuda.synchronize()
    clear_cache()
    clear_layers()
    assert not problems, problems


def test_hundred_backward_passes_bitwise(dist_env):
    c = _case(dist_env.device, "swiglu", False, seed=12)
    first = _grads(c, "swiglu", "overlap")
    differ = sum(not all(torch.equal(a, b) for a, b in zip(first, _grads(c, "swiglu", "overlap")))
                 for _ in range(99))
    torch.cuda.synchronize()
    clear_cache()
    clear_layers()
    assert differ == 0, f"{differ} of 99 repeated forward + backward passes differ from the first"


def test_training_step_captured_in_a_cuda_graph(dist_env):
    """Forward + backward with sync=False (graph mode: no host read) captured in one CUDA graph and
    replayed on new inputs copied into its static tensors: the same output and gradient bits as
    eager default-mode steps on those inputs."""
    first, second = _case(dist_env.device, "swiglu", False, seed=13), _case(dist_env.device, "swiglu", False, seed=14)
    if first["x"].shape != second["x"].shape:
        pytest.fail("the two cases need one token count per rank")
    want = _grads(second, "swiglu", "overlap")  # eager, sync=True: also sizes the cached buffer
    names = ("x", "w", "w1", "w2")
    static = {n: first[n].detach().clone() for n in (*names, "idx", "gout")}
    leaves = [static[n].requires_grad_() for n in names]

    def step():
        out = moe(leaves[0], static["idx"], leaves[1], leaves[2], leaves[3], schedule="overlap", sync=False)
        return [out, *torch.autograd.grad(out, leaves, static["gout"])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (allocator, autograd)
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    with torch.no_grad():
        for n in (*names, "idx", "gout"):
            static[n].copy_(second[n])
    graph.replay()
    torch.cuda.synchronize()
    differ = [label for label, a, b in zip(("out", *names), captured, want) if not torch.equal(a, b)]
    clear_cache()
    clear_layers()
    assert not differ, f"the graph replay differs from eager steps in {differ}"
