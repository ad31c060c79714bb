"""Rank-side `EPMoE` checks (imported by name in emulated rank processes).

The float64 reference gathers every rank's expert weights and recomputes router, top-k and the
experts with plain per-token loops; it shares no code with `EPMoE` or the kernels.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ditron_ep.check import assert_close_to_oracle
from ditron_ep.ops import clear_cache, clear_layers
from ditron_ep.ops.moe_layer.experts import expert_activation
from ditron_ep.ops.moe_layer.module import EPMoE

H, I, K = 32, 16, 2


def _reference(x: torch.Tensor, router: torch.Tensor, w1s: list[torch.Tensor], w2s: list[torch.Tensor],
               score_func: str, renormalize: bool, aux_coef: float) -> tuple[torch.Tensor, float, list]:
    """(out [T, H] float64, aux loss, chosen experts per token) for this rank's tokens x [T, H]."""
    num_local = w1s[0].shape[0]
    num_experts = num_local * len(w1s)
    x64, r64 = x.to(torch.float64), router.to(torch.float64)
    out = torch.zeros_like(x64)
    counts = [0] * num_experts
    prob_sum = [0.0] * num_experts
    chosen = []
    for t in range(x64.shape[0]):
        logits = [float(x64[t] @ r64[e]) for e in range(num_experts)]
        if score_func == "softmax":
            peak = max(logits)
            exps = [math.exp(v - peak) for v in logits]
            scores = [v / sum(exps) for v in exps]
            probs = scores
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in logits]
            probs = [s / sum(scores) for s in scores]
        top = sorted(range(num_experts), key=lambda e: (-scores[e], e))[:K]  # ties: lower id first
        weights = [scores[e] for e in top]
        if renormalize:
            weights = [w / sum(weights) for w in weights]
        chosen.append(top)
        for e, w in zip(top, weights):
            owner, local = divmod(e, num_local)
            h = x64[t] @ w1s[owner][local].to(torch.float64)  # [2I]
            act = torch.nn.functional.silu(h[:I]) * h[I:]
            out[t] += w * (act @ w2s[owner][local].to(torch.float64))
            counts[e] += 1
        for e in range(num_experts):
            prob_sum[e] += probs[e]
    num_tokens = x64.shape[0]
    aux = 0.0 if num_tokens == 0 else aux_coef * num_experts * sum(
        counts[e] / (num_tokens * K) * prob_sum[e] / num_tokens for e in range(num_experts))
    return out, aux, chosen


def forward_case(tokens: list[int], num_experts: int, score_func: str, renormalize: bool, seed: int,
                 zero_router: bool = False, aux_coef: float = 0.01) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed * 100 + rank)  # different on every rank: the router needs sync_router_
    layer = EPMoE(H, I, num_experts, K, score_func=score_func, renormalize=renormalize, aux_loss_coef=aux_coef)
    layer.sync_router_(src=0)
    if zero_router:  # every score ties: top-k must pick experts 0..K-1
        with torch.no_grad():
            layer.router_weight.zero_()
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(1, tokens[rank], H, generator=g)  # [..., H] with a leading dim
    gathered = [None] * world
    dist.all_gather_object(gathered, (layer.router_weight.detach(), layer.w1.detach(), layer.w2.detach()))
    routers, w1s, w2s = zip(*gathered)
    report = {"router_synced": all(torch.equal(r, routers[0]) for r in routers),
              "repr": repr(layer)}

    with torch.no_grad():
        out, aux = layer(x)
        out2, aux2 = layer(x)
    with torch.inference_mode():
        out3, aux3 = layer(x)
    ref, ref_aux, chosen = _reference(x.reshape(-1, H), routers[0], list(w1s), list(w2s), score_func,
                                      renormalize, aux_coef)
    report["shapes"] = (tuple(out.shape), tuple(aux.shape), out.dtype, aux.dtype)
    try:
        assert_close_to_oracle(out.reshape(-1, H), ref, torch.float32, f"rank {rank} EPMoE output")
        report["out_error"] = None
    except AssertionError as err:
        report["out_error"] = str(err)
    report["aux"], report["ref_aux"] = float(aux), ref_aux
    report["chosen"] = chosen
    report["bitwise"] = torch.equal(out, out2) and torch.equal(aux, aux2)
    report["inference_mode_bitwise"] = torch.equal(out, out3) and torch.equal(aux, aux3)

    layer.recompute = True  # grad mode, trainable parameters, activation checkpointing: the fused forward
    out5, aux5 = layer(x)
    layer.recompute = False
    report["grad_mode_bitwise"] = torch.equal(out5.detach(), out) and out5.requires_grad
    layer.requires_grad_(False)  # frozen: grad mode is fine, nothing needs the experts' backward
    out4, _ = layer(x)
    report["frozen_bitwise"] = torch.equal(out, out4)
    clear_cache()
    return report


