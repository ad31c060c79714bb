"""The MoE layer shape the GPU diagnostics run (E=64, top-8, H=7168, I=2048, bf16) and this rank's
inputs for it (imported by the scripts beside it: torchrun puts their folder on sys.path)."""
import torch

from ditron_ep.check.routing import make_routing

E, K, H, I = 64, 8, 7168, 2048


def layer_inputs(T: int, rank: int, world: int):
    """(x, topk_idx, topk_weights, w1, w2) on the current CUDA device: uniform top-K routing drawn
    from a generator seeded with the rank, random tokens, weights scaled by H^-1/2 and I^-1/2."""
    e_local = E // world
    g = torch.Generator().manual_seed(rank)
    idx, w = make_routing(T, E, K, "uniform", generator=g, num_ranks=world)
    x = torch.randn(T, H, device="cuda").bfloat16()
    w1 = (torch.randn(e_local, H, 2 * I, device="cuda") * H ** -0.5).bfloat16()
    w2 = (torch.randn(e_local, I, H, device="cuda") * I ** -0.5).bfloat16()
    return x, idx.cuda(), w.cuda(), w1, w2
