"""Tile primitives through the exchange kernel: puts to every peer, epoch signals, bounded waits."""
from __future__ import annotations

import pytest
import rank_fns_runtime as fns
import torch

CASES = [  # (world, R, C, dtype, programs)
    (2, 5, 40, torch.float32, None),
    (3, 37, 130, torch.bfloat16, 3),   # R, C not multiples of the block
    (4, 16, 64, torch.float16, 1),     # one program runs the whole queue
    (4, 1, 3, torch.int32, 7),         # more programs than tasks
    (3, 0, 8, torch.float32, None),    # empty tile
]


@pytest.mark.parametrize("world,R,C,dtype,programs", CASES,
                         ids=[f"W{w}-R{r}-C{c}-{str(d)[6:]}-P{p}" for w, r, c, d, p in CASES])
def test_exchange_element_exact(emulated_cluster, world, R, C, dtype, programs):
    results = emulated_cluster(world).run(fns.exchange, R, C, dtype, 2, programs)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: wrong tiles {res['mismatches']}"
        assert res["calls"] == 2


def test_many_calls_without_reset(emulated_cluster):
    # Signals and the call barrier are reused 300 times with no reset pass in between (records
    # alternate by call parity: 300 calls reuse each slot 150 times; 1000 took 48 s of the CPU suite).
    results = emulated_cluster(2).run(fns.exchange, 1, 4, torch.float32, 300, 1, None, 100)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches'][:5]}"
        assert res["calls"] == 300


def test_call_number_wraps_around(emulated_cluster):
    start = 2**31 - 1 - 3  # 3 below the int32 wrap point: calls cross it
    results = emulated_cluster(3).run(fns.exchange, 6, 20, torch.float32, 10, 2, start)
    for rank, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {rank}: {res['mismatches']}"
        assert res["calls"] == start + 10 - 2**32  # wrapped to the negative side


def test_unnotified_wait_times_out_with_device_record_then_recovers(emulated_cluster):
    budget = 2000  # ~0.5 s of polls under the interpreter
    results = emulated_cluster(2).run(fns.timeout_then_recover, budget)
    r0 = results[0]
    assert r0["raised"] is not None, "the wait must time out"
    assert r0["rank"] == 0 and r0["stage"] == "call barrier" and r0["signal"] == 1 and r0["expected"] == 2
    assert "rank 0 waited" in r0["raised"] and "for rank 1 to arrive at call 2" in r0["raised"], r0["raised"]
    assert r0["seconds"] < 60
    late = results[1]["late"]
    assert late is not None and "rank 0 at call 2" in late and "given up" in late, late
    assert all(res["recovers"] for res in results), "the next exchange must be exact with no reset()"