def _reference_forward(xs, routers, w1s, w2s, score_func: str, renormalize: bool, aux_coef: float,
                       activation: str = "swiglu", b1s=None, b2s=None) -> list:
    """Every rank's (out [T, H], aux loss) in float64, differentiable: routing by a stable sort of
    the scores (a plain reimplementation), experts by per-slot loops; rank s routes with routers[s]."""
    num_local = w1s[0].shape[0]
    num_experts = num_local * len(w1s)
    results = []
    for x, router in zip(xs, routers):
        logits = x @ router.T  # [T, E]
        scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
        probs = scores if score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        rows, counts = [], torch.zeros(num_experts, dtype=torch.float64)
        for t in range(x.shape[0]):
            top = sorted(range(num_experts), key=lambda e: (-float(scores[t, e]), e))[:K]
            weights = scores[t, top]
            if renormalize:
                weights = weights / weights.sum()
            row = torch.zeros(x.shape[1], dtype=torch.float64)
            for e, w in zip(top, weights):
                owner, local = divmod(e, num_local)
                z = x[t] @ w1s[owner][local] + (0 if b1s is None else b1s[owner][local])
                row = row + w * (expert_activation(z, activation) @ w2s[owner][local]
                                 + (0 if b2s is None else b2s[owner][local]))
                counts[e] += 1
            rows.append(row)
        out = torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=torch.float64)
        aux = (aux_coef * num_experts * (counts / (x.shape[0] * K) * probs.mean(0)).sum() if x.shape[0]
               else torch.zeros((), dtype=torch.float64))
        results.append((out, aux))
    return results


