"""The fused EP MoE megakernel on emulated ranks: vs the float64 oracle, and bitwise invariance
under the schedule (overlap vs sequential) and every Device-level plan field."""
from __future__ import annotations

import pytest
import rank_fns_fused as fns

VARIANTS = (
    {},
    {"schedule": "sequential"},
    {"num_programs": 3, "chunk_rows": 4, "gemm_tile_order": "column_major", "source_order": "reverse_ring",
     "block_t": 4},
    {"comm_programs": 0, "recv_lag": 0, "gemm_tile_order": "row_major"},  # one queue; receives right after sends
    {"num_programs": 3, "comm_programs": 2, "source_order": "reverse_ring", "recv_lag": 3, "gemm_group_rows": 3},
    {"schedule": "sequential", "gemm_tile_order": "column_major", "num_programs": 3},  # barriers count live tasks
)
CASES = [  # (W, tokens per rank, H, I, E, K, routing)
    (2, [13, 7], 32, 24, 4, 2, "uniform"),
    (3, [9, 0, 17], 40, 16, 6, 3, "zipf"),          # empty rank, H/I not block multiples
    (3, [10, 10, 10], 32, 24, 9, 2, "one_expert"),  # every token to expert 0
    (4, [5, 12, 3, 8], 32, 16, 8, 4, "one_rank"),   # every token to rank 0's experts
    (3, [24, 30, 27], 64, 40, 3, 2, "uniform"),     # several row and column tiles per expert, mixed sources
]


def case_variants(i: int) -> tuple[dict, ...]:
    """Case i's plan variants: the default and the sequential schedule, and one of the others in
    turn (every variant runs on some case; all six on every case took ~2 minutes of CI)."""
    return VARIANTS[0], VARIANTS[1], VARIANTS[2 + i % (len(VARIANTS) - 2)]


@pytest.mark.parametrize("i,W,tokens,H,I,E,K,kind", [(i, *c) for i, c in enumerate(CASES)],
                         ids=[f"W{c[0]}-T{max(c[1])}-H{c[2]}-I{c[3]}-E{c[4]}-K{c[5]}-{c[6]}" for c in CASES])
def test_fused_moe(emulated_cluster, i, W, tokens, H, I, E, K, kind):
    variants = case_variants(i)
    for rank, rep in enumerate(emulated_cluster(W).run(fns.fused_case, tokens, H, I, E, K, kind, 3, variants)):
        assert rep["oracle_ok"], f"rank {rank}: off the float64 oracle by {rep['max_abs']}"
        assert all(rep["variants_bitwise"]), f"rank {rank}: plan variants differ {rep['variants_bitwise']}"
        for v, r in zip(variants, rep["reports"]):
            assert r["rerun_bitwise"] and r["nosync_bitwise"], f"rank {rank} {v}: runs differ"
            assert r["overlap"]["gate_up_tiles"] >= 0
            assert r["tile_order"] == "ok", f"rank {rank} {v}: {r['tile_order']}"
            assert r["ticketed"] == "ok", f"rank {rank} {v}: {r['ticketed']}"


def test_fused_refuses_unverified_plans_and_bad_input(emulated_cluster):
    for rank, res in enumerate(emulated_cluster(2).run(fns.fused_refusals)):
        assert "verif" in res["unverified"], res["unverified"]
        assert "another shape" in res["other_shape"], res["other_shape"]
        assert "power of two" in res["one_rank_bad"] and "on rank(s) 1" in res["one_rank_bad"], res["one_rank_bad"]
        assert "transport='put' (NVSHMEM put-with-signal) needs backend='nvshmem'" in res["put_on_emulated"], res
        assert "transport must be one of auto, pointer, put, got 'rdma'" in res["transport_name"], res
        for key in ("x_shape", "w1_shape", "dtype", "idx_dtype"):
            assert res[key].startswith("DitronConfigError"), f"rank {rank} {key}: {res[key]}"
        assert res["bad_expert"].startswith("RoutingError") and "ranks 0" in res["bad_expert"], res["bad_expert"]
        lone = res["one_rank_bad_w1"]
        if rank == 1:
            assert lone.startswith("DitronConfigError") and "w1" in lone, lone
        else:
            assert lone.startswith("DitronConfigError") and "rank(s) 1 rejected their own arguments" in lone, lone
        assert res["one_rank_bad_w1_s"] < 15.0, "the peer waited for the rank that rejected its call"
        grad = res["grad_on_one_rank"]
        if rank == 1:
            assert grad.startswith("NotImplementedError") and "trace=False" in grad, grad
        else:
            assert grad.startswith("DitronConfigError") and "rejected their own arguments" in grad, grad
        assert res["no_data_moved"] and res["recovers"], res


