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

    try:  # grad mode with trainable parameters: moe's NotImplementedError, not swallowed
        layer(x)
        report["grad_mode"] = "no error"
    except NotImplementedError as err:
        report["grad_mode"] = f"NotImplementedError: {err}"
    layer.requires_grad_(False)  # frozen: grad mode is fine, nothing needs the experts' backward
    out4, _ = layer(x)
    report["frozen_bitwise"] = torch.equal(out, out4)
    clear_cache()
    return report


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
