"""The overlapped schedule of all_gather_matmul: one persistent launch on a symmetric heap
(`ag_gemm_kernels.ag_gemm_kernel`), bitwise equal to the sequential schedule.

`AllGatherMatmulHeap` holds one group's heap: a landing buffer for the gathered rows and one signal
per (source rank, chunk of rows). It is built at the first call and rebuilt, on every rank together,
when a call needs more rows, another K or another dtype (every rank knows the call's shapes: they
were agreed on before anything moves, functional._agree). Each launch follows a verified
`compiler.tp_plan.AGGemmPlan` (chunk size, role split, GEMM tile): its tile is `gemm.matmul`'s, so
every output tile is computed by the same code with the same tile.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import triton

from ditron_ep.compiler.tp_plan import AGGemmPlan, lower_ag_gemm
from ditron_ep.runtime import control as C
from ditron_ep.runtime.agreement import per_group
from ditron_ep.runtime.fast_launch import fast
from ditron_ep.runtime.heap import SymmetricHeap

__all__ = ["AllGatherMatmulHeap", "overlapped_all_gather_matmul"]

_HEAPS: dict = {}


class AllGatherMatmulHeap:
    """One process group's landing buffer and signals for overlapped AllGather+GEMM."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.heap: SymmetricHeap | None = None
        self.rows_cap = self.k = 0
        self.dtype: torch.dtype | None = None

    def ensure(self, rows: int, k: int, dtype: torch.dtype, device: torch.device, chunk: int) -> None:
        """(Re)build the heap when this call does not fit (collective: every rank passes the same)."""
        if self.heap is not None and rows <= self.rows_cap and k == self.k and dtype == self.dtype:
            return
        if self.heap is not None:
            self.heap.free()
            self.heap = None
        world = dist.get_world_size(self.group)
        rows_cap = max(rows, self.rows_cap if k == self.k and dtype == self.dtype else 0)
        self.n_chunks_cap = triton.cdiv(rows_cap // world, chunk) + 1
        num_signals = world * self.n_chunks_cap
        data = C.align_up(rows_cap * k * torch.empty((), dtype=dtype).element_size())
        size = C.align_up(C.CTRL_BYTES + 4 * num_signals) + data
        self.heap = SymmetricHeap(self.group, size_bytes=size, num_signals=num_signals,
                                  device=device if device.type == "cuda" else None)
        self.heap.alloc("tp/land", (rows_cap, k), dtype)
        self.sig_first = self.heap.alloc_signals("tp/ag", num_signals)
        self.rows_cap, self.k, self.dtype = rows_cap, k, dtype


# Copy programs of the role split on a GPU: enough to keep NVLink busy with per-program tile copies,
# few enough to leave the GEMM most SMs (one program a rank reads and writes ~16 KiB a step).
COMM_PROGRAMS = 16


def overlapped_all_gather_matmul(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                                 return_gathered: bool = False, comm_programs: int | None = None):
    """y = cat_r(a_r) @ b in one launch (arguments already checked and agreed on every rank);
    the gathered rows too when asked (a copy out of the heap). comm_programs: programs that copy
    while the others multiply (default COMM_PROGRAMS on a GPU, 0 under the interpreter); the bits
    do not depend on it."""
    from ditron_ep.ops.tp.ag_gemm_kernels import ag_gemm_kernel

    world = dist.get_world_size(group)
    m, k = a.shape
    n = b.shape[1]
    on_gpu = a.device.type == "cuda"
    device_type = "hip" if on_gpu and torch.version.hip else a.device.type
    plan = _plan(world, m, k, n, str(a.dtype).removeprefix("torch."), device_type,
                 (COMM_PROGRAMS if on_gpu else 0) if comm_programs is None else comm_programs)
    cfg = plan.tile
    state = per_group(_HEAPS, group, AllGatherMatmulHeap)
    state.ensure(world * m, k, a.dtype, a.device, plan.chunk_rows)
    h = state.heap
    y = torch.empty((world * m, n), dtype=a.dtype, device=a.device)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if on_gpu else 1
    elt = a.element_size()
    fast(ag_gemm_kernel)[(programs,)](
        a.contiguous(), b, y, h.ptr_table, h.signal_table, h.offset_of("tp/land"), state.sig_first,
        m, k, n, h.rank, world, h.wait_budget, b.stride(0), b.stride(1), state.n_chunks_cap, plan.comm_programs,
        CHUNK=plan.chunk_rows, BLOCK_C=min(triton.next_power_of_2(max(k, 16)), 4096 // elt),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, INPUT_PRECISION="ieee", **cfg.launch_options())
    h.check_error()
    if return_gathered:
        return y, h.local_view("tp/land")[:world * m].clone()
    return y


@functools.lru_cache(maxsize=64)
def _plan(world: int, m: int, k: int, n: int, dtype: str, device_type: str, comm_programs: int) -> AGGemmPlan:
    """The verified plan of this call's shape (compiler/tp_plan.py): its chunk size, role split and
    GEMM tile drive the launch."""
    return lower_ag_gemm(world, m, k, n, dtype, device_type, comm_programs=comm_programs)


def free_heaps() -> None:
    """Free every group's heap (collective on each group)."""
    for state in list(_HEAPS.values()):
        if state.heap is not None:
            state.heap.free()
    _HEAPS.clear()