def test_fused_lone_rank_times_out_raises_and_recovers(emulated_cluster):
    res = emulated_cluster(2).run(fns.fused_lone_rank_times_out)
    assert res[0]["raised"] and "waited" in res[0]["raised"] and "for rank 1 to arrive" in res[0]["raised"], res[0]
    # rank 1 joins the exchange rank 0 gave up on: it stops and says so
    assert res[1]["raised"] and "rank 0 at call" in res[1]["raised"] and "given up" in res[1]["raised"], res[1]
    assert all(r["recovers"] for r in res), res


SMALL_CALL_VARIANTS = (
    {},                                      # block_h 64 >= H: one column block, no slices
    {"block_h": 16},                         # 3 column blocks: the spare combine tasks take slices
    {"block_h": 16, "block_t": 4, "num_programs": 3},
    {"block_h": 16, "schedule": "sequential"},
)


def test_fused_call_padded_to_a_capture_gives_its_own_bits(emulated_cluster):
    """On GPUs a call replays the CUDA graph captured for layout_rows(T) tokens, the rows past its
    own routed nowhere (FusedMoE._forward): that padded run gives the call's own bits, in both
    schedules, with the padded rows' x and weights never read (NaN there)."""
    for rank, rep in enumerate(emulated_cluster(2).run(fns.padded_call_case, [11, 5], 16, 24, 16, 8, 4, 3)):
        assert rep == {"overlap": True, "sequential": True}, f"rank {rank}: {rep}"


def test_fused_prefill_sized_layer_on_a_smaller_call(emulated_cluster):
    """A layer sized for 64 tokens called with 13 / 7 / 0: the combine spreads the few token blocks
    over its tasks as column slices; same bits as without slices, on the oracle, on a second and a
    graph-mode call (the landing counters were reset by the last slice of each block)."""
    for rank, rep in enumerate(emulated_cluster(3).run(fns.fused_case, [13, 7, 0], 40, 24, 6, 2, "uniform", 5,
                                                      SMALL_CALL_VARIANTS, 0.1, 64)):
        assert rep["oracle_ok"], f"rank {rank}: off the float64 oracle by {rep['max_abs']}"
        assert all(rep["variants_bitwise"]), f"rank {rank}: variants differ {rep['variants_bitwise']}"
        for v, r in zip(SMALL_CALL_VARIANTS, rep["reports"]):
            assert r["rerun_bitwise"] and r["nosync_bitwise"], f"rank {rank} {v}: runs differ"
            assert r["ticketed"] == "ok", f"rank {rank} {v}: {r['ticketed']}"


@pytest.mark.parametrize("W,tokens,E,K,kind", [(2, [13, 7], 4, 2, "uniform"), (3, [9, 0, 17], 6, 3, "zipf")],
                         ids=["W2-uniform", "W3-zipf-empty-rank"])
def test_moe_layer_matches_oracle(emulated_cluster, W, tokens, E, K, kind):
    for rank, rep in enumerate(emulated_cluster(W).run(fns.moe_layer_case, tokens, 32, 24, E, K, kind, 4)):
        assert rep["ok"], f"rank {rank}: moe off the float64 oracle by {rep['max_abs']}"
        assert rep["bitwise"], f"rank {rank}: two runs differ"
        assert rep["grad_mode_bitwise"], f"rank {rank}: the fused forward under grad mode differs"


