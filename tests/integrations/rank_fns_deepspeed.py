"""Rank side of the DeepSpeed integration tests (emulated gloo ranks, the real DeepSpeed package)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

H, I = 32, 16
ACTS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU, "silu": nn.SiLU,
        "tanh": nn.Tanh}  # tanh: experts="modules" only (the kernels have no tanh)


class SwiGLUExpert(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _init_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what torchrun would set (one host)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    return deepspeed


def _layer(num_experts: int, ep_size: int, k: int, capacity_factor: float, drop_tokens: bool, activation: str,
           bias: bool, seed: int, groups: bool = True):
    """A DeepSpeed MoE whose gate is the same on every rank and whose experts are distinct (each
    drawn from its global id); `groups`: create its process groups (deepspeed.initialize does
    otherwise)."""
    from deepspeed.moe.layer import MoE

    torch.manual_seed(seed)
    expert = SwiGLUExpert(bias) if activation == "swiglu" else nn.Sequential(
        nn.Linear(H, I, bias=bias), ACTS[activation](), nn.Linear(I, H, bias=bias))
    layer = MoE(H, expert, num_experts=num_experts, ep_size=ep_size, k=k, capacity_factor=capacity_factor,
                eval_capacity_factor=capacity_factor, min_capacity=1, drop_tokens=drop_tokens, use_rts=False,
                top2_2nd_expert_sampling=False)
    if groups:
        layer.set_deepspeed_parallelism()
    ep_rank = dist.get_rank() % ep_size  # DeepSpeed's default: consecutive ranks form an expert group
    with torch.no_grad():
        for i, ex in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            gen = torch.Generator().manual_seed(seed * 1000 + ep_rank * layer.num_local_experts + i)
            for p in ex.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return layer


def compare_case(num_experts: int, ep_size: int, k: int, capacity_factor: float, drop_tokens: bool,
                 activation: str, bias: bool, tokens: int, seed: int, experts: str = "kernels") -> dict:
    """DeepSpeed's own layer and a replaced copy (same parameters; replace_moe(experts=experts)) on
    the same input and upstream gradient: output, l_aux, exp_counts and every gradient; the
    replaced layer twice (bitwise)."""
    _init_deepspeed()
    from ditron_ep.integrations.deepspeed import replace_moe

    rank = dist.get_rank()
    ref, ours = (_layer(num_experts, ep_size, k, capacity_factor, drop_tokens, activation, bias, seed)
                 for _ in range(2))
    names = [n for n, _ in ref.named_parameters()]
    replaced = replace_moe(ours, experts=experts)
    same_params = [n for n, _ in ours.named_parameters()] == names
    # checkpoints: DeepSpeed's state loads into the replaced layer and back, strictly
    ours.load_state_dict(ref.state_dict(), strict=True)
    ref.load_state_dict(ours.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(seed * 77 + rank)
    x = torch.randn(2, tokens // 2, H, generator=gen)
    gout = torch.randn(x.shape, generator=gen)
    results = {}
    for label, layer in (("ref", ref), ("ours", ours), ("ours again", ours)):
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out, l_aux, counts = layer(leaf)
        ((out * gout).sum() + l_aux).backward()
        grads = {"x": leaf.grad, **{n: p.grad for n, p in layer.named_parameters()}}
        results[label] = (out.detach(), l_aux.detach(), counts.clone(), grads)
    errors = {}
    out_r, aux_r, cnt_r, g_r = results["ref"]
    out_o, aux_o, cnt_o, g_o = results["ours"]
    errors["out"] = float((out_o - out_r).abs().max()) / max(float(out_r.abs().max()), 1e-30)
    errors["l_aux"] = float((aux_o - aux_r).abs()) / max(float(aux_r.abs()), 1e-30)  # the gate's kernels: fp32 rounding
    for n, g in g_r.items():
        go = g_o.get(n)
        if g is None and go is None:
            continue
        if g is None or go is None:
            errors[f"grad {n}"] = float("inf") if (g if g is not None else go).abs().max() > 0 else 0.0
            continue
        errors[f"grad {n}"] = float((go - g).abs().max()) / max(float(g.abs().max()), 1e-30)
    with torch.no_grad():  # how many routes the capacity dropped (the gate's sparse routes)
        routes = ref.deepspeed_moe.gate(x.reshape(-1, H), None, True, False)[3]
    again = results["ours again"]
    bitwise = torch.equal(again[0], out_o) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(again[3].values(), g_o.values()))
    return {"replaced": replaced, "same_params": same_params, "errors": errors,
            "counts_equal": torch.equal(cnt_o, cnt_r),
            "dropped": int((routes < 0).sum()), "bitwise": bitwise}


def compare_cases(cases: list[tuple]) -> list[dict]:
    """compare_case for every argument tuple of `cases`, in one DeepSpeed initialisation."""
    return [compare_case(*case) for case in cases]


class TinyMoEModel(nn.Module):
    """Linear -> DeepSpeed MoE (k=2, ep_size=world) -> Linear, the loss its caller's."""

    def __init__(self, num_experts: int, ep_size: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(H, H)
        self.moe = _layer(num_experts, ep_size, 2, 1.0, True, "gelu", True, seed, groups=False)
        self.out = nn.Linear(H, H)

    def forward(self, x):
        y, l_aux, _ = self.moe(self.inp(x))
        return self.out(y), l_aux


def _training(zero_stage: int, steps: int, seed: int, experts: str = "kernels"):
    """(this rank's `steps` batches, engine(replaced) -> a TinyMoEModel under deepspeed.initialize
    with SGD and ZeRO `zero_stage` (replaced: replace_moe(experts=experts) first), train(engine,
    batches) -> losses)."""
    deepspeed = _init_deepspeed()
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from ditron_ep.integrations.deepspeed import replace_moe

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    data = [(torch.randn(12, H, generator=gen), torch.randn(12, H, generator=gen)) for _ in range(steps)]
    config = {"train_micro_batch_size_per_gpu": 12, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9}

    def engine(replaced: bool):
        model = TinyMoEModel(2 * world, world, seed)
        if replaced:
            assert replace_moe(model, experts=experts) == 1
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"})
        return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.1), config=config)[0]

    def train(eng, batches) -> list[float]:
        losses = []
        for x, target in batches:
            y, l_aux = eng(x)
            loss = ((y - target) ** 2).mean() + 0.01 * l_aux
            eng.backward(loss)
            eng.step()
            losses.append(float(loss.detach()))
        return losses

    return data, engine, train


