"""Symmetric heap and emulated launcher: allocation, peer visibility, failures, clean-up."""
from __future__ import annotations

import os

import pytest
import rank_fns_runtime as fns
import torch

from ditron_ep.runtime import EmulatedCluster, RankError


@pytest.mark.parametrize("world_size", [2, 3, 4], ids=lambda w: f"W{w}")
def test_alloc_and_peer_visibility(emulated_cluster, world_size):
    specs = [((5,), torch.float32), ((3, 7), torch.bfloat16), ((2, 2, 3), torch.int32), ((1,), torch.uint8)]
    results = emulated_cluster(world_size).run(fns.heap_visibility, specs)
    offsets0 = results[0][0]
    for rank, (offsets, seen, table) in enumerate(results):
        assert offsets == offsets0, "allocations must land at the same offset on every rank"
        assert all(o % 256 == 0 for o in offsets)
        assert len(table) == world_size and len(set(table)) == world_size
        bad = [k for k, ok in seen.items() if not ok]
        assert not bad, f"rank {rank} saw wrong values in (peer, buffer) {bad}"


def test_asymmetric_allocation_is_refused(emulated_cluster):
    for msg in emulated_cluster(2).run(fns.asymmetric_alloc):
        assert "differs across ranks" in msg and "same order" in msg


def test_bad_inputs_raise_clear_errors(emulated_cluster):
    every_rank = emulated_cluster(2).run(fns.bad_inputs)
    assert all("wait_budget" in m["one_rank_bad"] and "on rank(s) 1" in m["one_rank_bad"] for m in every_rank), \
        [m["one_rank_bad"] for m in every_rank]
    msgs = every_rank[0]
    assert "world-size mismatch" in msgs["world_size"] and "3" in msgs["world_size"]
    assert "unknown backend" in msgs["backend"]
    assert "TRITON_INTERPRET" in msgs["torch_on_cpu"]
    assert "contiguous" in msgs["non_contiguous"]
    assert "float64" in msgs["dtype"]
    assert "meta" in msgs["device"]
    assert "2-D" in msgs["ndim"]
    assert "larger size_bytes" in msgs["heap_full"]
    assert "freed" in msgs["after_free"]


def test_rank_exception_becomes_one_error_and_pool_survives(emulated_cluster):
    cluster = emulated_cluster(2)
    with pytest.raises(RankError, match="rank 0 raised DitronConfigError"):
        cluster.run(fns.SymmetricHeap, expected_world_size=5)
    assert cluster.run(os.getpid) == cluster.pids()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_killed_rank_leaves_no_process_or_segment():
    cluster = EmulatedCluster(3, timeout_s=120)
    cluster.start()
    pids = cluster.pids()
    with pytest.raises(RankError, match=r"rank 1 exit code -9"):
        cluster.run(fns.kill_during_collective)
    assert not any(_alive(p) for p in pids), "every rank process must be gone"
    assert cluster.leftover_segments() == []
    # the pool restarts on demand
    assert len(cluster.run(os.getpid)) == 3
    cluster.shutdown()
    assert cluster.leftover_segments() == []


def test_host_timeout_kills_the_pool():
    cluster = EmulatedCluster(2, timeout_s=120)
    pids = cluster.pids() if cluster.started else []
    with pytest.raises(RankError, match="did not finish within 2 s"):
        cluster.run(__import__("time").sleep, 30, timeout_s=2)
    pids = pids or []
    assert cluster.leftover_segments() == []
    assert not cluster.started


class _SlotStub:
    """Stands in for a SymmetricHeap in check_error_later: counts its error-slot reads."""

    def __init__(self, error: Exception | None = None):
        self._freed, self.error, self.reads = False, error, 0

    def check_error(self) -> None:
        self.reads += 1
        if self.error is not None:
            raise self.error


def test_deferred_error_reads_happen_once_per_backward_pass_and_raise_from_it():
    """Calls under autograd defer their error-slot read to the end of the backward pass: one read
    per heap however many calls used it, in the order first used; the first error raises from
    backward() and a later heap's error stays unread (held for its next read). Outside a
    backward pass nothing is queued."""
    from ditron_ep.runtime.heap import SymmetricHeap

    def run(stubs):
        class F(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                for s in stubs:
                    SymmetricHeap.check_error_later(s)
                return g * 2

        x = torch.ones(3, requires_grad=True)
        F.apply(x).sum().backward()

    a, b = _SlotStub(), _SlotStub()
    run([a, b, a, b])
    assert (a.reads, b.reads) == (1, 1)
    bad, later = _SlotStub(RuntimeError("held")), _SlotStub(RuntimeError("later"))
    with pytest.raises(RuntimeError, match="held"):
        run([bad, later, bad])
    assert (bad.reads, later.reads) == (1, 0)
    SymmetricHeap.check_error_later(a)  # no backward pass running: nothing queued, nothing read
    assert a.reads == 1


def test_error_words_read_ahead_skip_the_second_read_only_when_clean():
    """check_error(words): the host words an eager dispatch copied with its other status words.
    Clean words read nothing more; a timeout (ERR_FLAG) or a refused call (FAIL_CALL) in them
    reads the slot again, which consumes it and raises, as check_error() does."""
    from ditron_ep.runtime import control as C
    from ditron_ep.runtime.heap import SymmetricHeap

    class Heap:
        def __init__(self, error):
            self.error, self.reads = error, 0

        def read_error(self):
            self.reads += 1
            return self.error

    clean = [0] * C.HOST_WORDS
    h = Heap(RuntimeError("recorded"))
    SymmetricHeap.check_error(h, clean)
    assert h.reads == 0
    for word in (C.ERR_FLAG, C.FAIL_CALL):
        words = list(clean)
        words[word] = 1
        with pytest.raises(RuntimeError, match="recorded"):
            SymmetricHeap.check_error(h, words)
    assert h.reads == 2
    SymmetricHeap.check_error(Heap(None), None)  # no words: one read, nothing recorded