@pytest.mark.parametrize("W,tokens,E,K,kind,activation,bias", [
    (2, [13, 7], 4, 2, "uniform", "swiglu", False),
    (3, [9, 0, 11], 6, 3, "zipf", "swiglu", False),
    (2, [17, 5], 4, 2, "one_expert", "gelu", True),       # DeepSpeed's Linear -> GELU -> Linear experts
    (2, [6, 11], 4, 2, "uniform", "geglu", True),
    (3, [0, 9, 13], 6, 2, "zipf", "relu", False),
    (2, [11, 7], 4, 3, "uniform", "gelu_tanh", True),
    (2, [9, 0], 2, 1, "zipf", "silu", True),
    (8, [3, 0, 5, 2, 4, 1, 2, 3], 16, 2, "zipf", "swiglu", False),  # W = 8 (issue 30), an empty rank
], ids=["W2-uniform", "W3-zipf-empty-rank", "W2-gelu-bias-one-expert", "W2-geglu-bias", "W3-relu-empty-rank0",
        "W2-gelu_tanh-bias-K3", "W2-silu-bias-E2", "W8-zipf-empty-rank"])
def test_moe_trains_under_every_schedule(emulated_cluster, W, tokens, E, K, kind, activation, bias):
    """Gradients of every input of moe (x, topk_weights, w1, w2, b1, b2) match the float64
    oracle's (fp32), for every expert type, dropped slots get none, and staged (twice), overlap,
    sequential and FusedMoE called directly give the same bits (at W = 8, on 2 CPU cores: staged and
    the fused forward recomputed in the backward; the schedules' bits are compared at W = 2 and 3)."""
    only = ("overlap recompute",) if W == 8 else None
    for rank, rep in enumerate(emulated_cluster(W).run(fns.moe_training_case, tokens, 24, 16, E, K, kind, 5,
                                                       activation, bias, only)):
        for name, (err, ref) in rep["errors"].items():
            assert err <= 1e-5 * max(ref, 1.0), f"rank {rank} grad {name}: off the float64 oracle by {err} (max {ref})"
        assert all(rep["bitwise"].values()), f"rank {rank}: backward passes differ {rep['bitwise']}"
        assert rep["forward_bitwise"], f"rank {rank}: overlap, sequential and FusedMoE forwards differ"
        assert rep["dropped_weight_grads_zero"], f"rank {rank}: a dropped slot got a weight gradient"


@pytest.mark.parametrize("recompute", [False, True], ids=["keep-activations", "recompute"])
def test_two_layers_sharing_the_buffer_train(emulated_cluster, recompute):
    """Two moe calls in a row on the same cached buffer and one backward through both: every
    gradient within fp32 tolerance of float64 autograd of the composition."""
    for rank, rep in enumerate(emulated_cluster(2).run(fns.two_layer_training_case, [11, 8], 24, 16, 4, 2, 3,
                                                       recompute)):
        assert max(rep["errors"]) <= 1e-5, (rank, rep)


def test_graph_mode_training_equals_default_mode(emulated_cluster):
    """Gradients with sync=False (graph mode: no host read forward or backward) equal sync=True's
    bit for bit, with drops, GELU experts and biases, twice."""
    for rank, rep in enumerate(emulated_cluster(2).run(fns.graph_mode_training_case, [10, 7], 24, 16, 4, 2, 6)):
        assert all(rep["bitwise"]), (rank, rep)


def test_float32_main_grad_for_fp16_experts(emulated_cluster):
    """grad_dtype=float32 with fp16 experts: gradients land in main_grad (not .grad), the same bits
    whether the activations are kept or recomputed, within fp16 tolerance of float64."""
    for rank, rep in enumerate(emulated_cluster(2).run(fns.main_grad_case, [9, 6], 32, 16, 4, 2, 4)):
        assert rep["grads_none"] and rep["same_bits"] and rep["err"] <= 3e-3, (rank, rep)
