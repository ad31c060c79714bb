"""Cross-rank agreement on emulated ranks: every scenario raises on every rank, at once (no
rank waits out a timeout except for a rank that never comes), names the rank and what differs,
and the next valid call on every rank is right without a reset."""
from __future__ import annotations

import rank_fns_agreement as fns

AT_ONCE_S = 10.0  # far below the bounded wait (60,000 polls: 15-60 s under the interpreter)


def _every_rank(results, key, *wants):
    for rank, res in enumerate(results):
        assert any(w in res[key] for w in wants), f"rank {rank} {key}: {res[key]}"


def test_buffer_scenarios(emulated_cluster):
    r0, r1 = res = emulated_cluster(2).run(fns.buffer_scenarios)
    for key, own in (("dtype", "x must be float32"), ("shape", "x must have shape")):
        assert own in r1[key], r1[key]
        assert "rank(s) 1 rejected their own arguments" in r0[key] and f"{key if key == 'dtype' else 'hidden'}:" in \
            r0[key], r0[key]
    _every_rank(res, "expert_id", "RoutingError")
    _every_rank(res, "capacity", "CapacityError")
    assert r1["graph_dtype"].startswith("DitronConfigError") and r0["graph_dtype"] == "no error", res
    assert "earlier graph-mode call" in r0["graph_dtype_check"] and r1["graph_dtype_check"] == "no error", res
    assert r0["skipped"].startswith("DitronTimeoutError") and "for rank 1 to arrive at call" in r0["skipped"], r0
    assert r1["skipped"].startswith("DitronOutOfStepError") and "given up" in r1["skipped"], r1
    for r in res:
        for key in ("dtype", "shape", "expert_id", "capacity", "graph_dtype", "graph_dtype_check"):
            assert r[key + "_s"] < AT_ONCE_S, (key, r[key + "_s"])
        assert all(r[k] for k in r if k == "first" or k.endswith("_after")), r
    assert r1["skipped_s"] < AT_ONCE_S
    for r in res:  # training: one error read per backward pass, at its end
        assert r["reads_per_training_step"] == 1 and r["training_grad_ok"], r
    assert r0["backward_skipped"].startswith("DitronTimeoutError") and "for rank 1 to arrive" in r0["backward_skipped"], r0
    assert r1["backward_skipped"].startswith("DitronOutOfStepError") and r1["backward_skipped_s"] < AT_ONCE_S, r1
    assert r0["calls"] == r1["calls"]


def test_functional_scenarios(emulated_cluster):
    r0, r1 = res = emulated_cluster(2).run(fns.functional_scenarios)
    assert r1["dispatch_first_bad"].startswith("DitronConfigError: x must be a 2-D tensor"), res
    assert "on rank(s) 1" in r0["dispatch_first_bad"] and "x must be a 2-D tensor" in r0["dispatch_first_bad"], res
    assert "topk_weights must be a 2-D" in r1["moe_first_bad"] and "on rank(s) 1" in r0["moe_first_bad"], res
    for key in ("dispatch_hidden", "moe_hidden"):  # every rank names both hidden sizes
        _every_rank(res, key, "hidden: rank 0 32, rank 1 48")
    for r in res:
        for key in ("dispatch_first_bad", "dispatch_hidden", "moe_first_bad", "moe_hidden"):
            assert r[key].startswith("DitronConfigError") and r[key + "_s"] < AT_ONCE_S, (key, r[key], r[key + "_s"])
        assert r["dispatch_first_after"] and r["dispatch_hidden_after"] and r["moe_hidden_after"], r
        assert r["dispatch_all_new_hidden"], "a hidden size every rank passes rebuilds the buffer"


def test_module_scenarios(emulated_cluster):
    r0, r1 = res = emulated_cluster(2).run(fns.module_scenarios)
    assert "x must be [..., hidden=32]" in r1["epmoe_hidden"], r1
    assert "rank(s) 1 rejected their own arguments" in r0["epmoe_hidden"] and r0["epmoe_hidden_s"] < AT_ONCE_S, r0
    assert r0["fused_skipped"].startswith("DitronTimeoutError"), r0
    assert r1["fused_skipped"].startswith("DitronOutOfStepError") and r1["fused_skipped_s"] < AT_ONCE_S, r1
    for r in res:
        assert r["epmoe_after"] and r["two_layers_train"] and r["fused_after"], r


def test_a_rank_outside_the_group_gets_a_clear_error(emulated_cluster):
    r0, r1 = emulated_cluster(2).run(fns.non_member_scenarios)
    assert all(v == "no error" for v in r0.values()), r0
    for key, err in r1.items():
        assert err.startswith("DitronConfigError") and "global rank 1) is not a member" in err and "[0]" in err, (key, err)
