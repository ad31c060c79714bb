"""Diagnostic (GPUs, torchrun; not a benchmark): how fast do Triton stores from SMs push bytes to
a peer GPU over NVLink, against the copy engine and NCCL moving the same bytes?

    torchrun --nproc-per-node 2 bench/diag/nvlink_store.py [--mib 112] [--iters 10]

Every rank writes --mib MiB of bf16 rows (H=7168) into the next rank's symmetric buffer at the
same time (a ring: every rank sends and receives at once, as in an all-to-all), with a persistent
copy kernel (program p takes tiles p, p + P, ...; a tile is BLOCK_R rows x BLOCK_H columns, one
masked load from local HBM and one store to the peer), for P programs and tile shapes. Baselines
in the same run: the same kernel writing into local memory (HBM to HBM), the copy engine
(`peer.copy_(src)`, cudaMemcpyAsync between devices) and NCCL `all_to_all_single` moving the
same bytes to the peer. Then "all peers": every rank splits the same bytes evenly over every
other rank (tiles alternate between peers), through the library's heap (`heap_ptr`), to see
whether a rank's outgoing rate grows with the number of peers (on 2 ranks it is the ring again).
Times: per iteration the slowest rank (CUDA events after a barrier),
median of --iters; GB/s = bytes one rank sends / that time. Results are checked (the peer's
buffer equals the sender's rows) once per variant.
"""
import argparse
import statistics

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from ditron_ep.language.primitives import heap_ptr
from ditron_ep.runtime.heap import SymmetricHeap

H = 7168


@triton.jit
def push_rows_kernel(src_ptr, dst_ptr, n_rows, H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    n_col = H // BLOCK_H
    n_tiles = tl.cdiv(n_rows, BLOCK_R) * n_col
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        o_r = ((t // n_col) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        o_c = (t % n_col) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (o_r < n_rows)[:, None]
        v = tl.load(src_ptr + o_r[:, None] * H + o_c[None, :], mask=m)
        tl.store(dst_ptr + o_r[:, None] * H + o_c[None, :], v, mask=m)


@triton.jit
def push_all_peers_kernel(src_ptr, table_ptr, land_off, slot_elems, n_rows, rank, world, H: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows [0, n_rows) of src to every other rank p, into slot `rank` of p's landing buffer
    (world, n_rows, H) at land_off (slot_elems = rank * n_rows * H); consecutive tiles go to
    different peers."""
    n_col = H // BLOCK_H
    n_tiles = tl.cdiv(n_rows, BLOCK_R) * n_col * (world - 1)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        q = t // (world - 1)
        peer = (rank + 1 + t % (world - 1)) % world
        o_r = ((q // n_col) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        o_c = (q % n_col) * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (o_r < n_rows)[:, None]
        dst = heap_ptr(table_ptr, peer, land_off, tl.bfloat16) + slot_elems
        v = tl.load(src_ptr + o_r[:, None] * H + o_c[None, :], mask=m)
        tl.store(dst + o_r[:, None] * H + o_c[None, :], v, mask=m)


def timed(fn, iters):
    """Median over iters of the slowest rank's time (µs) of one fn() after a barrier."""
    out = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        t = torch.tensor([start.elapsed_time(end) * 1e3], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=112)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    rows = args.mib * 2**20 // (H * 2)
    nbytes = rows * H * 2
    land = symm_mem.empty(rows * H, dtype=torch.bfloat16, device="cuda")
    handle = symm_mem.rendezvous(land, dist.group.WORLD)
    # the tensor may start inside the peer's allocation at an offset of its own (torch's pool)
    offsets = [0] * world
    dist.all_gather_object(offsets, (land.data_ptr() - int(handle.buffer_ptrs[rank])) // 2)
    peer = handle.get_buffer((rank + 1) % world, (rows, H), torch.bfloat16,
                             storage_offset=offsets[(rank + 1) % world])
    land = land.view(rows, H)
    src = torch.randn(rows, H, device="cuda").to(torch.bfloat16)
    local = torch.empty_like(src)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [f"# {world} x {torch.cuda.get_device_name(0)}, {sms} SMs, triton {triton.__version__}, torch "
             f"{torch.__version__}; every rank sends {nbytes / 1e6:.1f} MB ({rows} rows of {H} bf16) to rank + 1"]

    def line(name, us, ok=""):
        lines.append(f"{name:52s} {us:9.1f} us  {nbytes / us / 1e3:7.1f} GB/s{ok}")

    def check():
        """'' if every rank's landing buffer holds rank - 1's rows, else a warning; clears it."""
        torch.cuda.synchronize()
        dist.barrier()
        got = land
        buf = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(buf, src)
        flag = torch.tensor([0 if torch.equal(got, buf[(rank - 1) % world]) else 1], device="cuda")
        dist.all_reduce(flag)
        got.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        return "" if int(flag) == 0 else "  WRONG DATA"

    for block_r, block_h, warps in ((16, 512, 4), (16, 512, 8), (16, 1024, 8), (32, 1024, 8), (8, 1024, 4)):
        for programs in (16, 33, 66, 132, 264):
            def push():
                push_rows_kernel[(programs,)](src, peer, rows, H, block_r, block_h, num_warps=warps)
            us = timed(push, args.iters)
            line(f"SM stores to peer  R{block_r} H{block_h} w{warps} P={programs}", us, check())
    for programs in (66, 132):
        us = timed(lambda: push_rows_kernel[(programs,)](src, local, rows, H, 16, 1024, num_warps=8), args.iters)
        line(f"SM stores to local HBM  R16 H1024 w8 P={programs}", us)
    us = timed(lambda: peer.copy_(src), args.iters)
    line("copy engine: peer.copy_(src)", us, check())
    a2a_in = torch.empty(world * rows, H, dtype=src.dtype, device="cuda")
    a2a_out = torch.empty_like(a2a_in)
    # every rank sends `rows` rows to each rank (itself included); bytes per peer as above
    us = timed(lambda: dist.all_to_all_single(a2a_out, a2a_in), args.iters)
    line(f"NCCL all_to_all_single ({rows} rows to every rank, self included)", us)
    # ---- all peers at once, through the library's heap
    per_peer = max(rows // max(world - 1, 1), 1)
    heap = SymmetricHeap(None, backend="torch", size_bytes=world * per_peer * H * 2 + 2**20)
    heap.alloc("land", (world, per_peer, H), torch.bfloat16)
    sent = (world - 1) * per_peer * H * 2
    for programs in (33, 66, 132, 264):
        def push_all():
            push_all_peers_kernel[(programs,)](src, heap.ptr_table, heap.offset_of("land"), rank * per_peer * H,
                                               per_peer, rank, world, H, 32, 1024, num_warps=8)
        us = timed(push_all, args.iters)
        torch.cuda.synchronize()
        dist.barrier()
        buf = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(buf, src)
        got = heap.local_view("land")
        bad = sum(0 if torch.equal(got[s], buf[s][:per_peer]) else 1 for s in range(world) if s != rank)
        flag = torch.tensor([bad], device="cuda")
        dist.all_reduce(flag)
        got.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        lines.append(f"{f'SM stores to all {world - 1} peers  R32 H1024 w8 P={programs}':52s} {us:9.1f} us  "
                     f"{sent / us / 1e3:7.1f} GB/s out of each rank{'' if int(flag) == 0 else '  WRONG DATA'}")
    heap.free()
    for r in range(world):
        if r == rank:
            print("\n".join(f"[rank {rank}] {s}" for s in lines), flush=True)
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
