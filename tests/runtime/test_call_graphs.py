"""CallGraphCache policy (runtime/call_graphs.py): capture on a signature's second call, LRU bound
without thrash, capacity 0 disables, a failed capture is forgotten, a library error is not
swallowed, the garbage collector's state survives a capture. The graphs themselves need CUDA
(tests/gpu/test_moe_gpu.py); here `capture` is a stand-in that records its calls."""
from __future__ import annotations

import pytest

from ditron_ep.runtime.call_graphs import CallGraphCache


def _capturer(log: list):
    def make(key):
        def capture():
            log.append(key)
            return f"graphs of {key}"
        return capture
    return make


def test_first_call_runs_directly_second_captures_then_replays():
    log: list = []
    make = _capturer(log)
    cache = CallGraphCache(2)
    assert cache.lookup("T=128", make("T=128")) is None  # first sight: launch directly
    assert log == []
    assert cache.lookup("T=128", make("T=128")) == "graphs of T=128"  # second: captured
    assert cache.lookup("T=128", make("T=128")) == "graphs of T=128"  # third: replayed, no new capture
    assert log == ["T=128"]
    assert "T=128" in cache and len(cache) == 1


def test_a_stale_least_recently_used_signature_is_evicted():
    log: list = []
    make = _capturer(log)
    cache = CallGraphCache(2)
    for key in ("a", "a", "b", "b"):
        cache.lookup(key, make(key))
    cache.lookup("c", make("c"))
    assert cache.lookup("c", make("c")) is None  # a and b were used within 4 * capacity lookups: kept
    for _ in range(8):
        cache.lookup("a", make("a"))  # b goes stale
    assert cache.lookup("c", make("c")) == "graphs of c"  # c still counts as seen: captured, b evicted
    assert "a" in cache and "c" in cache and "b" not in cache and len(cache) == 2
    assert cache.lookup("b", make("b")) is None  # b starts over: seen once again
    assert log == ["a", "b", "c"]


def test_more_recurring_signatures_than_capacity_do_not_recapture_every_call():
    """5 decode sizes in turn with room for 4: the first 4 captured stay, the fifth launches
    directly (plain LRU would evict and recapture on every call, each a device sync)."""
    log: list = []
    make = _capturer(log)
    cache = CallGraphCache(4)
    hits = 0
    for i in range(100):
        key = i % 5
        hits += cache.lookup(key, make(key)) is not None
    assert log == [0, 1, 2, 3]
    assert hits == 100 - 5 - 19  # misses: the 5 first sightings and the fifth key's later 19 calls


def test_capacity_zero_never_captures():
    log: list = []
    cache = CallGraphCache(0)
    for _ in range(3):
        assert cache.lookup("k", _capturer(log)("k")) is None
    assert log == [] and len(cache) == 0


def test_failed_capture_propagates_and_is_forgotten():
    cache = CallGraphCache(1)
    cache.lookup("k", lambda: "unused")

    def broken():
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        cache.lookup("k", broken)
    assert "k" not in cache
    assert cache.lookup("k", lambda: "g") is None  # first sight again
    assert cache.lookup("k", lambda: "g") == "g"


def test_one_off_signatures_are_remembered_boundedly_and_clear_drops_all():
    cache = CallGraphCache(1)
    for t in range(100):
        cache.lookup(t, lambda: "never")
    assert len(cache._seen) == 4 and len(cache) == 0  # the last 4 * capacity one-off keys
    cache.lookup(99, lambda: "g99")
    assert 99 in cache
    cache.clear()
    assert len(cache) == 0 and len(cache._seen) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_capacity_must_be_a_nonnegative_int(bad):
    with pytest.raises(ValueError, match="graph cache capacity"):
        CallGraphCache(bad)


def test_give_up_warns_on_a_capture_failure_but_passes_library_errors_on():
    from ditron_ep.runtime.errors import DitronConfigError

    cache = CallGraphCache(2)
    cache.lookup("k", lambda: "unused")

    def ours():
        raise DitronConfigError("a bug of the library, not of the capture")

    with pytest.raises(DitronConfigError):
        cache.lookup_or_give_up("k", ours, "owner")
    assert cache.capacity == 2
    cache.lookup("k", lambda: "unused")

    def cuda():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(RuntimeWarning, match="owner: capturing"):
        assert cache.lookup_or_give_up("k", cuda, "owner") is None
    assert cache.capacity == 0 and len(cache) == 0


def test_graph_capture_restores_the_garbage_collector_state(monkeypatch):
    import contextlib
    import gc

    import torch

    from ditron_ep.runtime.call_graphs import graph_capture

    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())  # no GPU here
    was = gc.isenabled()
    try:
        for before in (False, True):
            (gc.enable if before else gc.disable)()
            with graph_capture(object()):
                assert not gc.isenabled()
            assert gc.isenabled() == before
    finally:
        (gc.enable if was else gc.disable)()
