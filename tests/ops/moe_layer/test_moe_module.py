"""`EPMoE` on emulated ranks: output vs a float64 per-token reference, aux loss vs the Switch
formula, tie-breaking, run-to-run bits, the grad-mode refusal and argument checks."""
from __future__ import annotations

import pytest
import rank_fns_moe_module as fns

from ditron_ep.ops.moe_layer.module import EPMoE
from ditron_ep.runtime import DitronConfigError

CASES = [  # (W, tokens per rank, E, score_func, renormalize, zero_router)
    (2, [12, 9], 4, "softmax", True, False),
    (2, [12, 5], 4, "sigmoid", False, False),
    (3, [12, 0, 7], 6, "softmax", False, False),   # empty rank
    (3, [11, 12, 0], 6, "sigmoid", True, False),   # empty last rank
    (2, [12, 6], 4, "softmax", True, True),        # all scores tie
]


@pytest.mark.parametrize("W,tokens,E,score_func,renorm,zero", CASES,
                         ids=[f"W{c[0]}-T{max(c[1])}-E{c[2]}-{c[3]}-{'renorm' if c[4] else 'raw'}"
                              f"{'-ties' if c[5] else ''}" for c in CASES])
def test_forward_matches_float64(emulated_cluster, W, tokens, E, score_func, renorm, zero):
    reports = emulated_cluster(W).run(fns.forward_case, tokens, E, score_func, renorm, 3, zero)
    for rank, rep in enumerate(reports):
        assert rep["router_synced"], f"rank {rank}: sync_router_ left the routers different"
        assert rep["shapes"][:2] == ((1, tokens[rank], fns.H), ())
        assert rep["out_error"] is None, rep["out_error"]
        assert rep["aux"] == pytest.approx(rep["ref_aux"], rel=1e-5, abs=1e-7), f"rank {rank}: aux loss"
        assert rep["bitwise"], f"rank {rank}: two forwards differ"
        assert rep["inference_mode_bitwise"], f"rank {rank}: inference_mode differs from no_grad"
        assert rep["grad_mode_bitwise"], f"rank {rank}: grad mode's forward differs or carries no graph"
        assert rep["frozen_bitwise"], f"rank {rank}: frozen layer under grad mode differs"
        first = rank * (E // W)
        assert f"experts {first}..{first + E // W - 1}" in rep["repr"] and f"score_func='{score_func}'" in rep["repr"]
        if zero:  # ties go to the lowest ids; uniform probabilities give aux = coef * 1 exactly
            assert all(c == [0, 1] for c in rep["chosen"])
            assert rep["aux"] == pytest.approx(0.01 if tokens[rank] else 0.0, rel=1e-6)


def test_bad_arguments(emulated_cluster):
    results = emulated_cluster(3).run(fns.error_cases)
    for res in results:
        for key, value in res.items():
            assert value.startswith("DitronConfigError"), f"{key}: {value}"  # a ValueError too
        assert "multiple of the expert-parallel group size 3" in res["not_divisible"]
        assert "exceeds num_experts" in res["topk_gt_experts"]
        assert "torch.no_grad" not in res["x_dtype"] and "cast x" in res["x_dtype"]
        assert "cast x to torch.float32" in res["x_float64"] and "dtype=torch.float64" not in res["x_float64"]
        assert "router_dtype must be one of" in res["router_fp8"]
        assert "group must be a torch.distributed.ProcessGroup" in res["group_list"]
    for res in results[1:]:
        assert "is not a member of `group`" in res["not_member"], res["not_member"]


def test_experts_distinct_and_independent_of_group_size(emulated_cluster):
    for res in emulated_cluster(2).run(fns.init_case, 4):
        assert res["distinct_across_ranks"] and res["distinct_within_rank"], res
        assert res["same_as_solo"] and res["router_same"], res
        assert abs(res["w1_std"] - fns.H ** -0.5) < 0.1 * fns.H ** -0.5
        assert abs(res["w2_std"] - fns.I ** -0.5) < 0.1 * fns.I ** -0.5
        # routing stays in the configured dtype; the repr shows the weight's
        assert res["router_dtype_after_half"] == "torch.float32"
        assert "router_dtype=torch.float32 (weight torch.float16)" in res["repr_after_half"]
        assert res["deferred_same"], "built on meta, to_empty, reset_parameters: not the eager layer's weights"


def test_needs_torch_distributed():
    with pytest.raises(DitronConfigError, match="init_process_group"):
        EPMoE(32, 16, 4, 2)


def test_lone_bad_x_reaches_the_peers(emulated_cluster):
    r0, r1 = emulated_cluster(2).run(fns.lone_bad_x_case)
    assert r1["bad"].startswith("DitronConfigError") and "x must be [..., hidden=" in r1["bad"], r1
    assert r0["bad"].startswith("DitronConfigError") and "rank(s) 1 rejected" in r0["bad"], r0
    assert r0["bad_s"] < 10, f"rank 0 waited {r0['bad_s']:.1f} s: a timeout, not a refusal"
    assert r0["after"] and r1["after"]


@pytest.mark.parametrize("W,tokens,E,score_func,renorm,activation,bias,schedule", [
    (2, [9, 6], 4, "softmax", False, "swiglu", False, "staged"),
    (3, [7, 0, 5], 6, "sigmoid", True, "swiglu", False, "staged"),
    (2, [8, 5], 4, "softmax", False, "gelu", True, "overlap"),   # DeepSpeed-style experts, default schedule
], ids=["W2-softmax", "W3-empty-rank-sigmoid-renorm", "W2-gelu-bias-overlap"])
def test_layer_trains(emulated_cluster, W, tokens, E, score_func, renorm, activation, bias, schedule):
    """Gradients of x, the router and the experts (and biases) of EPMoE against float64; the
    state_dict keys are the parameters' names (stable across versions: checkpoints depend on them)."""
    for rank, rep in enumerate(emulated_cluster(W).run(fns.training_case, tokens, E, score_func, renorm, 2,
                                                       activation, bias, schedule)):
        assert rep["state_dict_keys"] == (["b1", "b2"] if bias else []) + ["router_weight", "w1", "w2"], rep
        for name, (err, ref) in rep["errors"].items():
            assert err <= 1e-5 * max(ref, 1.0), f"rank {rank} grad {name}: off float64 by {err} (max {ref})"


def test_training_loop_matches_float64_and_repeats_bitwise(emulated_cluster):
    """20 SGD steps of a tiny EPMoE model (staged schedule) on 2 ranks: every step's loss within
    fp32 tolerance of the float64 model's, and a second run from the same start bit for bit the
    same (its first 5 steps: the CPU suite's time)."""
    for rank, rep in enumerate(emulated_cluster(2).run(fns.training_loop_case, [12, 9], 4, 20, 5, 7)):
        assert rep["again"] == rep["losses"][:5], f"rank {rank}: two training runs differ"
        for step, (got, want) in enumerate(zip(rep["losses"], rep["reference"])):
            assert abs(got - want) <= 1e-4 * abs(want), f"rank {rank} step {step}: loss {got} vs float64 {want}"
        assert rep["losses"][-1] < 0.9 * rep["losses"][0], f"rank {rank}: the loss did not fall {rep['losses']}"
