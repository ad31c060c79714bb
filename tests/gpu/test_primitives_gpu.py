"""Heap and tile primitives on the `torch` backend (CUDA symmetric memory), under torchrun.

The GPU twin of tests/runtime/test_heap.py and test_signals.py. Run with
tests/gpu/run_gpu_suite.sh. Every test is collective: all ranks run it, in the same order, and
assert only after their last collective call (the conftest then fails the test on every rank
if it failed on any).

Compiles: the exchange kernel specialises on the tile's dtype and on R and C (1 / multiple of
16 / other), so the tiles of the tests share a few shapes; the test-local kernels take their
peer, offsets and sizes unspecialised (one binary each).
"""
from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import ditron_ep  # noqa: F401  (decides compiled vs interpreted before the triton.jit below)
from ditron_ep.check.kernels import exchange_tiles
from ditron_ep.language.primitives import heap_ptr
from ditron_ep.runtime import DitronConfigError, DitronTimeoutError, SymmetricHeap

# ---------------------------------------------------------------------------------------------
# Test-local kernels: reach peers through the heap's pointer table.


@triton.jit(do_not_specialize=["peer", "offset_bytes", "n_bytes"])
def _peer_read_bytes_kernel(table_ptr, peer, offset_bytes, out_ptr, n_bytes, BLOCK: tl.constexpr):
    """out[:n_bytes] = bytes [offset, offset + n_bytes) of rank `peer`'s arena (own cast)."""
    base = tl.load(table_ptr + peer).to(tl.pointer_type(tl.uint8)) + offset_bytes
    for i in range(0, n_bytes, BLOCK):
        o = i + tl.arange(0, BLOCK)
        m = o < n_bytes
        tl.store(out_ptr + o, tl.load(base + o, mask=m), mask=m)


@triton.jit(do_not_specialize=["peer", "offset_bytes", "n"])
def _peer_read_f32_kernel(table_ptr, peer, offset_bytes, out_ptr, n, BLOCK: tl.constexpr):
    """out[:n] = float32 buffer at `offset_bytes` on rank `peer` (through the library's heap_ptr)."""
    src = heap_ptr(table_ptr, peer, offset_bytes, tl.float32)
    for i in range(0, n, BLOCK):
        o = i + tl.arange(0, BLOCK)
        m = o < n
        tl.store(out_ptr + o, tl.load(src + o, mask=m), mask=m)


@triton.jit(do_not_specialize=["offset_bytes", "rank"])
def _peer_write_kernel(table_ptr, offset_bytes, rank, BLOCK: tl.constexpr):
    """Program p writes row `rank` of the int32 [W, BLOCK] buffer on rank p (a remote put)."""
    peer = tl.program_id(0)
    dst = (tl.load(table_ptr + peer) + offset_bytes).to(tl.pointer_type(tl.int32)) + rank * BLOCK
    o = tl.arange(0, BLOCK)
    tl.store(dst + o, rank * 100_000 + peer * 1000 + o)


# ---------------------------------------------------------------------------------------------
# Helpers