def engine_case(zero_stage: int, steps: int, seed: int, experts: str = "kernels") -> dict:
    """`steps` SGD steps of TinyMoEModel under deepspeed.initialize (ZeRO `zero_stage`), with
    DeepSpeed's own MoE and with replace_moe(experts=experts): this rank's losses of both runs."""
    data, engine, train = _training(zero_stage, steps, seed, experts)
    runs = {"deepspeed": train(engine(False), data)}
    ours = engine(True)
    runs["ditron_ep"] = train(ours, data)
    # whether the experts' weights were read where ZeRO put them
    if experts == "kernels":
        runs["in_place"] = bool(ours.module.moe.deepspeed_moe._ditron_in_place)
    return runs


def checkpoint_case(zero_stage: int, steps: int, seed: int, ckpt_dir: str) -> dict:
    """Checkpoints through DeepSpeed's engine (`save_checkpoint` / `load_checkpoint`, ZeRO
    `zero_stage`): a run of DeepSpeed's own MoE saved halfway resumes in a replace_moe'd model, and
    a replace_moe'd run saved halfway resumes in DeepSpeed's own; this rank's losses of the second
    halves, against the uninterrupted DeepSpeed run's."""
    data, engine, train = _training(zero_stage, steps, seed)
    half = steps // 2
    theirs = engine(False)
    first = train(theirs, data[:half])
    theirs.save_checkpoint(ckpt_dir, tag="deepspeed")
    full = first + train(theirs, data[half:])
    ours = engine(True)
    ours.load_checkpoint(ckpt_dir, tag="deepspeed")
    resumed_ours = train(ours, data[half:])
    ours_first = engine(True)
    train(ours_first, data[:half])
    ours_first.save_checkpoint(ckpt_dir, tag="ditron_ep")
    back = engine(False)
    back.load_checkpoint(ckpt_dir, tag="ditron_ep")
    resumed_theirs = train(back, data[half:])
    fresh = train(engine(True), data[half:half + 1])  # no checkpoint: what a load that did nothing gives
    return {"full": full[half:], "deepspeed -> ditron_ep": resumed_ours, "ditron_ep -> deepspeed": resumed_theirs,
            "fresh": fresh}
