"""CallGraphCache policy (ops/call_graphs.py): capture on a signature's second call, LRU bound,
capacity 0 disables, a failed capture is forgotten. The graphs themselves need CUDA
(tests/gpu/test_moe_gpu.py); here `capture` is a stand-in that records its calls."""
from __future__ import annotations

import pytest

from ditron_ep.ops.call_graphs import CallGraphCache


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


def test_least_recently_used_signature_is_evicted():
    log: list = []
    make = _capturer(log)
    cache = CallGraphCache(2)
    for key in ("a", "a", "b", "b"):
        cache.lookup(key, make(key))
    cache.lookup("a", make("a"))  # a is now the most recent
    cache.lookup("c", make("c"))
    cache.lookup("c", make("c"))  # captures c, evicts b
    assert "a" in cache and "c" in cache and "b" not in cache and len(cache) == 2
    assert cache.lookup("b", make("b")) is None  # b starts over: seen once again
    assert log == ["a", "b", "c"]


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
