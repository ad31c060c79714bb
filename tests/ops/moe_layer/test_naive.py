"""The float64 oracle, the routing generators, and the sequential EP reference against the oracle.

Multi-rank tests run on emulated ranks (CPU processes over gloo) from the `emulated_cluster`
fixture; inputs are built in the parent from a seeded generator and passed to every rank.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from ditron_ep.check.routing import make_routing, validate_routing
from ditron_ep.check.selfcheck import MoEInputs
from ditron_ep.check.tolerances import assert_close_to_oracle
from ditron_ep.ops.moe_layer.naive import ep_moe_oracle, ep_moe_reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(tokens: list[int], hidden: int, inter: int, num_experts: int, topk: int,
                kind: str, dtype: torch.dtype, *, drop_prob: float = 0.0,
                seed: int = 0) -> MoEInputs:
    """Seeded inputs for len(tokens) ranks; scaled so outputs are of order 1."""
    gen = torch.Generator().manual_seed(seed)
    world_size = len(tokens)
    num_local = num_experts // world_size
    xs, idxs, weights, w1s, w2s = [], [], [], [], []
    for num_tokens in tokens:
        xs.append(torch.randn(num_tokens, hidden, generator=gen).to(dtype))
        idx, w = make_routing(num_tokens, num_experts, topk, kind, generator=gen,
                              drop_prob=drop_prob, num_ranks=world_size)
        idxs.append(idx)
        weights.append(w)
        w1s.append((torch.randn(num_local, hidden, 2 * inter, generator=gen) / hidden ** 0.5)
                   .to(dtype))
        w2s.append((torch.randn(num_local, inter, hidden, generator=gen) / inter ** 0.5)
                   .to(dtype))
    return MoEInputs(xs, idxs, weights, w1s, w2s, num_experts, [torch.zeros_like(x) for x in xs])


# ----------------------------------------------------------------------------- rank functions
def _reference_on_rank(inputs: MoEInputs, repeats: int = 1) -> list[torch.Tensor]:
    rank = dist.get_rank()
    return [ep_moe_reference(inputs.xs[rank], inputs.topk_idxs[rank], inputs.topk_weights[rank],
                             inputs.w1s[rank], inputs.w2s[rank], num_experts=inputs.num_experts)
            for _ in range(repeats)]


def _reference_error_on_rank(inputs: MoEInputs) -> str | None:
    try:
        _reference_on_rank(inputs)
    except ValueError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------- (a) oracle
def _silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def test_oracle_hand_checked_top1() -> None:
    # Two ranks, two experts each (H=16, I=8). Token t is a * e_j; every expert reads x[j] into
    # gate[0] and up[0] with up scaled by (expert + 1), and w2 maps act[0] to out[j'], so
    # out[t] = w * silu(a) * a * (expert + 1) at one known position: hand-computable.
    hidden, inter, world_size, num_local = 16, 8, 2, 2
    w1s = [torch.zeros(num_local, hidden, 2 * inter) for _ in range(world_size)]
    w2s = [torch.zeros(num_local, inter, hidden) for _ in range(world_size)]
    for r in range(world_size):
        for local in range(num_local):
            expert = r * num_local + local
            w1s[r][local, 3, 0] = 1.0  # gate[0] = x[3]
            w1s[r][local, 3, inter] = expert + 1.0  # up[0] = (expert + 1) * x[3]
            w2s[r][local, 0, 5 + expert] = 1.0  # out[5 + expert] = act[0]
    a_values = [0.5, -1.25, 2.0]
    xs = [torch.zeros(3, hidden), torch.zeros(0, hidden)]
    for t, a in enumerate(a_values):
        xs[0][t, 3] = a
    topk_idx = [torch.tensor([[0], [3], [2]]), torch.zeros(0, 1, dtype=torch.int64)]
    topk_w = [torch.tensor([[1.0], [0.5], [2.0]]), torch.zeros(0, 1)]
    outs = ep_moe_oracle(xs, topk_idx, topk_w, w1s, w2s)

    expected = torch.zeros(3, hidden, dtype=torch.float64)
    for t, (a, expert, w) in enumerate(zip(a_values, [0, 3, 2], [1.0, 0.5, 2.0])):
        expected[t, 5 + expert] = w * _silu(a) * a * (expert + 1)
    assert outs[0].dtype == torch.float64
    torch.testing.assert_close(outs[0], expected, rtol=1e-12, atol=1e-12)
    assert outs[1].shape == (0, hidden)


def test_oracle_sums_slots_and_ignores_dropped() -> None:
    inputs = make_inputs([6, 5], 16, 8, 4, 2, "uniform", torch.float32, seed=1)
    both = inputs.oracle()
    per_slot = []
    for k in range(2):
        keep = [idx[:, k:k + 1].contiguous() for idx in inputs.topk_idxs]
        weights = [w[:, k:k + 1].contiguous() for w in inputs.topk_weights]
        per_slot.append(replace(inputs, topk_idxs=keep, topk_weights=weights).oracle())
    for r in range(2):
        torch.testing.assert_close(both[r], per_slot[0][r] + per_slot[1][r], rtol=1e-12,
                                   atol=1e-12)

    # Dropping slot 1 (even with a nonzero weight left in place) leaves only slot 0.
    dropped = [idx.clone() for idx in inputs.topk_idxs]
    for idx in dropped:
        idx[:, 1] = -1
    outs = replace(inputs, topk_idxs=dropped).oracle()
    for r in range(2):
        torch.testing.assert_close(outs[r], per_slot[0][r], rtol=0, atol=0)


def test_oracle_all_dropped_and_empty() -> None:
    inputs = make_inputs([4, 0], 16, 8, 4, 2, "uniform", torch.float32, drop_prob=1.0)
    outs = inputs.oracle()
    assert torch.equal(outs[0], torch.zeros(4, 16, dtype=torch.float64))
    assert outs[1].shape == (0, 16) and outs[1].dtype == torch.float64


# ----------------------------------------------------------------------------- routings
@pytest.mark.parametrize("kind", ["uniform", "zipf", "one_expert", "one_rank"])
def test_make_routing_is_seeded_and_well_formed(kind: str) -> None:
    def draw(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_routing(40, 8, 3, kind, generator=torch.Generator().manual_seed(seed),
                            drop_prob=0.25, num_ranks=4)

    idx, w = draw(7)
    idx_again, w_again = draw(7)
    assert torch.equal(idx, idx_again) and torch.equal(w, w_again)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (40, 3)
    validate_routing(idx, w, num_experts=8, num_tokens=40)
    for row in idx.tolist():
        kept = [e for e in row if e >= 0]
        assert len(kept) == len(set(kept)), f"experts of one token must be distinct: {row}"
    assert torch.all(w[idx < 0] == 0)
    has_kept = (idx >= 0).any(dim=1)
    torch.testing.assert_close(w[has_kept].sum(dim=1), torch.ones(int(has_kept.sum())))
    if kind == "one_expert":
        assert torch.all(idx[:, 1:] == -1) and torch.all(idx[:, 0] <= 0)
    if kind == "one_rank":
        assert int(idx.max()) < 2  # rank 0 owns experts 0 and 1 of 8 over 4 ranks


def test_zipf_routing_is_skewed() -> None:
    idx, _ = make_routing(400, 16, 2, "zipf", generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(idx.reshape(-1), minlength=16)
    assert counts[0] > 3 * counts[15] and counts[0] == counts.max()


# ----------------------------------------------------------------------------- (b) reference
# (world size, tokens of rank 0, H, I, E, K); rank r holds max(1, T - 3r) tokens.
SHAPES = [(2, 24, 32, 16, 8, 2), (3, 17, 16, 8, 6, 3), (4, 40, 64, 32, 16, 4)]
# name -> (routing kind, drop probability, last rank empty)
ROUTINGS = {
    "uniform": ("uniform", 0.0, False),
    "zipf": ("zipf", 0.0, False),
    "one_expert": ("one_expert", 0.0, False),
    "one_rank": ("one_rank", 0.0, False),
    "drops": ("uniform", 0.3, False),
    "empty_rank": ("zipf", 0.1, True),
}
REFERENCE_CASES = [
    pytest.param(shape, routing, dtype_name,
                 id="W{}-T{}-H{}-E{}-K{}-{}-{}".format(*shape[:3], *shape[4:], routing,
                                                         dtype_name))
    for shape in SHAPES for routing in ROUTINGS for dtype_name in DTYPES
]


@pytest.mark.parametrize("shape, routing, dtype_name", REFERENCE_CASES)
def test_reference_matches_oracle(emulated_cluster, shape: tuple[int, ...], routing: str,
                                  dtype_name: str) -> None:
    world_size, num_tokens, hidden, inter, num_experts, topk = shape
    kind, drop_prob, last_rank_empty = ROUTINGS[routing]
    dtype = DTYPES[dtype_name]
    tokens = [max(1, num_tokens - 3 * r) for r in range(world_size)]
    if last_rank_empty:
        tokens[-1] = 0
    inputs = make_inputs(tokens, hidden, inter, num_experts, topk, kind, dtype,
                         drop_prob=drop_prob, seed=sum(shape) + len(routing))
    results = emulated_cluster(world_size).run(_reference_on_rank, inputs, 2)
    expected = inputs.oracle()
    for rank, (first, second) in enumerate(results):
        assert first.dtype == dtype and first.shape == (tokens[rank], hidden)
        assert torch.equal(first, second), f"rank {rank}: two runs differ bitwise"
        assert_close_to_oracle(first, expected[rank], dtype, f"rank {rank} output")


# ----------------------------------------------------------------------------- (c) bad inputs
@pytest.mark.parametrize("kwargs, match", [
    (dict(num_tokens=4, num_experts=4, topk=5, kind="uniform"), "topk must lie in"),
    (dict(num_tokens=4, num_experts=4, topk=0, kind="uniform"), "topk must lie in"),
    (dict(num_tokens=-1, num_experts=4, topk=1, kind="uniform"), "num_tokens"),
    (dict(num_tokens=4, num_experts=4, topk=1, kind="normal"), "unknown routing kind"),
    (dict(num_tokens=4, num_experts=4, topk=1, kind="uniform", drop_prob=1.5), "drop_prob"),
    (dict(num_tokens=4, num_experts=4, topk=1, kind="one_rank"), "num_ranks"),
    (dict(num_tokens=4, num_experts=6, topk=1, kind="one_rank", num_ranks=4), "divisible"),
], ids=["topk>E", "topk0", "negT", "kind", "drop", "one_rank-no-ranks", "one_rank-indivisible"])
def test_make_routing_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_routing(generator=torch.Generator().manual_seed(0), **kwargs)


_IDX = torch.tensor([[0, 1], [2, -1], [3, 0]])
_W = torch.full((3, 2), 0.5)


@pytest.mark.parametrize("idx, w, match", [
    (_IDX.reshape(-1), _W, "must be 2-D"),
    (_IDX[:2], _W[:2], "3 tokens"),
    (_IDX, _W[:, :1].contiguous(), "same shape"),
    (_IDX.float(), _W, "integer dtype"),
    (_IDX, _W.long(), "floating dtype"),
    (torch.tensor([[0, 4], [1, 2], [3, 0]]), _W, r"\[-1, 4\)"),
    (torch.tensor([[0, -2], [1, 2], [3, 0]]), _W, r"\[-1, 4\)"),
    (_IDX.t().contiguous().t(), _W, "contiguous"),
    (_IDX.tolist(), _W, "torch.Tensor"),
], ids=["ndim", "tokens", "shape", "idx-dtype", "w-dtype", "id-high", "id-low", "strided",
        "list"])
def test_validate_routing_rejects(idx, w, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_routing(idx, w, num_experts=4, num_tokens=3)


def _corrupt(inputs: MoEInputs, field: str, rank: int, value: object) -> MoEInputs:
    seq = list(getattr(inputs, field))
    seq[rank] = value
    return replace(inputs, **{field: seq})


def test_oracle_rejects_bad_inputs() -> None:
    inputs = make_inputs([3, 2], 16, 8, 4, 2, "uniform", torch.float32)
    with pytest.raises(ValueError, match="w1s has 1 entries"):
        replace(inputs, w1s=inputs.w1s[:1]).oracle()
    with pytest.raises(ValueError, match="rank 1: .*w1 has dtype"):
        _corrupt(inputs, "w1s", 1, inputs.w1s[1].double()).oracle()
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        _corrupt(inputs, "xs", 0, inputs.xs[0].long()).oracle()
    with pytest.raises(ValueError, match="must be even"):
        _corrupt(inputs, "w1s", 0, inputs.w1s[0][:, :, :15]).oracle()
    with pytest.raises(ValueError, match="w2 must have shape"):
        _corrupt(inputs, "w2s", 1, inputs.w2s[1][:, :4]).oracle()


_BAD_REFERENCE_CASES = {
    # name -> (corruption of valid W=2 inputs, what the failing rank's error says; the other
    # rank says which rank failed)
    "experts-indivisible": (lambda i: replace(i, num_experts=5), "divisible by the world size"),
    "w1-dtype-rank1": (lambda i: _corrupt(i, "w1s", 1, i.w1s[1].half()), "w1 has dtype"),
    "w2-shape-both": (lambda i: replace(i, w2s=[w[:, :4] for w in i.w2s]), "w2 must have shape"),
    "expert-id-rank0": (lambda i: _corrupt(i, "topk_idxs", 0, i.topk_idxs[0] + 8),
                        "must lie in [-1, 4)"),
    "hidden-differs": (lambda i: replace(i, xs=[i.xs[0], i.xs[1][:, :8]],
                                         w1s=[i.w1s[0], i.w1s[1][:, :8]],
                                         w2s=[i.w2s[0], i.w2s[1][:, :, :8]]),
                       "disagree on hidden size"),
}


@pytest.mark.parametrize("case", list(_BAD_REFERENCE_CASES))
def test_reference_rejects_bad_inputs_on_every_rank(emulated_cluster, case: str) -> None:
    corrupt, match = _BAD_REFERENCE_CASES[case]
    inputs = corrupt(make_inputs([3, 2], 16, 8, 4, 2, "uniform", torch.float32))
    messages = emulated_cluster(2).run(_reference_error_on_rank, inputs)
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} raised no ValueError"
        assert match in message or "failed validation" in message, message
    assert any(match in m for m in messages), messages
