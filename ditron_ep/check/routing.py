"""Deterministic MoE routings for tests and the CLI, and the one routing validator.

A routing is a pair of tensors, for one rank's tokens:

* `topk_idx`     int64   [T, K] — global expert id of every (token, k) slot; -1 = dropped slot;
* `topk_weights` float32 [T, K] — combine weight of every slot; 0 for dropped slots.

`make_routing` draws one from a `torch.Generator`, so the same seed gives the same routing on
every machine. `validate_routing` is the single check that the reference, the oracle and the
ops run on a routing before they use it.
"""
from __future__ import annotations

import torch

ROUTING_KINDS = ("uniform", "zipf", "one_expert", "one_rank")

# Expert popularity for "zipf": expert e is chosen with weight 1 / (e + 1) ** ZIPF_EXPONENT,
# so low expert ids (and so rank 0) are hot — the skew that stresses uneven receive counts.
ZIPF_EXPONENT = 1.2


def make_routing(
    num_tokens: int,
    num_experts: int,
    topk: int,
    kind: str,
    *,
    generator: torch.Generator,
    drop_prob: float = 0.0,
    num_ranks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw a routing of `num_tokens` tokens over `num_experts` experts, `topk` slots each.

    Args:
        num_tokens: T >= 0, tokens on this rank.
        num_experts: E >= 1, experts in the whole EP group.
        topk: K, 1 <= K <= E, slots per token.
        kind: how experts are chosen; the experts of one token are always distinct:
            * "uniform"    — K distinct experts, uniformly at random;
            * "zipf"       — K distinct experts, expert e drawn with weight 1/(e+1)^1.2
                             (sampling without replacement, so hot experts saturate);
            * "one_expert" — slot 0 of every token is expert 0, slots 1..K-1 are dropped (-1);
            * "one_rank"   — K distinct experts among those of rank 0 (ids < E / num_ranks);
                             slots beyond E / num_ranks are dropped. Needs `num_ranks`.
        generator: the only source of randomness (CPU generator).
        drop_prob: probability, independently per slot, that a slot is dropped (-1).
        num_ranks: EP world size; required by kind "one_rank", ignored otherwise.

    Returns:
        topk_idx: int64 [T, K], global expert ids in [0, E) or -1.
        topk_weights: float32 [T, K], softmax of random logits over each token's kept slots;
            0 for dropped slots (a token with every slot dropped has all-zero weights).
    """
    _check_routing_args(num_tokens, num_experts, topk, kind, generator, drop_prob, num_ranks)
    # Draw every random tensor in a fixed order, whatever the kind, so that the weights and the
    # drop mask of a seed do not depend on `kind`.
    expert_keys = torch.rand(num_tokens, num_experts, generator=generator, dtype=torch.float64)
    drop_draw = torch.rand(num_tokens, topk, generator=generator, dtype=torch.float64)
    logits = torch.randn(num_tokens, topk, generator=generator, dtype=torch.float32)

    if kind == "uniform":
        topk_idx = _top_keys(expert_keys, topk)
    elif kind == "zipf":
        popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** ZIPF_EXPONENT
        # Gumbel top-k: the K largest log(p) + Gumbel keys are a sample without replacement
        # with probabilities proportional to p.
        gumbel = -torch.log(-torch.log(expert_keys.clamp_min(1e-300)))
        topk_idx = _top_keys(popularity.log() + gumbel, topk)
    elif kind == "one_expert":
        topk_idx = torch.full((num_tokens, topk), -1, dtype=torch.int64)
        topk_idx[:, 0] = 0
    else:  # "one_rank"
        assert num_ranks is not None
        experts_of_rank0 = num_experts // num_ranks
        kept = min(topk, experts_of_rank0)
        topk_idx = torch.full((num_tokens, topk), -1, dtype=torch.int64)
        topk_idx[:, :kept] = _top_keys(expert_keys[:, :experts_of_rank0], kept)

    topk_idx = torch.where(drop_draw < drop_prob, torch.full_like(topk_idx, -1), topk_idx)
    dropped = topk_idx < 0
    weights = torch.softmax(logits.masked_fill(dropped, float("-inf")), dim=-1)
    # A token with every slot dropped gets NaN from the softmax; it must get zeros.
    topk_weights = torch.where(dropped, torch.zeros_like(weights), weights)
    return topk_idx.contiguous(), topk_weights.contiguous()


def validate_routing(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    num_tokens: int,
) -> None:
    """Raise ValueError, saying what to fix, unless (`topk_idx`, `topk_weights`) is a routing.

    Checks: both are 2-D contiguous tensors of shape [num_tokens, K] on one device, K >= 1;
    `topk_idx` has an integer dtype and every id lies in [-1, num_experts); `topk_weights` has
    a floating dtype. Reads `topk_idx` values (a host sync on a GPU).
    """
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 2:
            raise ValueError(
                f"{name} must be 2-D [num_tokens, topk], got shape {tuple(t.shape)}; "
                f"reshape it to [{num_tokens}, topk]")
        if t.shape[0] != num_tokens:
            raise ValueError(
                f"{name} has {t.shape[0]} rows but there are {num_tokens} tokens; "
                f"it needs one row per token of x")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")
    if topk_idx.shape != topk_weights.shape:
        raise ValueError(
            f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must have the same shape [num_tokens, topk]")
    if topk_idx.shape[1] < 1:
        raise ValueError("topk must be >= 1: topk_idx needs at least one column")
    if topk_idx.device != topk_weights.device:
        raise ValueError(
            f"topk_idx is on {topk_idx.device} but topk_weights on {topk_weights.device}; "
            f"move both to the device of x")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise ValueError(
            f"topk_idx must have an integer dtype (int64 or int32), got {topk_idx.dtype}; "
            f"convert it with topk_idx.long()")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"topk_weights must have a floating dtype (float32 recommended), got "
            f"{topk_weights.dtype}; convert it with topk_weights.float()")
    if topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(
                f"topk_idx holds expert ids in [{lo}, {hi}] but they must lie in "
                f"[-1, {num_experts}) (-1 marks a dropped slot); check num_experts={num_experts}")


def _top_keys(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest keys of each row, largest first (int64 [rows, k])."""
    return torch.topk(keys, k, dim=-1, sorted=True).indices.to(torch.int64)


def _check_routing_args(num_tokens: int, num_experts: int, topk: int, kind: str,
                        generator: torch.Generator, drop_prob: float,
                        num_ranks: int | None) -> None:
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= topk <= num_experts:
        raise ValueError(
            f"topk must lie in [1, num_experts={num_experts}] because the experts of one token "
            f"are distinct; got topk={topk}")
    if kind not in ROUTING_KINDS:
        raise ValueError(f"unknown routing kind {kind!r}; choose one of {', '.join(ROUTING_KINDS)}")
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            "generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)); "
            "routings are drawn only from it so they are reproducible")
    if generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU generator, got one on {generator.device}")
    if not 0.0 <= drop_prob <= 1.0:
        raise ValueError(f"drop_prob must lie in [0, 1], got {drop_prob}")
    if kind == "one_rank":
        if num_ranks is None or num_ranks < 1:
            raise ValueError("kind 'one_rank' needs num_ranks=<EP world size> (>= 1)")
        if num_experts % num_ranks != 0:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by num_ranks={num_ranks} "
                f"so that every rank owns the same number of experts")
