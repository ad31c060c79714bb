"""Megatron-core's `MoELayer` with `DitronTokenDispatcher` on CUDA ranks (bf16, NCCL), under torchrun
(tests/gpu/run_gpu_suite.sh). megatron-core must be installed (the test extra; 0.19.2 on the lent GPU
machines' Python 3.12, carried as a wheel). No TransformerEngine there: the experts are the local
spec's `SequentialMLP` (SwiGLU). Two layers with the same weights, one with Megatron's all-to-all
dispatcher and one given ours by `use_ditron_dispatcher`: the output and the gradients of the input,
the router and every expert weight agree within bf16 tolerance (Megatron adds a token's expert rows
in bf16, ours in fp32), and ours repeats bit for bit run to run."""
from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

H, I, E, K, T = 256, 512, 8, 2, 256
RTOL = 3e-2  # of each tensor's largest magnitude: bf16 (eps 7.8e-3), Megatron's bf16 sums of K rows


def _megatron():
    try:
        from megatron.core import parallel_state
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        pytest.fail(f"megatron-core is a test dependency: pip install 'ditron_ep[test]' (on the lent GPU machines, "
                    f"carry the megatron_core wheel): {exc}")
    return parallel_state, get_moe_module_spec, TransformerConfig


def _layer(W: int):
    """One MoELayer (all-to-all dispatcher, SwiGLU SequentialMLP experts, no aux loss) with weights
    drawn per global expert (router weights the same on every rank)."""
    _, get_moe_module_spec, TransformerConfig = _megatron()
    cfg = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=I, moe_ffn_hidden_size=I,
                            num_attention_heads=4, num_moe_experts=E, moe_router_topk=K,
                            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none",
                            moe_aux_loss_coeff=0.0, add_bias_linear=False, gated_linear_unit=True,
                            activation_func=torch.nn.functional.silu, bf16=True, params_dtype=torch.bfloat16,
                            use_cpu_initialization=True, expert_model_parallel_size=W)
    layer = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)(config=cfg).cuda()
    rank, e_local = dist.get_rank(), E // W
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "local_experts." in name:  # "...local_experts.<i>.linear_fc1.weight": global expert rank * e_local + i
                local, what = name.split("local_experts.")[1].split(".", 1)
                seed = zlib.crc32(f"{rank * e_local + int(local)}.{what}".encode())
            else:  # the router: the same on every rank
                seed = zlib.crc32(name.encode())
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * p.shape[-1] ** -0.5)
    return layer


def _run(layer, x, gout) -> list[torch.Tensor]:
    leaf = x.clone().requires_grad_()
    params = [p for _, p in sorted(layer.named_parameters())]
    out, _bias = layer(leaf)
    grads = torch.autograd.grad(out, [leaf, *params], gout, allow_unused=True)
    return [out.detach(), *(torch.zeros_like(p) if g is None else g for p, g in zip([leaf, *params], grads))]


def test_moe_layer_with_ditron_dispatcher_matches_alltoall(dist_env):
    from ditron_ep.integrations.megatron import use_ditron_dispatcher
    from ditron_ep.ops import clear_cache

    parallel_state = _megatron()[0]
    W, rank = dist_env.world, dist_env.rank
    problems, ours = [], None
    try:
        # Megatron's groups wait 30 minutes by default: a hang would outlive the suite's limit
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=W,
                                                 distributed_timeout_minutes=max(1, dist_env.timeout_s // 60))
        theirs, ours = _layer(W), _layer(W)
        replaced = use_ditron_dispatcher(ours)
        gen = torch.Generator().manual_seed(40 + rank)
        x = torch.randn(T, 1, H, generator=gen).to(device="cuda", dtype=torch.bfloat16)  # [seq, batch, hidden]
        gout = torch.randn(T, 1, H, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        want = _run(theirs, x, gout)
        got, again = _run(ours, x, gout), _run(ours, x, gout)
        names = ["output", "x", *(n for n, _ in sorted(ours.named_parameters()))]
        if replaced != 1:
            problems.append(f"use_ditron_dispatcher replaced {replaced} layers, not 1")
        for name, a, b, c in zip(names, got, want, again):
            err = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
            ref = float(b.float().abs().max()) if b.numel() else 0.0
            if not err <= RTOL * max(ref, 1e-6):
                problems.append(f"rank {rank} {name}: off the all-to-all dispatcher's by {err:.3e} (max {ref:.3e})")
            if not torch.equal(a, c):
                problems.append(f"rank {rank} {name}: two runs differ")
    except Exception as exc:  # noqa: BLE001 — reported after the groups are gone, on every rank
        problems.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        torch.cuda.synchronize()
        if ours is not None:  # its buffer, freed on every rank together (not by garbage collection)
            ours.token_dispatcher.free()
        clear_cache()
        parallel_state.destroy_model_parallel()
    assert not problems, "\n".join(problems)
