"""The nvshmem heap backend's pure-Python parts on the CPU: argument checks, the transport choice,
the error when nvshmem4py is missing or unsupported, the one-group-per-process rule. Its device
side (allocation, peer mapping, puts) is tested on GPUs: tests/gpu/test_nvshmem_gpu.py."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from ditron_ep.runtime import DitronConfigError
from ditron_ep.runtime.backends import nvshmem as nv
from ditron_ep.runtime.mode import resolve_backend
from ditron_ep.runtime.transport import put_peer_mask, put_signal_words


def test_nvshmem_backend_needs_compiled_kernels():
    with pytest.raises(DitronConfigError, match="backend 'nvshmem' runs compiled kernels on a GPU"):
        resolve_backend("nvshmem")
    with pytest.raises(DitronConfigError, match="auto, emulated, torch, nvshmem"):
        resolve_backend("nvshmem4py")


def test_missing_nvshmem4py_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvshmem", None)  # import nvshmem -> ImportError
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(DitronConfigError, match=r"pip install 'ditron_ep\[nvshmem\]'"):
        nv.import_nvshmem()


@pytest.mark.parametrize("version, ok", [("0.4.1", True), ("0.4.0", True), ("0.3.0", False), ("1.0.0", False)])
def test_unsupported_nvshmem4py_version_raises(monkeypatch, version, ok):
    core = types.ModuleType("nvshmem.core")
    pkg = types.ModuleType("nvshmem")
    pkg.__version__, pkg.core = version, core
    monkeypatch.setitem(sys.modules, "nvshmem", pkg)
    monkeypatch.setitem(sys.modules, "nvshmem.core", core)
    if ok:
        assert nv.import_nvshmem() is core
    else:
        with pytest.raises(DitronConfigError, match=rf"supports nvshmem4py 0\.4\.x; found {version}"):
            nv.import_nvshmem()


def test_one_group_per_process(monkeypatch):
    monkeypatch.setattr(nv, "_instance", nv._Instance(ranks=(0, 1), owned=True))
    nv.check_group((0, 1))  # the same ranks: fine
    with pytest.raises(DitronConfigError, match=r"initialised it for the global ranks \[0, 1\]; a heap over "
                                                r"the ranks \[2, 3\] cannot use it"):
        nv.check_group((2, 3))
    with pytest.raises(DitronConfigError, match="initialised once per process"):
        nv.check_group((1, 0))  # the same ranks in another PE order are another instance


class _Heap(SimpleNamespace):
    def alloc_signals(self, name, count):
        first = self.next
        self.next += count
        self.asked.append((name, count))
        return first


@pytest.mark.parametrize("world", [1, 2, 5])
def test_transport_choice(world):
    torch_heap = _Heap(backend="torch", world_size=world)
    nvshmem_heap = _Heap(backend="nvshmem", world_size=world)
    for heap in (torch_heap, nvshmem_heap):
        assert put_peer_mask(heap, "auto") == 0 and put_peer_mask(heap, "pointer") == 0
    assert put_peer_mask(nvshmem_heap, "put") == (1 << world) - 1  # every peer, itself included
    with pytest.raises(DitronConfigError, match="transport='put' needs NVSHMEM.*backend='nvshmem'.*'torch'"):
        put_peer_mask(torch_heap, "put")
    with pytest.raises(DitronConfigError, match="unknown transport 'nvlink'; choose one of auto, pointer, put"):
        put_peer_mask(nvshmem_heap, "nvlink")


@pytest.mark.parametrize("next_free", [0, 1, 6, 7])
def test_put_signals_are_aligned_uint64_words(next_free):
    heap = _Heap(next=next_free, asked=[])
    first = put_signal_words(heap, "x/put", 3)
    assert first % 2 == 0 and first >= next_free
    assert first + 2 * 3 <= next_free + heap.asked[0][1]  # the 3 words fit in what was reserved


def test_epbuffer_transport_arguments():
    import torch

    from ditron_ep.ops.ep.buffer import _argument_problem

    base = dict(world=2, num_experts=8, hidden=128, max_tokens=16, topk=2, dtype=torch.bfloat16, block_rows=16,
                block_hidden=None, num_warps=None, hidden_slices=None, num_programs=None, graph_cache=0)
    assert _argument_problem(**base, transport="auto") is None
    assert _argument_problem(**base, transport="put", backend="nvshmem") is None
    assert "transport must be one of auto, pointer, put, got 'rdma'" in _argument_problem(**base, transport="rdma")
    for backend in ("auto", "torch", "emulated"):
        assert "transport='put' (NVSHMEM put-with-signal) needs backend='nvshmem'" in _argument_problem(
            **base, transport="put", backend=backend)
    assert "FP8 dispatch has no put transport yet" in _argument_problem(
        **base, dispatch_dtype=torch.float8_e4m3fn, transport="put", backend="nvshmem")
    wide = {**base, "world": 32, "num_experts": 64}
    assert _argument_problem(**wide, transport="pointer", backend="nvshmem") is None
    assert "supports groups of up to 31 ranks" in _argument_problem(**wide, transport="put", backend="nvshmem")
