"""The nvshmem heap backend and the put transport on CUDA ranks, under torchrun (needs nvshmem4py:
the `nvshmem` extra; the suite fails, not skips, without it).

Heap: allocation, peer visibility through NVSHMEM's peer mapping, repeated build/free on the one
NVSHMEM instance of the process. Ops: dispatch, combine and the fused layer on the nvshmem backend
give the torch backend's bits. Put transport: the tile exchange with NVSHMEM put-with-signal to
every peer gives the pointer transport's bits; a signal that never comes ends in the bounded-wait
error. Every test is collective and asserts only after its last collective (see conftest).
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import ditron_ep  # noqa: F401  (decides compiled vs interpreted before the triton.jit below)
from ditron_ep.check import make_routing
from ditron_ep.check.kernels import exchange_tiles, read_peer_bytes
from ditron_ep.language.nvshmem import nvshmem_launcher, put_signal, quiet
from ditron_ep.language.primitives import ctrl_ptr, heap_ptr, wait
from ditron_ep.ops import EPBuffer
from ditron_ep.ops.moe_layer.fused import FusedMoE
from ditron_ep.runtime import DitronTimeoutError, SymmetricHeap
from ditron_ep.runtime.heap import register_stage
from ditron_ep.runtime.transport import put_signal_words

STAGE_TEST_PUT = tl.constexpr(register_stage(90, "test: put-with-signal receive"))


def test_heap_alloc_peer_visibility_and_rebuild(dist_env):
    """Heaps built and freed in turn on the one NVSHMEM instance: each rank's bytes are what every
    peer reads through the pointer table, and a freed heap's successor starts zeroed. Five of 300
    MiB: more than the symmetric heap NVSHMEM reserved for the first (that + 512 MiB), so a free
    that did not give the memory back fails the later ones."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    problems = []
    for round_, size in enumerate((8 << 20, 9 << 20, *(300 << 20,) * 5)):
        heap = SymmetricHeap(backend="nvshmem", size_bytes=size)
        buf = heap.alloc("pattern", (4096,), torch.int32)
        if torch.count_nonzero(buf).item():
            problems.append(f"round {round_}: a fresh arena is not zeroed")
        buf.copy_(torch.arange(4096, device=dev, dtype=torch.int32) * (round_ + 1) + 100_000 * rank)
        heap.barrier()
        seen = read_peer_bytes(heap, heap.offset_of("pattern"), 4096 * 4).view(torch.int32)
        for p in range(world):
            want = torch.arange(4096, device=dev, dtype=torch.int32) * (round_ + 1) + 100_000 * p
            if not torch.equal(seen[p], want):
                problems.append(f"round {round_}: rank {rank} reads wrong bytes from rank {p}")
        heap.barrier()
        heap.free()
    assert not problems, problems


def test_exchange_put_transport_bitwise(dist_env):
    """The tile exchange, ragged rows, bf16 and fp32: put-with-signal to every peer lands the same
    bits as pointer stores, call after call, and both equal the sent tiles."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    heap = SymmetricHeap(backend="nvshmem", size_bytes=16 << 20)
    problems = []
    for call, (R, C, dtype) in enumerate(((37, 96, torch.bfloat16), (64, 128, torch.float32),
                                          (37, 96, torch.bfloat16))):
        tiles = [torch.randn(R, C, generator=torch.Generator().manual_seed(100 * call + s)).to(dtype)
                 for s in range(world)]
        by_put = exchange_tiles(heap, tiles[rank].to(dev), transport="put")
        by_ptr = exchange_tiles(heap, tiles[rank].to(dev), transport="pointer")
        want = torch.stack(tiles).to(dev)
        if not torch.equal(by_put, want):
            problems.append(f"call {call}: the put transport landed other bits")
        if not torch.equal(by_ptr, by_put):
            problems.append(f"call {call}: pointer and put transports differ")
    heap.barrier()
    heap.free()
    assert not problems, problems


@triton.jit
def _put_or_not_kernel(x_ptr, out_ptr, table_ptr, sig_table_ptr, recv_offset, sig_word, rank, world, n, call_no,
                       budget, SEND: tl.constexpr):
    """Rank `rank` puts n floats to rank+1 with a signal (SEND) and waits for rank-1's."""
    peer = (rank + 1) % world
    if SEND:
        put_signal(table_ptr, sig_table_ptr, rank, peer, recv_offset, x_ptr, n, sig_word, call_no)
        quiet()
    my_ctrl = ctrl_ptr(table_ptr, rank)
    p_sig = heap_ptr(sig_table_ptr, rank, 0, tl.int32) + sig_word
    if wait(p_sig, call_no, my_ctrl, rank, STAGE_TEST_PUT, sig_word, budget):
        src = heap_ptr(table_ptr, rank, recv_offset, tl.float32)
        for i in range(0, n, 256):
            o = i + tl.arange(0, 256)
            tl.store(out_ptr + o, tl.load(src + o, mask=o < n), mask=o < n)