def _tile(src: int, call: int, R: int, C: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The tile rank `src` sends in call `call`: random bits, reproducible on every rank."""
    g = torch.Generator().manual_seed(1_000_003 * src + 7919 * call + 17)
    if dtype.is_floating_point:
        t = torch.randn(R, C, generator=g).to(dtype)
    else:
        t = torch.randint(-2**31, 2**31 - 1, (R, C), generator=g, dtype=torch.int64).to(dtype)
    return t.to(device)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


def _check_exchange(out: torch.Tensor, call: int, R: int, C: int, dtype, world: int, device,
                    problems: list, tiles=None) -> None:
    if tuple(out.shape) != (world, R, C) or out.dtype != dtype:
        problems.append(f"call {call}: out is {tuple(out.shape)} {out.dtype}, want {(world, R, C)} {dtype}")
        return
    for src in range(world):
        want = tiles[src] if tiles is not None else _tile(src, call, R, C, dtype, device)
        if not _bits_equal(out[src], want):
            n_bad = int((out[src] != want).sum()) if R * C else 0
            problems.append(f"call {call}: tile from rank {src} differs in {n_bad} of {R * C} elements")


def _gather(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _fill(peer: int, i: int, shape, dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    v = (torch.arange(n, dtype=torch.int64) * 7 + i) % 50 + 50 * peer  # <= 199: exact in every dtype
    return v.reshape(shape).to(dtype)


# ---------------------------------------------------------------------------------------------
# Heap: allocation and peer visibility

SPECS = [((5,), torch.float32), ((3, 7), torch.bfloat16), ((2, 2, 3), torch.int32), ((1,), torch.uint8),
         ((1000, 33), torch.float16), ((4099,), torch.float32)]


def test_alloc_offsets_and_peer_reads(dist_env, make_heap):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    problems: list[str] = []
    heap = make_heap(size_bytes=4 << 20)
    views = [heap.alloc(f"buf{i}", shape, dtype) for i, (shape, dtype) in enumerate(SPECS)]
    for i, ((shape, dtype), v) in enumerate(zip(SPECS, views)):
        v.copy_(_fill(rank, i, shape, dtype).to(dev))
        if v.device != dev or tuple(v.shape) != shape or v.dtype != dtype:
            problems.append(f"buf{i}: view is {v.device} {tuple(v.shape)} {v.dtype}")
    offsets = [heap.offset_of(f"buf{i}") for i in range(len(SPECS))]
    table = heap.ptr_table.cpu().tolist()
    if heap.ptr_table.device != dev or heap.ptr_table.dtype != torch.int64:
        problems.append(f"ptr_table is {heap.ptr_table.dtype} on {heap.ptr_table.device}")
    if len(table) != world or len(set(table)) != world or 0 in table:
        problems.append(f"ptr_table must hold {world} distinct non-null bases, got {table}")
    if heap.signal_table.cpu().tolist() != [b + heap.signal_offset for b in table]:
        problems.append("signal_table != ptr_table + signal_offset")
    if heap.signals.data_ptr() != table[rank] + heap.signal_offset:
        problems.append("signals view is not at ptr_table[rank] + signal_offset")
    for i, v in enumerate(views):
        if v.data_ptr() != table[rank] + offsets[i]:
            problems.append(f"buf{i}: local view at {v.data_ptr():#x}, ptr_table[rank] + offset is "
                            f"{table[rank] + offsets[i]:#x}")
    if any(o % 256 for o in offsets) or offsets != sorted(set(offsets)):
        problems.append(f"offsets must be distinct, increasing and 256-byte aligned: {offsets}")
    all_offsets = _gather(offsets)
    if any(o != all_offsets[0] for o in all_offsets):
        problems.append(f"offsets differ across ranks: {all_offsets}")
    heap.barrier()  # every rank's fill is done before anyone reads it

    for peer in range(world):
        for i, (shape, dtype) in enumerate(SPECS):
            buf = heap.buffer(f"buf{i}")
            got = torch.empty(buf.nbytes, dtype=torch.uint8, device=dev)
            _peer_read_bytes_kernel[(1,)](heap.ptr_table, peer, buf.offset, got, buf.nbytes, BLOCK=1024)
            want = _fill(peer, i, shape, dtype).flatten().view(torch.uint8).to(dev)
            if not torch.equal(got, want):
                problems.append(f"raw read of buf{i} on rank {peer}: wrong bytes")
        for i in (0, 5):  # float32 buffers, through primitives.heap_ptr
            buf = heap.buffer(f"buf{i}")
            n = buf.nbytes // 4
            got = torch.empty(n, dtype=torch.float32, device=dev)
            _peer_read_f32_kernel[(1,)](heap.ptr_table, peer, buf.offset, got, n, BLOCK=512)
            if not torch.equal(got, _fill(peer, i, SPECS[i][0], torch.float32).flatten().to(dev)):
                problems.append(f"heap_ptr read of buf{i} on rank {peer}: wrong values")
    heap.barrier()  # no rank frees or rewrites while a peer still reads
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_several_live_heaps_each_see_their_own_arena(dist_env, make_heap):
    # Small arenas alive at the same time: an allocator may place them inside one larger block
    # (torch's implicit symmetric-memory pool), where the rendezvous handle's buffer_ptrs are the
    # block bases, not the arenas'. Every heap's ptr_table must still point at its own arena.
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    heaps = [make_heap(size_bytes=size, num_signals=64) for size in (256 << 10, 64 << 10, 1 << 20, 64 << 10)]
    problems: list[str] = []
    for h, heap in enumerate(heaps):
        v = heap.alloc("v", (257,), torch.int32)
        v.copy_(torch.arange(257, dtype=torch.int32, device=dev) + 1000 * rank + 100_000 * h)
        base = int(heap.ptr_table[rank])
        if v.data_ptr() != base + heap.offset_of("v"):
            problems.append(f"heap {h}: ptr_table[{rank}] = {base:#x} but the local arena starts at "
                            f"{v.data_ptr() - heap.offset_of('v'):#x}")
    for h, heap in enumerate(heaps):
        heap.barrier()
        buf = heap.buffer("v")
        for peer in range(world):
            got = torch.empty(buf.nbytes, dtype=torch.uint8, device=dev)
            _peer_read_bytes_kernel[(1,)](heap.ptr_table, peer, buf.offset, got, buf.nbytes, BLOCK=1024)
            want = (torch.arange(257, dtype=torch.int32) + 1000 * peer + 100_000 * h).view(torch.uint8).to(dev)
            if not torch.equal(got, want):
                problems.append(f"heap {h}: reading rank {peer}'s buffer through ptr_table gave wrong data")
    # Then the signals and kernels of each heap, unless some rank already saw wrong bases (a
    # kernel would then write to wrong addresses and wait out its whole budget). Decided together.
    if not any(_gather(bool(problems))):
        for h, heap in enumerate(heaps):
            out = exchange_tiles(heap, _tile(rank, h, 3, 5, torch.float32, dev))
            _check_exchange(out, h, 3, 5, torch.float32, world, dev, problems)
    for heap in heaps:
        heap.barrier()
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_remote_puts_land_in_peer_buffers(dist_env, make_heap):
    rank, world = dist_env.rank, dist_env.world
    block = 64
    heap = make_heap(size_bytes=1 << 20)
    heap.alloc("pad", (3,), torch.uint8)  # the target does not start at the first data offset
    local = heap.alloc("rows", (world, block), torch.int32)
    local.fill_(-1)
    heap.barrier()
    _peer_write_kernel[(world,)](heap.ptr_table, heap.offset_of("rows"), rank, BLOCK=block)
    heap.barrier()  # all puts complete (device sync on every writer) before reading
    o = torch.arange(block, dtype=torch.int64)
    want = torch.stack([(w * 100_000 + rank * 1000 + o) for w in range(world)]).to(torch.int32)
    got = local.cpu()
    bad_rows = [w for w in range(world) if not torch.equal(got[w], want[w])]
    heap.barrier()
    assert not bad_rows, f"rank {rank}: rows written by ranks {bad_rows} are wrong: {got[bad_rows]}"


# ---------------------------------------------------------------------------------------------
# Tile exchange: puts to every peer, call-number-stamped signals, bounded waits

RAGGED = (37, 130)  # R not a multiple of BLOCK_R=16, C not a multiple of BLOCK_C=128
# Grid sizes share a binary; the ragged shape runs in bf16 and fp32 (fp16 and int32 in the edge
# cases below, and at ragged shapes on emulated ranks: tests/runtime/test_signals.py).
EXCHANGE_CASES = [(*RAGGED, dt, p) for dt in (torch.float32, torch.bfloat16) for p in (1, 7, None)]
EXCHANGE_CASES += [
    (1, 3, torch.int32, 7),            # more programs than tasks
    (16, 128, torch.float16, None),    # exact multiples of the blocks
    (300, 1000, torch.bfloat16, None),  # many row blocks and column chunks
    (129, 257, torch.float32, 7),
    (0, 8, torch.float32, None),       # empty tile: only the call barrier runs
]


@pytest.mark.parametrize("R,C,dtype,programs", EXCHANGE_CASES,
                         ids=[f"R{r}-C{c}-{str(d)[6:]}-P{p or 'default'}" for r, c, d, p in EXCHANGE_CASES])
def test_exchange_element_exact(dist_env, make_heap, R, C, dtype, programs):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    heap = make_heap()
    problems: list[str] = []
    for call in range(2):  # the second call reuses buffers and signals at the next call number
        out = exchange_tiles(heap, _tile(rank, call, R, C, dtype, dev), num_programs=programs)
        _check_exchange(out, call, R, C, dtype, world, dev, problems)
    call_no = heap.call_number
    if call_no != 2:
        problems.append(f"call number after 2 calls is {call_no}, want 2")
    heap.barrier()
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_thousand_calls_without_reset(dist_env, make_heap):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    R, C, n_calls = 20, 130, 1000
    heap = make_heap()
    # Inputs are made on the device (no host sync between calls): base[src] + call, exact in fp32.
    g = torch.Generator().manual_seed(5)
    base = torch.randint(-2**20, 2**20, (world, R, C), generator=g).to(torch.float32).to(dev)
    problems: list[str] = []
    checked = []
    t0 = time.time()
    for call in range(n_calls):
        verify = call % 100 == 99 or call == n_calls - 1
        out = exchange_tiles(heap, base[rank] + call, check=verify)
        if verify:
            checked.append(call)
            _check_exchange(out, call, R, C, torch.float32, world, dev, problems,
                            tiles=[base[s] + call for s in range(world)])
    seconds = time.time() - t0
    call_no = heap.call_number
    if call_no != n_calls:
        problems.append(f"call number after {n_calls} calls is {call_no}")
    heap.barrier()
    assert checked == [*range(99, n_calls, 100)], checked  # every 100th call; the last is call 999
    assert not problems, f"rank {rank} ({seconds:.1f} s):\n" + "\n".join(problems[:20])


def test_epoch_wraps_around(dist_env, make_heap):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    start, n_calls, R, C = 2**31 - 1 - 3, 10, 37, 130  # calls cross the int32 wrap point
    heap = make_heap()
    heap.reset(start)
    problems: list[str] = []
    if heap.call_number != start:
        problems.append(f"call number after reset({start}) is {heap.call_number}")
    for call in range(n_calls):
        out = exchange_tiles(heap, _tile(rank, call, R, C, torch.bfloat16, dev), num_programs=2)
        _check_exchange(out, call, R, C, torch.bfloat16, world, dev, problems)
    call_no = heap.call_number
    if call_no != start + n_calls - 2**32:
        problems.append(f"call number after {n_calls} calls is {call_no}, want {start + n_calls - 2**32} (wrapped)")
    heap.barrier()
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_cuda_graph_replays_advance_epochs(dist_env, make_heap):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    R, C, dtype, n_replays = 37, 130, torch.bfloat16, 20
    heap = make_heap()
    problems: list[str] = []
    x = torch.empty(R, C, dtype=dtype, device=dev)
    x.copy_(_tile(rank, 0, R, C, dtype, dev))
    # Eager call first: compiles the kernel and allocates the buffer and signals (collective host
    # work that must not happen during capture).
    out0 = exchange_tiles(heap, x)
    _check_exchange(out0, 0, R, C, dtype, world, dev, problems)
    heap.barrier()
    graph = torch.cuda.CUDAGraph()
    # No garbage collection during capture: freeing an earlier test's symmetric arena there would
    # synchronise the device and invalidate the capture (torch.cuda.graph collects just before).
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = exchange_tiles(heap, x, check=False)
    finally:
        gc.enable()
    if heap.call_number != 1:
        problems.append(f"capture must not run the kernel: call_no is {heap.call_number}, want 1")
    for call in range(1, n_replays + 1):
        x.copy_(_tile(rank, call, R, C, dtype, dev))
        graph.replay()
        _check_exchange(out, call, R, C, dtype, world, dev, problems)
    heap.check_error()
    call_no = heap.call_number
    if call_no != 1 + n_replays:
        problems.append(f"call number after {n_replays} replays is {call_no}, want {1 + n_replays}")
    heap.barrier()
    del graph
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_unnotified_wait_times_out_then_recovers(dist_env, make_heap):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    if world < 2:
        pytest.skip("the timeout path needs at least 2 ranks")
    R, C = 4, 8
    # Compile this exact specialisation with the default budget first, so that compile-time skew
    # between ranks cannot eat the small budget of the joint call below.
    warm = make_heap(size_bytes=1 << 20)
    exchange_tiles(warm, torch.ones(R, C, device=dev))
    warm.barrier()

    budget = 200_000
    heap = make_heap(size_bytes=1 << 20, wait_budget=budget)
    problems: list[str] = []
    out = exchange_tiles(heap, torch.full((R, C), float(rank), device=dev))  # together: buffers exist
    _check_exchange(out, 0, R, C, torch.float32, world, dev, problems,
                    tiles=[torch.full((R, C), float(s), device=dev) for s in range(world)])
    record: dict = {}
    if rank == 0:  # the other ranks never join this call
        t0 = time.time()
        try:
            exchange_tiles(heap, torch.ones(R, C, device=dev))
            record["raised"] = None
        except DitronTimeoutError as err:
            record.update(raised=str(err), rank=err.rank, stage=err.stage, signal=err.signal,
                          observed=err.observed, expected=err.expected)
        except Exception as err:  # recorded, not raised: the other ranks wait in reset() below
            record["raised"], record["wrong"] = None, f"{type(err).__name__}: {err}"
        record["seconds"] = time.time() - t0
    elif heap.read_error() is not None:
        problems.append(f"rank {rank} recorded an error without launching: {heap.read_error()}")
    heap.reset()
    if heap.read_error() is not None or heap.call_number != 0:
        problems.append(f"after reset: error {heap.read_error()}, call {heap.call_number}")
    out = exchange_tiles(heap, torch.full((R, C), float(10 + rank), device=dev))
    _check_exchange(out, 1, R, C, torch.float32, world, dev, problems,
                    tiles=[torch.full((R, C), float(10 + s), device=dev) for s in range(world)])
    if heap.call_number != 1:
        problems.append(f"call number after reset + 1 call is {heap.call_number}, want 1")
    heap.barrier()
    if rank == 0:
        if record["raised"] is None:
            problems.append(f"the lone call did not raise DitronTimeoutError "
                            f"({record.get('wrong', 'it returned normally')})")
        else:
            msg = record["raised"]
            if (record["rank"], record["stage"], record["signal"]) != (0, "call barrier", 1):
                problems.append(f"error names rank {record['rank']}, stage {record['stage']!r}, "
                                f"signal {record['signal']}; want rank 0, 'call barrier', signal 1")
            if (record["observed"], record["expected"]) != (1, 2):
                problems.append(f"error saw {record['observed']} waiting for {record['expected']}; "
                                f"want 1 (peer 1 is still in call 1) and 2")
            if not all(s in msg for s in ("rank 0 waited", "call barrier", "for rank 1 to arrive at call 2",
                                          "nothing needs resetting")):
                problems.append(f"message does not name rank, stage, the rank waited for and the call: {msg}")
        if record["seconds"] > 15:
            problems.append(f"timeout took {record['seconds']:.1f} s for {budget} polls (want a few s)")
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# Misuse


def test_bad_inputs_raise_clear_errors(dist_env, make_heap):
    rank, world, dev = dist_env.rank, dist_env.world, dist_env.device
    msgs: dict[str, str] = {}

    def catch(key, fn):
        try:
            fn()
            msgs[key] = "no error"
        except DitronConfigError as err:
            msgs[key] = str(err)
        except Exception as err:  # the wrong exception type is a failure too
            msgs[key] = f"wrong exception {type(err).__name__}: {err}"

    catch("world_size", lambda: SymmetricHeap(backend="torch", expected_world_size=world + 1))
    catch("backend", lambda: SymmetricHeap(backend="nccl-magic"))
    catch("emulated_compiled", lambda: SymmetricHeap(backend="emulated"))
    heap = make_heap(size_bytes=1 << 20)
    catch("non_contiguous", lambda: exchange_tiles(heap, torch.ones(8, 4, device=dev).t()))
    catch("dtype", lambda: exchange_tiles(heap, torch.ones(4, 4, dtype=torch.float64, device=dev)))
    catch("cpu_tensor", lambda: exchange_tiles(heap, torch.ones(4, 4)))
    catch("ndim", lambda: exchange_tiles(heap, torch.ones(4, device=dev)))
    if world > 1:
        catch("asymmetric", lambda: heap.alloc("x", (8 + rank,), torch.float32))
    else:
        msgs["asymmetric"] = "differs across ranks; same order (not testable with one rank)"
    catch("heap_full", lambda: heap.alloc("huge", (1 << 20,), torch.float32))
    heap.barrier()
    expect = {
        "world_size": ["world-size mismatch", str(world + 1)],
        "backend": ["unknown backend", "nccl-magic"],
        "emulated_compiled": ["emulated", "TRITON_INTERPRET"],
        "non_contiguous": ["contiguous"],
        "dtype": ["float64"],
        "cpu_tensor": ["cpu", "cuda"],
        "ndim": ["2-D"],
        "asymmetric": ["differs across ranks", "same order"],
        "heap_full": ["larger size_bytes"],
    }
    problems = [f"{k}: {msgs.get(k)!r} lacks {w!r}" for k, words in expect.items() for w in words
                if w not in msgs.get(k, "")]
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)
