"""The overlapped schedules of the GEMM + collective ops: one persistent launch each on a symmetric
heap, bitwise equal to the sequential schedule.

  all_gather_matmul      `ag_gemm_kernels.ag_gemm_kernel`: the gathered rows land in every rank's
                         buffer chunk by chunk, each GEMM tile starts when its rows are there;
  matmul_reduce_scatter  `gemm_rs_kernels.gemm_rs_kernel`: each partial tile lands in its rows'
                         owner's buffer, each owner adds a tile's W partials once they are there;
  matmul_all_reduce      `gemm_ar_kernels.gemm_ar_kernel`: the same with tiles owned round-robin,
                         each owner's sum written to every rank, copied out as it lands.

`OverlapHeap` holds one group's heap for one op: a landing buffer and a signal family. It is built
at the first call and rebuilt, on every rank together, when a call needs more rows or signals,
other columns or another dtype (every rank knows the call's shapes: they were agreed on before
anything moves, functional._agree). Each launch follows a verified plan of compiler.tp_plan
(AGGemmPlan, GemmRSPlan, GemmARPlan); its GEMM tile is `gemm.matmul`'s, so every output tile is computed by the
same code with the same tile as in the sequential schedule.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import triton

from ditron_ep.compiler.core_config import GemmTileConfig, device_type_of
from ditron_ep.compiler.tp_plan import (AGGemmPlan, GemmARPlan, GemmRSPlan, lower_ag_gemm, lower_gemm_ar, lower_gemm_rs,
                                        planned_tile)
from ditron_ep.runtime import control as C
from ditron_ep.runtime.agreement import per_group
from ditron_ep.runtime.errors import DitronConfigError
from ditron_ep.runtime.fast_launch import capturing, fast
from ditron_ep.runtime.heap import SymmetricHeap

__all__ = ["OverlapHeap", "overlapped_all_gather_matmul", "overlapped_matmul_all_reduce",
           "overlapped_matmul_reduce_scatter"]

_AG_HEAPS: dict = {}
_RS_HEAPS: dict = {}
_AR_HEAPS: dict = {}


class OverlapHeap:
    """One process group's landing buffer ("tp/land", rows x cols) and signals for one overlapped op."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.heap: SymmetricHeap | None = None
        self.rows_cap = self.signals_cap = self.cols = 0
        self.dtype: torch.dtype | None = None

    def ensure(self, rows: int, cols: int, dtype: torch.dtype, signals: int, device: torch.device) -> None:
        """(Re)build the heap when this call does not fit (collective: every rank passes the same).
        Not under CUDA-graph capture: building a heap exchanges IPC handles and synchronises."""
        same = cols == self.cols and dtype == self.dtype
        if self.heap is not None and same and rows <= self.rows_cap and signals <= self.signals_cap:
            return
        if capturing(device):
            raise DitronConfigError(
                f"an overlapped TP op captured in a CUDA graph needs its symmetric heap built first ({rows} rows x "
                f"{cols} {str(dtype).removeprefix('torch.')} columns, {signals} signals this call; the group's heap "
                f"{'does not exist yet' if self.heap is None else 'is smaller or of another width or dtype'}): "
                "run the same op with the same shapes once eagerly (a warm-up) before capturing")
        if self.heap is not None:
            self.heap.free()
            self.heap = None
        rows_cap = max(rows, self.rows_cap if same else 0)
        signals_cap = max(signals, self.signals_cap if same else 0)
        data = C.align_up(rows_cap * cols * torch.empty((), dtype=dtype).element_size())
        size = C.align_up(C.CTRL_BYTES + 4 * signals_cap) + data
        self.heap = SymmetricHeap(self.group, size_bytes=size, num_signals=signals_cap,
                                  device=device if device.type == "cuda" else None)
        self.heap.alloc("tp/land", (rows_cap, cols), dtype)
        self.sig_first = self.heap.alloc_signals("tp/sig", signals_cap)
        self.rows_cap, self.signals_cap, self.cols, self.dtype = rows_cap, signals_cap, cols, dtype


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
    device_type = device_type_of(a.device)
    dtype = str(a.dtype).removeprefix("torch.")
    # this rank's own tile: the chunks are one row tile of the rule's on every rank, the columns
    # (its own N) are its own business
    plan = _plan(world, m, k, n, dtype, device_type,
                 (COMM_PROGRAMS if on_gpu else 0) if comm_programs is None else comm_programs,
                 planned_tile(dtype, device_type, world * m, k, n))
    cfg = plan.tile
    state = per_group(_AG_HEAPS, group, OverlapHeap)
    n_chunks = triton.cdiv(m, plan.chunk_rows)
    state.ensure(world * m, k, a.dtype, world * n_chunks, a.device)
    h = state.heap
    y = torch.empty((world * m, n), dtype=a.dtype, device=a.device)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if on_gpu else 1
    elt = a.element_size()
    fast(ag_gemm_kernel)[(programs,)](
        a.contiguous(), b, y, h.ptr_table, h.signal_table, h.offset_of("tp/land"), state.sig_first,
        m, k, n, h.rank, world, h.wait_budget, b.stride(0), b.stride(1), plan.comm_programs,
        CHUNK=plan.chunk_rows, BLOCK_C=min(triton.next_power_of_2(max(k, 16)), 4096 // elt),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, INPUT_PRECISION="ieee", **cfg.launch_options())
    check_unless_capturing(h)
    if return_gathered:
        return y, h.local_view("tp/land")[:world * m].clone()
    return y


@functools.lru_cache(maxsize=64)
def _plan(world: int, m: int, k: int, n: int, dtype: str, device_type: str, comm_programs: int,
          tile: tuple[GemmTileConfig, str]) -> AGGemmPlan:
    """The verified plan of this call's shape (compiler/tp_plan.py): its chunk size, role split and
    GEMM tile drive the launch."""
    return lower_ag_gemm(world, m, k, n, dtype, device_type, comm_programs=comm_programs, tile=tile)


def overlapped_matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                                     tile: tuple[GemmTileConfig, str]) -> torch.Tensor:
    """This rank's rows of sum_ranks a @ b in one launch (arguments already checked and agreed on
    every rank): gemm_rs_kernels.gemm_rs_kernel on a verified GemmRSPlan. tile: (tile, source),
    the same on every rank (functional.agreed_tile): the tiles are the signals' grid."""
    from ditron_ep.ops.tp.gemm_rs_kernels import gemm_rs_kernel

    m = a.shape[0] // dist.get_world_size(group)
    return _reducing_launch(gemm_rs_kernel, lower_gemm_rs, _RS_HEAPS, a, b, group, m, lambda world: world * m, tile)


def overlapped_matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                                 tile: tuple[GemmTileConfig, str]) -> torch.Tensor:
    """sum_ranks a @ b on every rank in one launch (arguments already checked and agreed on every
    rank): gemm_ar_kernels.gemm_ar_kernel on a verified GemmARPlan; tile as for GEMM+RS."""
    from ditron_ep.ops.tp.gemm_ar_kernels import gemm_ar_kernel

    m = a.shape[0]
    return _reducing_launch(gemm_ar_kernel, lower_gemm_ar, _AR_HEAPS, a, b, group, m, lambda world: (world + 1) * m,
                            tile)


