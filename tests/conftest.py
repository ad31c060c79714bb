"""Shared fixtures: a pool of emulated rank processes reused across the whole CPU suite."""
from __future__ import annotations

import pytest
import torch

from ditron_ep.runtime import EmulatedCluster, kernels_interpreted

kernels_interpreted()  # fixes the kernel mode before any test module imports triton

_POOLS: dict[int, EmulatedCluster] = {}


@pytest.fixture(scope="session")
def emulated_cluster():
    """`emulated_cluster(world_size)` -> a started EmulatedCluster, shared by every test."""

    def get(world_size: int) -> EmulatedCluster:
        cluster = _POOLS.get(world_size)
        if cluster is None:
            cluster = _POOLS[world_size] = EmulatedCluster(world_size, timeout_s=300)
        cluster.start()  # no-op when running; restarts a pool torn down by a crash test
        return cluster

    yield get
    for cluster in _POOLS.values():
        cluster.shutdown()
    _POOLS.clear()


# tests/gpu runs under torchrun on GPU machines (tests/gpu/run_gpu_suite.sh), not in the CPU suite.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]
