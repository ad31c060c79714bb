"""The dispatch/combine floors' byte counts (bench/ep_floors.py) on a hand-counted two-rank
routing, which row each floor belongs to, and a speedup column against a derived reference row."""
from __future__ import annotations

import pytest

from ditron_ep.bench.ep_floors import (COMBINE_FLOOR, DISPATCH_FLOOR, FP8_FLOOR, RANK_REDUCED_FP32_FLOOR,
                                       TOKEN_MAJOR_FLOOR, floor_of, rank_bytes)
from ditron_ep.bench.runner import build_rows
from ditron_ep.bench.spec import Benchmark, BenchRequest, Impl, Measurement, Shape

TOKENS = [4, 4]
TOK = [[3, 2], [1, 4]]     # [src][dst] (token, rank) copies
PAIRS = [[5, 3], [1, 6]]   # [src][dst] (token, k) pairs
H, ELT = 128, 2
ROW = H * ELT


@pytest.mark.parametrize("mode, rank, want", [
    # dispatch: own tokens read + rows landing (pairs or tokens); NVLink max(out, in) of tokens crossing
    (DISPATCH_FLOOR, 0, (4 * ROW + (5 + 1) * ROW, 2 * ROW)),
    (DISPATCH_FLOOR, 1, (4 * ROW + (3 + 6) * ROW, 2 * ROW)),
    (TOKEN_MAJOR_FLOOR, 0, (4 * ROW + (3 + 1) * ROW, 2 * ROW)),
    (FP8_FLOOR, 0, (4 * 132 + 6 * 132, 2 * 132)),                # e4m3 row + 128-channel fp32 scales
    # combine: the expert rows held read + output written; NVLink the pairs (or token rows) crossing
    (COMBINE_FLOOR, 0, ((5 + 1) * ROW + 4 * ROW, 3 * ROW)),      # out: pairs[1][0] = 1, in: pairs[0][1] = 3
    (RANK_REDUCED_FP32_FLOOR, 0, ((5 + 1) * ROW + 4 * ROW, 2 * 4 * H)),  # in: tok[0][1] = 2 fp32 rows
])
def test_rank_bytes_count_the_bytes_each_mode_must_move(mode, rank, want):
    assert rank_bytes(mode, TOKENS, TOK, PAIRS, rank, H, ELT) == want


def test_each_timed_row_has_its_modes_floor():
    assert floor_of("EPBuffer.dispatch") == "floor: dispatch"
    assert floor_of("graph: dispatch token_major") == "floor: dispatch token_major"
    assert floor_of("graph: combine expert_rank") == "floor: combine expert_rank"
    assert floor_of("graph: combine expert_rank fp32") == "floor: combine expert_rank fp32"
    assert floor_of("graph: dispatch fp8") == "floor: dispatch fp8"
    assert floor_of("EPBuffer.dispatch fp8", fp8=False) is None
    assert floor_of("layout") is None


def test_speedup_against_a_derived_reference_row():
    bench = Benchmark(name="floors", description="", metric="GB/s", work_rule="", check_rule="",
                      shapes={"emulated": Shape(16, 4, 2)}, tokens={"emulated": (1,)}, plan=None, run=None)
    req = BenchRequest("floors", Shape(16, 4, 2), (1,), "fp32", iters=2, warmup=0)
    impls = (Impl("ours", against=("floor",)), Impl("floor", "reference", timed=False))
    rows = build_rows(bench, req, 1, 2, [Measurement("ours", times_us=[200.0, 200.0], work=1e6),
                                         Measurement("floor", value_us=50.0, work=1e6)], impls)
    assert rows[0].speedups == {"floor": 0.25}