def training_case(tokens: list[int], num_experts: int, score_func: str, renormalize: bool, seed: int,
                  activation: str = "swiglu", bias: bool = False, schedule: str = "staged") -> dict:
    """EPMoE under grad mode: loss = <out, gout> + aux; the gradients of x, the router and this
    rank's experts (and biases) against float64 autograd of a plain reimplementation over every
    rank's tokens (the router is a replica: its gradient is this rank's own loss's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed * 100 + rank)
    layer = EPMoE(H, I, num_experts, K, score_func=score_func, renormalize=renormalize, aux_loss_coef=0.01,
                  schedule=schedule, activation=activation, bias=bias).sync_router_(src=0)
    if bias:  # zero at initialisation: make them count
        with torch.no_grad():
            layer.b1.normal_()
            layer.b2.normal_()
    xs = [torch.randn(t, H, generator=torch.Generator().manual_seed(seed * 1000 + r)) for r, t in enumerate(tokens)]
    gouts = [torch.randn(t, H, generator=torch.Generator().manual_seed(seed * 77 + r)) for r, t in enumerate(tokens)]
    gathered = [None] * world
    dist.all_gather_object(gathered, [None if p is None else p.detach() for p in (layer.w1, layer.w2, layer.b1,
                                                                                   layer.b2)])
    w1s, w2s, b1s, b2s = (list(ws) for ws in zip(*gathered))
    x = xs[rank].clone().requires_grad_()
    out, aux = layer(x)
    ((out * gouts[rank]).sum() + aux).backward()
    got = {"x": x.grad, "router": layer.router_weight.grad, "w1": layer.w1.grad, "w2": layer.w2.grad}
    if bias:
        got.update(b1=layer.b1.grad, b2=layer.b2.grad)

    leaves_x = [t.to(torch.float64).requires_grad_() for t in xs]
    routers = [layer.router_weight.detach().to(torch.float64).requires_grad_() for _ in range(world)]
    leaves_w1 = [w.to(torch.float64).requires_grad_() for w in w1s]
    leaves_w2 = [w.to(torch.float64).requires_grad_() for w in w2s]
    leaves_b1, leaves_b2 = ([b.to(torch.float64).requires_grad_() for b in bs] if bias else None for bs in (b1s, b2s))
    ref = _reference_forward(leaves_x, routers, leaves_w1, leaves_w2, score_func, renormalize, 0.01, activation,
                             leaves_b1, leaves_b2)
    sum((out_s * g.to(torch.float64)).sum() + aux_s for (out_s, aux_s), g in zip(ref, gouts)).backward()
    want = {"x": leaves_x[rank].grad, "router": routers[rank].grad, "w1": leaves_w1[rank].grad,
            "w2": leaves_w2[rank].grad}
    if bias:
        want.update(b1=leaves_b1[rank].grad, b2=leaves_b2[rank].grad)
    errors = {}
    for name, ref in want.items():
        ref = ref if ref is not None else torch.zeros_like(got[name], dtype=torch.float64)
        g = got[name] if got[name] is not None else torch.full_like(ref, float("nan"))
        errors[name] = (float((g.to(torch.float64) - ref).abs().max()) if ref.numel() else 0.0,
                        float(ref.abs().max()) if ref.numel() else 0.0)
    clear_cache()
    return {"errors": errors, "state_dict_keys": sorted(layer.state_dict())}


def training_loop_case(tokens: list[int], num_experts: int, steps: int, repeat_steps: int, seed: int) -> dict:
    """A tiny MoE model trained by SGD for `steps` steps with EPMoE(schedule="staged") (router
    gradient averaged over the ranks, as data parallelism does), again for `repeat_steps` from the
    same start; and
    the same loop in float64 over every rank in one process (no ditron_ep code). Returns this
    rank's losses of the three runs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    lr = 0.5
    torch.manual_seed(seed * 100 + rank)
    layer = EPMoE(H, I, num_experts, K, score_func="softmax", renormalize=False, aux_loss_coef=0.01,
                  schedule="staged").sync_router_(src=0)
    start = {name: p.detach().clone() for name, p in layer.named_parameters()}
    gathered = [None] * world
    dist.all_gather_object(gathered, (start["w1"], start["w2"]))
    xs = [torch.randn(t, H, generator=torch.Generator().manual_seed(seed * 1000 + r)) for r, t in enumerate(tokens)]
    targets = [torch.randn(t, H, generator=torch.Generator().manual_seed(seed * 99 + r)) for r, t in enumerate(tokens)]

    def head(out, target):  # a rank's loss: mean squared error
        return ((out - target) ** 2).mean()

    runs = []
    for run_steps in (steps, repeat_steps):
        with torch.no_grad():
            for name, param in layer.named_parameters():
                param.copy_(start[name])
        losses = []
        for _ in range(run_steps):
            layer.zero_grad(set_to_none=False)
            out, aux = layer(xs[rank])
            loss = head(out, targets[rank]) + aux
            loss.backward()
            dist.all_reduce(layer.router_weight.grad)
            with torch.no_grad():
                layer.router_weight.grad /= world
                for param in layer.parameters():
                    param -= lr * param.grad
            losses.append(float(loss.detach()))
        runs.append(losses)
    clear_cache()

    router = start["router_weight"].to(torch.float64)
    w1s = [w.to(torch.float64) for w, _ in gathered]
    w2s = [w.to(torch.float64) for _, w in gathered]
    x64, t64 = [x.to(torch.float64) for x in xs], [t.to(torch.float64) for t in targets]
    reference = []
    for _ in range(steps):
        routers = [router.clone().requires_grad_() for _ in range(world)]
        w1s, w2s = [w.detach().requires_grad_() for w in w1s], [w.detach().requires_grad_() for w in w2s]
        fwd = _reference_forward(x64, routers, w1s, w2s, "softmax", False, 0.01)
        per_rank = [head(out, target) + aux for (out, aux), target in zip(fwd, t64)]
        sum(per_rank).backward()
        reference.append(float(per_rank[rank]))
        with torch.no_grad():
            router = router - lr * sum(r.grad for r in routers) / world
            w1s = [w - lr * w.grad if w.grad is not None else w for w in w1s]  # no tokens: no gradient
            w2s = [w - lr * w.grad if w.grad is not None else w for w in w2s]
    return {"losses": runs[0], "again": runs[1], "reference": reference}


