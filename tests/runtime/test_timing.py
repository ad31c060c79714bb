"""The benchmarks' timing rule (ditron_ep.bench.timing.time_fn) on emulated ranks: the host skew
of leaving the barrier counts by default and drops out with align=True; a failing rank never
leaves the others waiting."""
from __future__ import annotations

import pytest
import rank_fns_runtime as fns

SKEW_S = 0.2
TIMEOUT_S = 60  # a mismatched collective hangs: fail in a minute, not the pool's 300 s


def test_barrier_skew_counts_unless_aligned(emulated_cluster):
    cluster = emulated_cluster(2)
    plain = cluster.run(fns.timing_with_skew, False, SKEW_S, timeout_s=TIMEOUT_S)
    aligned = cluster.run(fns.timing_with_skew, True, SKEW_S, timeout_s=TIMEOUT_S)
    assert plain[0] == plain[1] and aligned[0] == aligned[1], "every rank gets the slowest rank's figures"
    # rank 0 starts its clock on leaving the barrier and waits SKEW_S in the all_reduce for rank 1
    assert min(plain[0]) >= 0.8 * SKEW_S * 1e6, plain
    # aligned: both clocks start after the ranks met, so rank 1's late barrier exit is not counted
    assert max(aligned[0]) < 0.5 * SKEW_S * 1e6, aligned


@pytest.mark.parametrize("align", [False, True], ids=["plain", "aligned"])
def test_an_error_on_one_rank_keeps_the_collectives_matched(emulated_cluster, align):
    out = emulated_cluster(2).run(fns.timing_error_on_one_rank, align, timeout_s=TIMEOUT_S)
    assert out[1] == "raised: boom on rank 1", out
    assert out[0] == "returned 4 times", out