def _reducing_launch(kernel, lower, heaps: dict, a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup | None,
                     m: int, landing_rows, tile: tuple[GemmTileConfig, str]) -> torch.Tensor:
    """y [m, N] of a reducing overlapped op (GEMM+RS, GEMM+AR): its verified plan, its group's heap
    (an fp32 landing buffer of landing_rows(W) rows and the plan's signals), one launch."""
    world = dist.get_world_size(group)
    k, n = a.shape[1], b.shape[1]
    on_gpu = a.device.type == "cuda"
    plan = _reducing_plan(lower, world, m, k, n, str(a.dtype).removeprefix("torch."),
                          device_type_of(a.device), tile)
    cfg = plan.tile
    state = per_group(heaps, group, OverlapHeap)
    state.ensure(landing_rows(world), n, torch.float32, plan.num_signals, a.device)
    h = state.heap
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    programs = torch.cuda.get_device_properties(a.device).multi_processor_count if on_gpu else 1
    fast(kernel)[(programs,)](
        a.contiguous(), b, y, h.ptr_table, h.signal_table, h.offset_of("tp/land"), state.sig_first,
        m, k, n, h.rank, world, h.wait_budget, b.stride(0), b.stride(1),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, INPUT_PRECISION="ieee", **cfg.launch_options())
    check_unless_capturing(h)
    return y


@functools.lru_cache(maxsize=128)
def _reducing_plan(lower, world: int, m: int, k: int, n: int, dtype: str, device_type: str,
                   tile: tuple[GemmTileConfig, str]) -> GemmRSPlan | GemmARPlan:
    return lower(world, m, k, n, dtype, device_type, tile=tile)


def check_unless_capturing(h: SymmetricHeap) -> None:
    """The launch's error slot read (a host sync), skipped under CUDA-graph capture: a replay's
    bounded-wait error stays in the slot and is raised by the next eager call on this heap."""
    if not capturing(h.device):
        h.check_error()


def free_heaps() -> None:
    """Free every group's heaps (collective on each group)."""
    for heaps in (_AG_HEAPS, _RS_HEAPS, _AR_HEAPS):
        for state in list(heaps.values()):
            if state.heap is not None:
                state.heap.free()
        heaps.clear()
