"""Tensor-parallel GEMM + collective ops and linear layers on emulated ranks (fp32, shapes off the
tile grid): each op and its gradients against float64 torch, bitwise run to run, GEMM+AR identical
on every rank; bad input raises on every rank with the ranks still in step; the TP MLP block
(with and without sequence parallelism) against the unsharded block."""
from __future__ import annotations

import pytest
import rank_fns_tp as fns

TOL = 2e-5


@pytest.mark.parametrize("world, m, k, n", [(2, 5, 19, 13), (3, 7, 33, 21), (8, 3, 17, 11)])
def test_ops_match_float64_and_repeat_bitwise(emulated_cluster, world, m, k, n):
    for rank, rep in enumerate(emulated_cluster(world).run(fns.ops_case, m, k, n, world)):
        bad = {name: e for name, e in rep["errs"].items() if not e <= TOL}
        assert not bad, (rank, bad)
        assert all(rep["bitwise"].values()), (rank, rep["bitwise"])
        assert rep["ar_same_on_every_rank"], rank


@pytest.mark.parametrize("kind, match", [
    ("rows differ", "every rank must pass the same"),
    ("not divisible", "must be a multiple of the group's 2 ranks"),
    ("inner mismatch on one rank", "a's columns \\(8\\) must equal b's rows \\(9\\).*rank\\(s\\) 1"),
    ("dtype", "one dtype"),
    ("1-D", "must be 2-D"),
])
def test_bad_input_raises_on_every_rank(emulated_cluster, kind, match):
    import re
    for rank, err in enumerate(emulated_cluster(2).run(fns.bad_input_case, kind)):
        assert err.startswith("DitronConfigError") and re.search(match, err), (rank, err)


def test_store_agreement_raises_alike_and_deletes_old_keys(emulated_cluster):
    """NCCL groups agree through the c10d store (no GPU collective, no stream sync); forced here
    on gloo ranks: the same errors on every rank, the same results, old calls' keys deleted."""
    kinds = ["rows differ", "inner mismatch on one rank", "dtype"]
    for rank, rep in enumerate(emulated_cluster(2).run(fns.store_agreement_case, kinds)):
        for kind, err in rep["errors"].items():
            assert err.startswith("DitronConfigError"), (rank, kind, err)
        assert all(rep["same"]), (rank, rep["same"])
        assert rep["kept"] == [rep["calls"] - 1, rep["calls"]], (rank, rep["kept"], rep["calls"])
        assert rep["fresh_rows"], "a group made again read the old group's keys"
        if rank == 0:
            first, second = rep["timeout"]
            assert "failed: a peer did not arrive" in first and "out of step" in second, rep["timeout"]
            assert rep["timeout_restored"]


@pytest.mark.parametrize("schedule", ["sequential", "overlap"])
@pytest.mark.parametrize("seq_parallel", [False, True], ids=["replicated", "sequence-parallel"])
def test_tp_mlp_block_matches_the_unsharded_block(emulated_cluster, seq_parallel, schedule):
    for rank, errs in enumerate(emulated_cluster(2).run(fns.modules_case, seq_parallel, 10, 24, 40, 3, schedule)):
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, (rank, errs)


@pytest.mark.parametrize("world, m, k, n", [(2, 21, 40, 24), (3, 5, 19, 13)])
def test_overlapped_all_gather_matmul_equals_sequential_bitwise(emulated_cluster, world, m, k, n):
    for rank, rep in enumerate(emulated_cluster(world).run(fns.overlap_case, m, k, n, 4)):
        assert all(all(call) for call in rep["same"]), (rank, rep)


@pytest.mark.parametrize("world, m, k, n", [(2, 21, 40, 24), (3, 5, 19, 13)])
def test_overlapped_matmul_reduce_scatter_equals_sequential_bitwise(emulated_cluster, world, m, k, n):
    for rank, rep in enumerate(emulated_cluster(world).run(fns.overlap_rs_case, m, k, n, 5)):
        assert all(all(call) for call in rep["same"]), (rank, rep)
        assert all(e <= TOL for e in rep["errs"]), (rank, rep["errs"])


@pytest.mark.parametrize("world, m, k, n", [(2, 21, 40, 24), (3, 5, 19, 13), (3, 40, 16, 40)])
def test_overlapped_matmul_all_reduce_equals_sequential_bitwise(emulated_cluster, world, m, k, n):
    for rank, rep in enumerate(emulated_cluster(world).run(fns.overlap_ar_case, m, k, n, 6)):
        assert all(all(call) for call in rep["same"]), (rank, rep)
        assert all(rep["same_on_every_rank"]), (rank, rep)
        assert all(e <= TOL for e in rep["errs"]), (rank, rep["errs"])


def test_overlapped_ops_with_empty_operands_match_sequential(emulated_cluster):
    for rank, rep in enumerate(emulated_cluster(2).run(fns.overlap_empty_case)):
        assert all(rep.values()), (rank, rep)


def test_ops_on_subgroups_match_float64_and_overlap_equals_sequential(emulated_cluster):
    """World 4 split into two halves, each running the ops on its own group at once: group ranks,
    rows and heaps are the group's, not the world's."""
    for rank, rep in enumerate(emulated_cluster(4).run(fns.subgroup_case, 5, 19, 13, 4)):
        bad = {name: e for name, e in rep["errs"].items() if not e <= TOL}
        assert not bad, (rank, bad)
        assert all(rep["bitwise"].values()), (rank, rep["bitwise"])


def test_overlapped_reductions_take_one_tile_on_every_rank(emulated_cluster):
    """A tuned tile (here a stand-in for each rank's tuner cache) drives the overlapped GEMM+RS and
    GEMM+AR when every rank planned it; when the ranks' tiles differ, every rank takes the shape
    rule's (the tiles are the signals' grid: different ones would never meet). Results stay
    within float64 tolerance either way."""
    for rank, rep in enumerate(emulated_cluster(2).run(fns.tuned_tile_agreement_case, 5, 19, 40)):
        assert rep["all tuned"]["tiles"] == [(rep["narrow"], "tuned", True)] * 2, (rank, rep)
        assert rep["rank 0 tuned"]["tiles"] == [(rep["rule"], "rule", True)] * 2, (rank, rep)
        assert rep["all tuned"]["err"] <= TOL and rep["rank 0 tuned"]["err"] <= TOL, (rank, rep)