def error_cases() -> dict:
    """Bad constructor / forward arguments: DitronConfigError (a ValueError) on every rank, before
    any collective."""
    world = dist.get_world_size()
    res = {}

    def catch(key, fn):
        try:
            fn()
            res[key] = "no error"
        except Exception as err:  # noqa: BLE001  (the test asserts on the type)
            res[key] = f"{type(err).__name__}: {err}"

    catch("not_divisible", lambda: EPMoE(H, I, world + 1, 1))
    catch("topk_gt_experts", lambda: EPMoE(H, I, world, world + 1))
    catch("topk_zero", lambda: EPMoE(H, I, world, 0))
    catch("hidden_zero", lambda: EPMoE(0, I, world, 1))
    catch("ffn_float", lambda: EPMoE(H, 16.0, world, 1))
    catch("score_func", lambda: EPMoE(H, I, world, 1, score_func="relu"))
    catch("schedule", lambda: EPMoE(H, I, world, 1, schedule="fused"))
    catch("aux_negative", lambda: EPMoE(H, I, world, 1, aux_loss_coef=-0.1))
    catch("router_dtype", lambda: EPMoE(H, I, world, 1, router_dtype=torch.int32))
    catch("router_fp8", lambda: EPMoE(H, I, world, 1, router_dtype=torch.float8_e4m3fn))
    catch("group_list", lambda: EPMoE(H, I, world, 1, group=list(range(world))))
    only_rank0 = dist.new_group([0])  # collective: every rank creates it, rank 0 alone is a member
    if dist.get_rank() != 0:
        catch("not_member", lambda: EPMoE(H, I, 1, 1, group=only_rank0))
    catch("dtype", lambda: EPMoE(H, I, world, 1, dtype=torch.float64))
    catch("renormalize", lambda: EPMoE(H, I, world, 1, renormalize="yes"))
    catch("too_many_local", lambda: EPMoE(H, I, 257 * world, 1))
    layer = EPMoE(H, I, 2 * world, K)
    catch("sync_src", lambda: layer.sync_router_(src=world))
    with torch.no_grad():
        catch("x_hidden", lambda: layer(torch.randn(4, H + 1)))
        catch("x_dtype", lambda: layer(torch.randn(4, H, dtype=torch.float16)))
        catch("x_float64", lambda: layer(torch.randn(4, H, dtype=torch.float64)))
    return res


def init_case(num_experts: int) -> dict:
    """Seeded alike, the ranks hold distinct experts, the same ones (by global id) as a layer over
    a group of one rank holding them all; router_dtype follows a cast of the layer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    layer = EPMoE(H, I, num_experts, K)
    solo_groups = [dist.new_group([r]) for r in range(world)]  # collective, in the same order everywhere
    torch.manual_seed(7)
    solo = EPMoE(H, I, num_experts, K, group=solo_groups[rank])
    e_local = num_experts // world
    gathered = [None] * world
    dist.all_gather_object(gathered, layer.w1.detach())
    first = rank * e_local
    res = {
        "distinct_across_ranks": all(not torch.equal(gathered[a][0], gathered[b][0])
                                     for a in range(world) for b in range(a + 1, world)),
        "distinct_within_rank": not torch.equal(layer.w1[0], layer.w1[1]) if e_local > 1 else True,
        "same_as_solo": torch.equal(layer.w1, solo.w1[first:first + e_local])
                        and torch.equal(layer.w2, solo.w2[first:first + e_local]),
        "router_same": torch.equal(layer.router_weight, solo.router_weight),
        "w1_std": float(solo.w1.std()), "w2_std": float(solo.w2.std()),
    }
    layer.half()
    res["router_dtype_after_half"] = str(layer.router_dtype)
    res["repr_after_half"] = repr(layer)
    with torch.device("meta"):  # deferred initialisation: build on meta, then to_empty + reset
        deferred = EPMoE(H, I, num_experts, K)
    deferred.to_empty(device="cpu")
    torch.manual_seed(7)
    deferred.reset_parameters()
    torch.manual_seed(7)
    eager = EPMoE(H, I, num_experts, K)
    res["deferred_same"] = torch.equal(deferred.w1, eager.w1) and torch.equal(deferred.router_weight,
                                                                            eager.router_weight)
    return res


def lone_bad_x_case() -> dict:
    """One rank passes EPMoE an x of the wrong width: it raises DitronConfigError and joins its
    peers' call flagged through the cached layer, so they raise DitronConfigError naming it at once;
    the next call is bitwise the first."""
    import time

    from ditron_ep.runtime import DitronConfigError

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    layer = EPMoE(H, I, 2 * world, K)
    x = torch.randn(5 + rank, H, generator=torch.Generator().manual_seed(rank))
    res = {}
    with torch.no_grad():
        first, _ = layer(x)
        t0 = time.monotonic()
        try:
            layer(torch.randn(5, H + 1) if rank == 1 else x)
            res["bad"] = "no error"
        except DitronConfigError as err:
            res["bad"] = f"{type(err).__name__}: {err}"
        res["bad_s"] = time.monotonic() - t0
        res["after"] = torch.equal(layer(x)[0], first)
    clear_layers()
    return res