def test_put_signal_delivers_and_a_lost_signal_times_out(dist_env):
    """put_signal from a test kernel: a ring of puts delivers each rank's floats to the next; when
    no rank sends, every rank's bounded wait gives up and the host raises DitronTimeoutError
    naming the stage; after a reset the next call with sends works again."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    small = 200_000  # polls of the lost call; the delivering calls wait up to the default (~30 s: compile skew)
    heap = SymmetricHeap(backend="nvshmem", size_bytes=4 << 20)
    n = 1000
    heap.alloc("ring", (n,), torch.float32)
    sig = put_signal_words(heap, "ring/put", 1)
    problems = []

    def call(call_no: int, send: bool, budget: int) -> torch.Tensor:
        x = torch.full((n,), float(10 * call_no + rank), device=dev)
        out = torch.full((n,), float("nan"), device=dev)
        nvshmem_launcher(_put_or_not_kernel)[(1,)](x, out, heap.ptr_table, heap.signal_table, heap.offset_of("ring"),
                                                   sig, rank, world, n, call_no, budget, SEND=send)
        return out

    out = call(1, True, heap.wait_budget)
    heap.barrier()
    if heap.read_error() is not None or not torch.equal(out, torch.full_like(out, 10.0 + (rank - 1) % world)):
        problems.append("the ring of puts did not deliver the previous rank's floats")
    t0 = time.time()
    call(2, False, small)
    err = heap.read_error()
    if not isinstance(err, DitronTimeoutError) or "test: put-with-signal receive" not in str(err):
        problems.append(f"a lost signal gave {err!r}, not the bounded-wait DitronTimeoutError")
    if time.time() - t0 > 30:
        problems.append(f"the lost signal took {time.time() - t0:.0f} s to time out")
    heap.reset()  # this test kernel has no call bracket: the reset clears the launch's abort word
    out = call(3, True, heap.wait_budget)
    heap.barrier()
    if heap.read_error() is not None or not torch.equal(out, torch.full_like(out, 30.0 + (rank - 1) % world)):
        problems.append("the call after the timeout did not deliver")
    heap.free()
    assert not problems, problems


def _ep_run(buf: EPBuffer, x, idx, w, layout: str, **combine_kwargs):
    """dispatch -> y = 2 * rows -> combine, then the backward of sum(out * g): (rows, out, dx, dw).
    The rank-reduced combine applies the weights carried by dispatch (no gradient for them: dw None)."""
    reduced = combine_kwargs.get("topk_sum") == "expert_rank"
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(not reduced)
    recv, handle = buf.dispatch(xg, idx, wg, layout=layout)
    y = recv * 2 if layout == "expert_major" else recv[handle.row_index.long()] * 2
    out = buf.combine(y, handle, None if reduced else wg, **combine_kwargs)
    g = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype)
    (out.float() * g.float()).sum().backward()
    return recv.detach().clone(), out.detach(), xg.grad, wg.grad


# combine modes: exact, rank-reduced in the token dtype and with fp32 partials
_COMBINES = {"exact": {}, "rank-reduced": {"topk_sum": "expert_rank"},
             "rank-reduced fp32": {"topk_sum": "expert_rank", "partial_dtype": torch.float32}}


# (seed, routing, tokens of even / odd ranks): ragged counts, an empty rank, skewed routing
_CASES = ((1, "uniform", (311, 0)), (2, "zipf", (250, 123)), (3, "uniform", (59, 191)))


def test_ep_on_nvshmem_equal_torch_backend(dist_env):
    """EPBuffer dispatch + combine (both layouts, the three combine modes, with their backward) on
    the nvshmem backend, with pointer stores and with the put transport forced for every peer (whole
    rows, and column slices: per-row puts), give the torch backend's bits (ragged counts, an empty
    rank, skewed routing)."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    E, H, K = 8 * world, 1000, 8
    bufs = {"torch": EPBuffer(None, E, H, 320, K, torch.bfloat16, backend="torch"),
            "nvshmem": EPBuffer(None, E, H, 320, K, torch.bfloat16, backend="nvshmem"),
            "nvshmem put": EPBuffer(None, E, H, 320, K, torch.bfloat16, backend="nvshmem", transport="put"),
            "nvshmem put, 4 slices": EPBuffer(None, E, H, 320, K, torch.bfloat16, backend="nvshmem", transport="put",
                                              hidden_slices=4, block_hidden=256)}
    sliced = {"torch": EPBuffer(None, E, H, 320, K, torch.bfloat16, backend="torch", hidden_slices=4,
                                block_hidden=256), "nvshmem put, 4 slices": bufs["nvshmem put, 4 slices"]}
    problems = []
    for seed, kind, tokens in _CASES:
        T = tokens[rank % 2]
        g = torch.Generator().manual_seed(1000 * seed + rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
        idx, w = make_routing(T, E, K, kind, generator=g, drop_prob=0.05, num_ranks=world)
        idx, w = idx.to(dev), w.to(dev)
        for layout in ("expert_major", "token_major"):
            # (a token-major dispatch's backward is itself a rank-reduced combine)
            for mode, kw in (_COMBINES.items() if layout == "expert_major" else [("exact", {})]):
                # the sliced put buffer against a torch buffer of the same tiling (slices change no bit either)
                for group in ({b: bufs[b] for b in ("torch", "nvshmem", "nvshmem put")}, sliced):
                    res = {b: _ep_run(buf, x, idx, w, layout, **kw) for b, buf in group.items()}
                    for b in (b for b in group if b != "torch"):
                        for what, a, ref in zip(("rows", "out", "dx", "dw"), res[b], res["torch"]):
                            if (a is None) != (ref is None) or a is not None and not torch.equal(a, ref):
                                problems.append(f"{kind} {tokens} {layout} {mode}: {what} on {b} differs from the "
                                                f"torch backend")
    dist.barrier()
    for obj in (*bufs.values(), sliced["torch"]):
        obj.free()
    assert not problems, problems


def test_fused_layer_on_nvshmem_equal_torch_backend(dist_env):
    """FusedMoE on the nvshmem backend, with pointer stores and with the put transport forced for
    every peer, gives the torch backend's bits (ragged counts, an empty rank, skewed routing), in
    both schedules."""
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    I = 512
    problems = []
    g = torch.Generator().manual_seed(5 + rank)
    w1 = (torch.randn(4, 1024, 2 * I, generator=g) / 32).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(4, I, 1024, generator=g) / 23).to(torch.bfloat16).to(dev)
    for schedule in ("overlap", "sequential"):
        layers = {b: FusedMoE(None, 4 * world, 1024, I, 320, 4, torch.bfloat16, backend=b, schedule=schedule)
                  for b in ("torch", "nvshmem")}
        layers["nvshmem put"] = FusedMoE(None, 4 * world, 1024, I, 320, 4, torch.bfloat16, backend="nvshmem",
                                         transport="put", schedule=schedule)
        for seed, kind, tokens in _CASES:
            T = tokens[rank % 2]
            g = torch.Generator().manual_seed(2000 * seed + rank)
            x_l = torch.randn(T, 1024, generator=g).to(torch.bfloat16).to(dev)
            idx_l, w_l = make_routing(T, 4 * world, 4, kind, generator=g, drop_prob=0.05, num_ranks=world)
            outs = {b: layer(x_l, idx_l.to(dev), w_l.to(dev), w1, w2) for b, layer in layers.items()}
            for b in ("nvshmem", "nvshmem put"):
                if not torch.equal(outs["torch"], outs[b]):
                    problems.append(f"{schedule} {kind} {tokens}: the fused layer on {b} differs from torch's")
        dist.barrier()
        for layer in layers.values():
            layer.free()
    assert not problems, problems
