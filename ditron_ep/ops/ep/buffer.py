"""`EPBuffer`: owns the symmetric-heap resources of EP dispatch/combine; one method per primitive.

Layering: Triton kernels (ops/ep/*_kernels.py) -> launchers here (`_launch_*`) -> autograd
Functions -> `EPBuffer.dispatch` / `EPBuffer.combine` -> functional wrappers (ops/ep/functional.py).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton

from ditron_ep.compiler.core_config import SCALE_COLS
from ditron_ep.compiler.plan import is_nonnegative_int, is_positive_int
from ditron_ep.language import task_queue
from ditron_ep.ops.ep.combine_kernels import combine_sum_columns, ep_combine_kernel, topk_dots_kernel
from ditron_ep.ops.ep.dispatch_kernels import ep_dispatch_kernel
from ditron_ep.language.nvshmem import nvshmem_launcher
from ditron_ep.language.primitives import flagged_call_kernel
from ditron_ep.ops.ep.layout_kernels import (
    RECORD_FIELDS,
    RecvLayout,
    SendLayout,
    build_send_layout,
    exchange_layout,
    layout_landing_shape,
)
from ditron_ep.ops.ep.layout_replay import (
    CapturedLayout,
    Int32Arena,
    LayoutReplays,
    call_tokens,
    layout_arena_words,
    layout_rows,
    padded_routing,
)
from ditron_ep.runtime import control as C
from ditron_ep.runtime.agreement import RebuildNeeded, agree, call_error, differing, field_value, field_word
from ditron_ep.runtime.call_graphs import CallGraphCache, graph_capture
from ditron_ep.runtime.errors import DitronConfigError, DitronError, DitronTimeoutError
from ditron_ep.runtime.fast_launch import VARY, BoundLaunch, capturing, current_stream, fast
from ditron_ep.runtime.heap import SymmetricHeap
from ditron_ep.runtime.transport import kernel_signals, put_peer_mask, transport_problem
from ditron_ep.runtime.input_checks import FLOAT_DTYPES, INDEX_DTYPES, check_tensor, grad_needed

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H a multiple of 128) in FP8 dispatch's format: e4m3 [T, H] and fp32 scales
    [T, H / 128], each scale the block's amax / 448 (e4m3's largest value), at least 1e-4."""
    T, H = x.shape
    blocks = x.to(torch.float32).reshape(T, H // SCALE_COLS, SCALE_COLS)
    scales = (blocks.abs().amax(dim=2) / 448.0).clamp_min(1e-4)
    return (blocks / scales[:, :, None]).to(FP8).reshape(T, H), scales


class CapacityError(DitronError, ValueError):
    """Some rank has more tokens than `max_tokens_per_rank`; raised on every rank alike.

    needed: the largest T of any rank (a lower bound when `pending`); pending: the problem was
    recorded by an earlier graph-mode call (sync=False), whose tokens past the capacity were
    dropped, and is raised by this later call, which itself moved nothing yet."""

    def __init__(self, message: str, *, needed: int, pending: bool = False) -> None:
        super().__init__(message)
        self.needed = needed
        self.pending = pending


class RoutingError(DitronError, ValueError):
    """Some rank passed expert ids outside [-1, num_experts); raised on every rank alike."""


@dataclass
class DispatchHandle:
    """What `combine` (and the backward passes) need from a `dispatch`. Device tensors.

    num_recv_per_expert: int32 [E_local]      rows received per local expert
    expert_offsets:      int32 [E_local + 1]  first row of each local expert; [-1] = total rows
                         (graph mode: capped at the rows the call kept, `rows_cap`)
    num_rows:            host int (default mode) or None (graph mode: see expert_offsets[-1])
    recv_counts:         default mode: rows per local expert as host ints (read with num_rows:
                         no further sync), else None
    recv_weights:        fp32 [rows] routing weight of every row, if weights were dispatched
    row_index:           layout="token_major" only: int32 [rows], the recv_x row (token) of each
                         expert-major row: recv_x[row_index[:rows]] is the expert-major layout
    """

    buffer_id: int
    send: SendLayout
    recv: RecvLayout
    recv_rows: torch.Tensor    # int32 [W, MAXT, K] row of (source, slot, k), -1 if none
    recv_tok: torch.Tensor     # int32 [W, MAXT] source token of each staged token
    recv_weights: torch.Tensor | None
    num_tokens: int
    rows_cap: int
    num_rows: int | None
    sync: bool
    capped_offsets: torch.Tensor | None = None  # graph mode with max_recv_rows: offsets capped at rows_cap
    row_index: torch.Tensor | None = None  # token-major layout: int32 [rows_cap], the recv_x row of each pair
    token_rows: int | None = None          # token-major layout, default mode: rows of recv_x
    recv_scales: torch.Tensor | None = None  # FP8 dispatch: fp32 [recv_x rows, hidden / 128]
    weights_need_grad: bool = False        # the dispatched weights required grad (they get none through here)
    recv_counts: tuple[int, ...] | None = None  # default mode: num_recv_per_expert as host ints (no sync)

    # Views, not the layout's own tensors: a caller that keeps one (autograd saving it included)
    # holds the layout's memory, which a replayed copy's reuse checks (layout_replay.CapturedLayout.idle)
    @property
    def num_recv_per_expert(self) -> torch.Tensor:
        return self.recv.num_recv[:]

    @property
    def expert_offsets(self) -> torch.Tensor:
        return (self.recv.expert_off if self.capped_offsets is None else self.capped_offsets)[:]

    @property
    def grouped_mm_offs(self) -> torch.Tensor:
        """int32 [E_local] cumulative row ends: the `offs` argument of `torch._grouped_mm`."""
        return self.expert_offsets[1:]


def _argument_problem(world, num_experts, hidden, max_tokens, topk, dtype, block_rows, block_hidden,
                      num_warps, hidden_slices, num_programs, graph_cache, dispatch_dtype=None,
                      transport="auto", backend="auto") -> str | None:
    """What is wrong with EPBuffer's arguments on this rank (None: nothing)."""
    problem = transport_problem(transport, backend, world)
    if problem is not None:
        return problem
    if transport == "put" and dispatch_dtype == FP8:
        return "FP8 dispatch has no put transport yet; use transport='pointer' (or 'auto') with FP8 dispatch"
    for name, v in (("num_experts", num_experts), ("hidden", hidden), ("max_tokens_per_rank", max_tokens),
                    ("topk", topk)):
        if not is_positive_int(v):
            return f"{name} must be a positive int, got {v!r}"
    if num_experts % world:
        return f"num_experts={num_experts} is not a multiple of the world size {world}; choose E = k * {world}"
    if topk > num_experts:
        return f"topk={topk} exceeds num_experts={num_experts}"
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} unsupported; use one of {SUPPORTED_DTYPES}"
    if dispatch_dtype not in (None, dtype, FP8):
        return f"dispatch_dtype must be None (the buffer's dtype) or {FP8} (FP8 dispatch), got {dispatch_dtype!r}"
    if dispatch_dtype == FP8 and hidden % SCALE_COLS:
        return f"FP8 dispatch needs hidden to be a multiple of {SCALE_COLS} (one scale per {SCALE_COLS} columns), got {hidden}"
    if block_rows is not None and (not is_positive_int(block_rows) or block_rows & (block_rows - 1)):
        return f"block_rows must be a power of two (or None), got {block_rows!r}"
    # tile widths reach tl.arange, which takes powers of two only
    if block_hidden is not None and (not is_positive_int(block_hidden) or block_hidden & (block_hidden - 1)
                                     or block_hidden < 16):
        return f"block_hidden must be a power of two >= 16 (or None), got {block_hidden!r}"
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        return f"num_warps must be one of 1, 2, 4, 8, 16 (or None), got {num_warps!r}"
    if hidden_slices is not None and not is_positive_int(hidden_slices):
        return f"hidden_slices must be a positive int or None, got {hidden_slices!r}"
    if num_programs is not None and not is_positive_int(num_programs):
        return f"num_programs must be a positive int or None, got {num_programs!r}"
    if not is_nonnegative_int(graph_cache):
        return f"graph_cache must be an int >= 0 (0 disables it), got {graph_cache!r}"
    return None


def default_programs(device: torch.device) -> int:
    """The copy kernels' programs when num_programs is not given: every SM on a GPU, 2 on the CPU."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def _tuned_copy(group, world: int, num_experts: int, hidden: int, max_tokens: int, topk: int, dtype: torch.dtype,
                num_programs: int | None):
    """This rank's tuner-cache entry for the copy tiling of such a buffer (tuner.tuned_ep_copy), or None."""
    from ditron_ep.compiler.tuner import ep_copy_key, tuned_ep_copy

    on_gpu = dist.get_backend(group) == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return tuned_ep_copy(ep_copy_key(dtype, device, max_tokens=max_tokens, hidden=hidden, topk=topk,
                                     world_size=world, num_programs=num_programs or default_programs(device)))


class EPBuffer:
    """Expert-parallel dispatch and combine over a symmetric heap.

    Args:
        group: process group of the EP ranks (None = default group).
        num_experts: E, a multiple of the world size; rank r owns experts [r*E/W, (r+1)*E/W).
        hidden: H, the token width.
        max_tokens_per_rank: the most tokens any rank passes to one dispatch.
        topk: K, experts per token.
        dtype: token dtype (bf16, fp16 or fp32).
        num_programs: programs (SMs) dispatch/combine occupy; default: every SM on GPU, 2 on CPU.
        block_rows / block_hidden / num_warps: copy tile shape (rows per signalled chunk, columns
            per step) and warps per program. All three unset: the tuner's entry for this shape and
            num_programs when every rank's cache has the same one (`python -m ditron_ep tune --ep`,
            compiler/tuner.py; `tuned_copy` says which), else 16 rows, 2,048 bytes of columns
            and 16 warps on NVIDIA (8 on AMD, 4 on the CPU). Bits never depend on them.
        hidden_slices: column slices a chunk's copy is split into (one task each); default: enough
            for ~128 tasks when max_tokens_per_rank is small, else 1. Must match on every rank.
        check_errors: in the default (synchronising) mode, read the device error slot after each
            launch and raise DitronTimeoutError there (one extra device-to-host read). Calls
            under autograd (a forward recording a graph, every backward) skip that host sync:
            the slot is read once when the backward pass ends, so an error raises from
            `backward()` (a forward's, if no backward follows, from the next dispatch).
        dispatch_dtype: None (the tokens travel in `dtype`) or torch.float8_e4m3fn: FP8 dispatch
            (half the bytes of bf16): `dispatch(x_fp8, ..., x_scales=scales)` with DeepEP's format,
            fp32 scales [T, hidden / 128] (one per token and 128 columns); combine stays in `dtype`.
        graph_cache (CUDA, default mode): how many dispatch signatures (routing rows: T rounded
            up to a power of two from 16, at most max_tokens_per_rank, the rows past a call's routed
            nowhere (layout_replay.layout_rows); index dtype; the heap's wait budget) keep their
            layout launches as a CUDA graph, captured on
            a signature's second call and replayed after (ops/ep/layout_replay.py, runtime/call_graphs.py):
            the same kernels and arguments, so the same bits, for a replay and a copy of the
            routing instead of four launches and a dozen allocations (~190 µs of host time on a
            lent H200 host). A signature keeps up to 3 captured copies, each handed to one call at
            a time (its handle holds it; a clone of a shared copy when all are held). A buffer
            whose received rows at capacity fit 32 MiB (decode-sized: W * max_tokens_per_rank
            token rows token-major, K times as many expert-major) also replays those calls
            whole -- inputs copied in, layout and data kernel in one graph (`_whole_call`), as
            many more signatures; while its 3 copies are held a call launches as before. 0
            launches every call directly.
        transport (runtime/transport.py): how the dispatch's tokens reach each peer. "auto"
            (default) and "pointer": stores through the peer pointer table; "put" (backend
            "nvshmem"): NVSHMEM put-with-signal to every peer (the transport for peers without a
            load/store mapping; forced here on one node it checks that path), for the dispatch's
            tokens and the combine's rows (backward replays included). Same bits either way. The
            layout exchange and the call barriers use peer pointers on every transport.

    Every call reuses the buffer's heap and signals, so calls run in the order of the CUDA stream
    they are issued on: issue them on one stream (or order the streams yourself).
    """

    def __init__(self, group: dist.ProcessGroup | None, num_experts: int, hidden: int,
                 max_tokens_per_rank: int, topk: int, dtype: torch.dtype = torch.bfloat16, *,
                 backend: str = "auto", num_programs: int | None = None, block_rows: int | None = None,
                 block_hidden: int | None = None, num_warps: int | None = None,
                 hidden_slices: int | None = None, wait_budget: int | None = None,
                 check_errors: bool = True, graph_cache: int = 4, dispatch_dtype: torch.dtype | None = None,
                 transport: str = "auto") -> None:
        if not dist.is_initialized():
            raise DitronConfigError("EPBuffer needs torch.distributed initialised (init_process_group first)")
        world = dist.get_world_size(group)
        problem = _argument_problem(
            world, num_experts, hidden, max_tokens_per_rank, topk, dtype, block_rows, block_hidden, num_warps,
            hidden_slices, num_programs, graph_cache, dispatch_dtype, transport, backend)
        # The copy tiling left unset: the tuner's (compiler/tuner.py, tune_ep_copy) when this
        # rank's cache has an entry for the buffer; taken only if every rank found the same one.
        tuned = None
        if problem is None and block_rows is None and block_hidden is None and num_warps is None:
            try:
                tuned = _tuned_copy(group, world, num_experts, hidden, max_tokens_per_rank, topk,
                                    dispatch_dtype or dtype, num_programs)
            except ValueError as err:  # a malformed cache file: every rank raises below
                problem = str(err)
        # Every rank learns every rank's verdict before any heap collective: a rank that raised
        # alone would leave the others waiting in the heap's set-up.
        words = agree(group, "EPBuffer", problem, same={
            "num_experts": num_experts, "hidden": hidden, "max_tokens_per_rank": max_tokens_per_rank,
            "topk": topk, "dtype": dtype, "block_rows": block_rows, "dispatch_dtype": dispatch_dtype or dtype,
            "transport": transport}, value=tuned.word() if tuned else 0, every_value=True)
        self.tuned_copy = tuned if tuned is not None and len(set(words)) == 1 else None
        if self.tuned_copy is not None:
            block_rows, block_hidden, num_warps = (tuned.block_rows, tuned.block_hidden, tuned.num_warps)
        block_rows = block_rows or 16
        self._layouts: CallGraphCache[LayoutReplays] = CallGraphCache(graph_cache)
        # whole calls (`_whole_call`) of the layouts whose received rows at capacity fit WHOLE_CALL_BYTES
        row_bytes = hidden * max(torch.empty((), dtype=d).element_size() for d in (dtype, dispatch_dtype or dtype))
        self._whole_fits = {True: world * max_tokens_per_rank * row_bytes <= WHOLE_CALL_BYTES,  # token-major
                            False: world * max_tokens_per_rank * topk * row_bytes <= WHOLE_CALL_BYTES}
        self._calls: CallGraphCache[LayoutReplays] = CallGraphCache(graph_cache if self._whole_fits[True] else 0)
        self._padded_keys: set[tuple] = set()  # layout signatures whose kernels compiled on padded rows (`_layout`)
        self.num_experts, self.hidden, self.topk, self.dtype = num_experts, hidden, topk, dtype
        self.dispatch_dtype = dispatch_dtype or dtype
        self.fp8 = self.dispatch_dtype == FP8
        self.max_tokens = max_tokens_per_rank
        self.world_size = world
        self.num_local_experts = num_experts // world
        self.block_rows = block_rows
        self.n_chunks = triton.cdiv(max_tokens_per_rank, block_rows)
        self.check_errors = check_errors
        elt = torch.empty((), dtype=dtype).element_size()
        W, T, K, H = world, max_tokens_per_rank, topk, hidden
        self._specs = [  # (name, shape, dtype)
            ("ep/layout", layout_landing_shape(W, self.num_local_experts), torch.int32),
            # (FP8 dispatch stages 1-byte rows here, combine's backward replays dtype rows)
            ("ep/stage", (W, T, H), dtype),
            ("ep/meta", (W, T, 1 + 2 * K), torch.int32),
            ("ep/wstage", (W, T, K), torch.float32),
            # combine's landing buffer: (T, K, H) rows, or the rank-reduced combine's (W, T, H) partials
            ("ep/land", (T, max(K, W), H), dtype),
        ] + ([("ep/sstage", (W, T, H // SCALE_COLS), torch.float32)] if self.fp8 else []) + (
            # the put transport stages each destination's tokens and metadata (dispatch) and
            # rank-reduced partials (combine, fp32 or the dtype) here, symmetric, before putting them
            [("ep/send_x", (W, T, H), dtype), ("ep/send_meta", (W, T, 1 + 2 * K), torch.int32),
             ("ep/send_w", (W, T, K), torch.float32), ("ep/send_land", (W, T, H), torch.float32)]
            if transport == "put" else [])
        # Wider row tiles and more warps keep more bytes in flight per program: the copy loops are
        # latency-bound (a [16, 512] bf16 tile per step gave ~150 GB/s on 4xH200).
        self.block_hidden = block_hidden or min(2048 // elt, triton.next_power_of_2(H))
        self.n_slices, self.slice_cols = task_queue.hidden_slices(
            max_tokens_per_rank, W, block_rows, H, self.block_hidden, hidden_slices)
        # two column tiles per copy step where a slice has them (dispatch_kernels.load_cols)
        self._col_pairs = self.slice_cols > self.block_hidden
        sig_per_kernel = W * self.n_chunks * self.n_slices  # (rank, chunk, column slice)
        # with puts, the dispatch's and the combine's signals are uint64 words (put_signal_words)
        kernel_words = 2 * sig_per_kernel + 1 if transport == "put" else sig_per_kernel
        num_signals = W + 2 * kernel_words
        data = sum(C.align_up(_numel(s) * torch.empty((), dtype=d).element_size()) for _, s, d in self._specs)
        size = C.align_up(C.CTRL_BYTES + 4 * num_signals) + data
        self.heap = SymmetricHeap(group, backend=backend, size_bytes=size, num_signals=num_signals,
                                  wait_budget=wait_budget)
        for name, shape, dt in self._specs:
            self.heap.alloc(name, shape, dt)
        # Sender and receiver index signals and columns by the same tiling: it must agree everywhere
        # (the signal count alone does not show a different block_hidden).
        try:
            self.heap.check_same_everywhere(
                "EPBuffer copy tiling (block_rows, block_hidden, slices, columns per slice)",
                (block_rows, self.block_hidden, self.n_slices, self.slice_cols))
        except DitronConfigError:
            self.heap.free()
            raise
        self._sig_layout = self.heap.alloc_signals("ep/layout", W)
        # Device-level transport (runtime/transport.py): the peers dispatch and combine reach by put
        self._put_peers = put_peer_mask(self.heap, transport)
        self.transport = transport
        self._sig_dispatch = kernel_signals(self.heap, "ep/dispatch", sig_per_kernel, self._put_peers)
        self._sig_combine = kernel_signals(self.heap, "ep/combine", sig_per_kernel, self._put_peers)
        self.device = self.heap.device
        num_programs = self.num_programs = num_programs or default_programs(self.device)
        # Chunks a receive (reduce) trails the sends by: a group is W * slices sends plus as many
        # receives (dispatch) or plus `slices` reduces (combine).
        self._dispatch_lag = task_queue.default_lag(num_programs, 2 * W * self.n_slices)
        self._combine_lag = task_queue.default_lag(num_programs, (W + 1) * self.n_slices)
        # 16 warps on NVIDIA: twice the threads per program keep twice the loads in flight, and the
        # rank-reduced combine's fp32 row sums stop spilling. Same bits, on 2xH200 at T=4096 (graph
        # replays): rank-reduced combine 470 -> 253 µs at every SM, 1,824 -> 870 at 24 programs;
        # dispatch 293 -> 282 (801 -> 727 at 24); exact combine 756 -> 728 (1,707 -> 1,371)
        # (bench/results/ep_sm_budget_graph_H200x2_20261128_s29.log). AMD keeps 8 (not measured).
        if num_warps is None:
            num_warps = 4 if self.device.type != "cuda" else 8 if torch.version.hip else 16
        self.num_warps = num_warps
        self._block_w = triton.next_power_of_2(W)  # the copy kernels' BLOCK_W (reads every rank's src_info)
        # Graph-mode input problems (FLAG_* bits of any rank), raised by the next host-visible call.
        self._pending_flags = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._dummy_f32 = torch.zeros(1, dtype=torch.float32, device=self.device)  # for absent weight pointers
        self._dummy_i32 = torch.zeros(1, dtype=torch.int32, device=self.device)    # for an absent row_index
        self._elt = elt
        self._fields = record_fields(self.request(), self.device)  # the call record of every valid call
        # the data kernels' launches, bound per constexpr combination (_bind_dispatch, _bind_combine)
        self._dispatch_launches: dict[tuple, BoundLaunch] = {}
        self._combine_launches: dict[tuple, BoundLaunch] = {}

    def request(self) -> dict:
        """The request fields this buffer serves (a call record's shared arguments)."""
        return {"num_experts": self.num_experts, "hidden": self.hidden, "topk": self.topk, "dtype": self.dtype}

    @property
    def freed(self) -> bool:
        return self.heap.freed

    # ------------------------------------------------------------------ public API
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None,
                 *, sync: bool = True, max_recv_rows: int | None = None, layout: str = "expert_major",
                 x_scales: torch.Tensor | None = None, dequantize: bool = False) -> tuple[torch.Tensor, DispatchHandle]:
        """Send every token to the ranks of its experts; return the received rows and a handle.

        Args:
            x: [T, H] tokens of this rank (T <= max_tokens_per_rank; T may be 0), buffer dtype.
            topk_idx: [T, K] int32/int64 global expert ids, -1 = dropped slot.
            topk_weights: optional [T, K] float routing weights, carried to the receiver
                (`handle.recv_weights`); gradients w.r.t. weights flow through `combine`.
            sync: True (default): one device-to-host read; recv_x has exactly the received rows
                and bad input raises before any token moves. False (graph mode): no host sync;
                recv_x has capacity W * max_tokens * K rows, the valid extent is
                `handle.expert_offsets[-1]`, and bad input is recorded for the next sync call.
            max_recv_rows: graph mode only: the capacity of recv_x instead (the memory graph mode
                saves for the backward). Rows past it are dropped (expert_offsets stop there) and a
                CapacityError is recorded for the next sync call or `check()`.
            layout: "expert_major" (default): one row per (token, k) routed here, grouped by
                local expert. "token_major": one row per (token, rank) — each received token once,
                ordered by (source rank, source token) — and `handle.row_index`, the row of each
                (token, k) in expert-major order (what a grouped GEMM's gathered-A load reads);
                1/K of the expert-major layout's writes when a token's experts share a rank. In
                graph mode recv_x then has W * max_tokens rows (the valid ones first); in default
                mode its rows are the tokens received (without gradients: a view of a W *
                max_tokens-row allocation when they fill at least half of it, the kernel running
                before the host read). Gradients
                of a token's row return to the token (the ranks' rows added in rank order, fp32).
            x_scales: FP8 dispatch (a buffer built with dispatch_dtype=torch.float8_e4m3fn, x in
                e4m3): fp32 [T, hidden / 128], x[t, c] * x_scales[t, c // 128] is the token. They
                travel with the tokens; `handle.recv_scales` holds them per received row.
            dequantize: FP8 dispatch: return recv_x in the buffer's dtype instead, each element
                x * scale in fp32, cast once (no recv_scales).
        Returns:
            recv_x: expert_major: [rows, H], rows of local expert e at
                expert_offsets[e]:expert_offsets[e+1], ordered by (source rank, source token);
                token_major: [token rows, H] (see `layout`).
            handle: DispatchHandle for `combine` (whose y is expert-major in both layouts: one row
                per (token, k), e.g. `recv_x[handle.row_index]` through the experts).
        """
        self._check_alive()
        w = topk_weights
        if (max_recv_rows is not None or not self._tokens_pass(x, self.dispatch_dtype)
                or not self._routing_pass(x, topk_idx, w) or not self._scales_pass(x, x_scales, dequantize)
                or layout not in ("expert_major", "token_major")):
            try:  # the generic checks, which word the errors
                self._check_tokens(x, "x", dtype=self.dispatch_dtype)
                w = self._check_routing(x, topk_idx, topk_weights)
                self._check_scales(x, x_scales, dequantize)
                if max_recv_rows is not None and (sync or not is_positive_int(max_recv_rows)):
                    raise DitronConfigError(f"max_recv_rows={max_recv_rows!r}: give a positive int, with sync=False "
                                            f"only (default mode returns exactly the rows received)")
                if layout not in ("expert_major", "token_major"):
                    raise DitronConfigError(f"layout must be 'expert_major' or 'token_major', got {layout!r}")
            except DitronConfigError:
                self.join_flagged(C.FLAG_REFUSED, request_of(x, topk_idx, self.num_experts))
                raise
        token_major = layout == "token_major"
        if grad_needed(x) and x_scales is None:  # the weights' gradients flow through combine, not here
            return _Dispatch.apply(x, self, topk_idx, w, sync, max_recv_rows, token_major)
        # no autograd node: ~10 µs less host time
        return self._dispatch_raw(x, topk_idx, w, sync, max_recv_rows, token_major, x_scales, dequantize)

    def _check_scales(self, x: torch.Tensor, x_scales: object, dequantize: object) -> None:
        """FP8 dispatch's arguments (x itself is checked against dispatch_dtype)."""
        if not self.fp8:
            if x_scales is not None or dequantize:
                raise DitronConfigError("x_scales / dequantize are for FP8 dispatch: build the EPBuffer with "
                                        "dispatch_dtype=torch.float8_e4m3fn")
            return
        if x_scales is None:
            raise DitronConfigError(f"FP8 dispatch needs x_scales: fp32 [T, hidden / {SCALE_COLS}], one scale per "
                                    f"token and {SCALE_COLS} columns")
        check_tensor("x_scales", x_scales, shape=(("T", x.shape[0]), ("hidden / 128", self.hidden // SCALE_COLS)),
                     dtypes=(torch.float32,), device=self.device)
        if not isinstance(dequantize, bool):
            raise DitronConfigError(f"dequantize must be a bool, got {dequantize!r}")

    def combine(self, y: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None, *,
                topk_sum: str = "token_rank", partial_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Return expert outputs to their tokens: out[t] = sum_k w[t, k] * y(t, k).

        Args:
            y: [rows, H] expert outputs in `recv_x`'s row order (same rows as dispatch returned);
                with topk_sum="caller", one row per token row of a token-major dispatch's recv_x.
            handle: from `dispatch` on this buffer.
            topk_weights: [T, K] float weights; None = unweighted sum (weights already applied).
            topk_sum: where a token's K terms are added.
                "token_rank" (default, exact): every (token, k) row travels back and the token's
                rank adds the K terms in order k = 0..K-1 in fp32 and casts once.
                "expert_rank" (rank-reduced): each expert rank adds the terms of its own experts,
                k in order, in fp32, and sends one row per (token, rank) (1/K of the bytes when a
                token's experts share a rank); the token's rank adds those rows in rank order in
                fp32 and casts once. The weights are the ones given to `dispatch` (carried with the
                rows, `handle.recv_weights`), so topk_weights must be None here; a dispatch without
                weights gives the unweighted sum. Gradients flow to y (to learn the router's weights
                in this mode, scale y by `ops.dispatched_weights` and combine unweighted).
                "caller": the caller has added each token's terms on the expert rank: y holds one
                row per token row of a `layout="token_major"` dispatch (DeepEP's combine input);
                the token's rank adds those rows in rank order in fp32 and casts once, as in
                "expert_rank". topk_weights must be None. y's gradient of a row is the token's
                output gradient.
            partial_dtype: "expert_rank" only: the dtype of the per-rank sums on the wire: y's
                (default: a second rounding, of each rank's sum) or torch.float32 (no extra
                rounding; twice the bytes for bf16).
        Returns:
            out: [T, H] in y's dtype. Deterministic in both modes: a fixed summation order, no atomics.
        A rank that rejects its arguments still takes part in the call's entry barrier, flagged:
        no rank moves anything, and its peers raise DitronConfigError naming it (at once in
        default mode with check_errors outside autograd, at the end of the backward pass under
        it, else at the next call's status read or `check()`); so do
        ranks that pass different topk_sum or partial_dtype.
        """
        self._check_alive()
        try:
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != id(self):
                raise DitronConfigError("handle must come from dispatch() on this same EPBuffer")
            mode = self._combine_mode(topk_sum, partial_dtype, topk_weights, handle)
            rows = self._token_rows(handle) if mode & C.FLAG_MODE_TOKEN_ROWS else handle.rows_cap
            if not self._tokens_pass(y, self.dtype, rows):
                self._check_tokens(y, "y", rows=rows)
            w = topk_weights
            if w is not None and not self._weights_pass(w, handle.num_tokens):
                w = self._check_weights(topk_weights, handle.num_tokens)
        except DitronConfigError:
            self._refuse_combine()
            raise
        if grad_needed(y, w):
            return _Combine.apply(y, w, self, handle, mode)
        return self._combine_raw(y, handle, w, mode)

    def _combine_mode(self, topk_sum: object, partial_dtype: object, topk_weights: object,
                      handle: DispatchHandle) -> int:
        """combine's mode bits (control.MODE_FLAGS) for its keywords, or DitronConfigError."""
        if topk_sum not in ("token_rank", "expert_rank", "caller"):
            raise DitronConfigError(f"topk_sum must be 'token_rank' (the exact combine), 'expert_rank' (the "
                                    f"rank-reduced one) or 'caller' (y already holds one sum per token row), "
                                    f"got {topk_sum!r}")
        if topk_sum == "caller":
            if handle.row_index is None:
                raise DitronConfigError("topk_sum='caller' combines one row per received token: dispatch with "
                                        "layout='token_major' (this handle is expert-major)")
            if topk_weights is not None or partial_dtype is not None:
                raise DitronConfigError("topk_sum='caller': y's rows are already the sums, sent as they are: pass "
                                        "neither topk_weights nor partial_dtype")
            return C.FLAG_MODE_RANK_REDUCED | C.FLAG_MODE_TOKEN_ROWS
        if topk_sum == "token_rank":
            if partial_dtype is not None:
                raise DitronConfigError("partial_dtype applies to topk_sum='expert_rank' only (the exact combine sends "
                                        "y's rows as they are)")
            return 0
        if topk_weights is not None:
            raise DitronConfigError("topk_sum='expert_rank' applies the weights given to dispatch (the expert rank "
                                    "sums before anything returns): pass topk_weights to dispatch, and None here")
        if handle.weights_need_grad and torch.is_grad_enabled():
            raise DitronConfigError("the routing weights given to dispatch require grad, and topk_sum='expert_rank' "
                                    "cannot return their gradient (they were carried as data): use the default "
                                    "topk_sum='token_rank' with topk_weights=, or scale y by ops.dispatched_weights("
                                    "topk_weights, handle) and combine unweighted")
        if partial_dtype not in (None, self.dtype, torch.float32):
            raise DitronConfigError(f"partial_dtype must be None (y's dtype), {self.dtype} or torch.float32, got "
                                    f"{partial_dtype!r}")
        if partial_dtype == torch.float32 and self.dtype != torch.float32:
            if self.world_size * 4 > max(self.topk, self.world_size) * self._elt:
                raise DitronConfigError(
                    f"partial_dtype=torch.float32 needs {self.world_size} fp32 partials per token and column, more "
                    f"than this buffer's landing space ({max(self.topk, self.world_size)} {self.dtype} values at "
                    f"W={self.world_size}, topk={self.topk}); use partial_dtype=None")
            return C.FLAG_MODE_RANK_REDUCED | C.FLAG_MODE_FP32_PARTIALS
        return C.FLAG_MODE_RANK_REDUCED

    def _token_rows(self, handle: DispatchHandle) -> int:
        """Rows of a token-major dispatch's recv_x: the tokens received (default mode) or the
        capacity W * max_tokens (graph mode)."""
        return handle.token_rows if handle.token_rows is not None else self.world_size * self.max_tokens

    def check(self) -> None:
        """Raise a timeout or a stopped call recorded by any launch, then problems recorded by
        graph-mode dispatches (one host read each)."""
        self.heap.check_error()
        raise_pending_flags(self._pending_flags, self)

    def free(self) -> None:
        self._layouts.clear()  # the graphs point into the heap
        self._calls.clear()
        self._dispatch_launches.clear()  # (their arguments too)
        self._combine_launches.clear()
        self.heap.free()

    # ------------------------------------------------------------------ validation
    def _check_alive(self) -> None:
        if self.heap.freed:
            raise DitronConfigError("this EPBuffer was freed (free() was called); build a new EPBuffer")

    def join_flagged(self, flags: int, fields: dict | None, tokens: int = 0) -> None:
        """This rank cannot run its dispatch (its arguments failed: FLAG_REFUSED; its request
        needs another buffer: FLAG_REBUILD): join the call's counts exchange with no tokens and
        `flags` in its record, so every rank stops the call before anything moves and raises
        alike. FLAG_REBUILD reads the records back and raises here (RebuildNeeded on every rank
        when they all ask for the same buffer, else the error). Not inside a CUDA graph capture
        (the raise ends the capture, and nothing ran)."""
        if capturing(self.device):
            return
        recv = self._launch_layout(torch.empty((0, self.topk), dtype=torch.int32, device=self.device), flags=flags,
                                   fields=record_fields(fields, self.device), tokens=tokens)[1]
        if flags & C.FLAG_REBUILD:
            read_layout_status(self.heap, recv, self._pending_flags, self)

    def _refuse_combine(self) -> None:
        """This rank rejected its arguments to a combine its peers are entering: take part in the
        call's barrier, flagged (primitives.flagged_call_kernel). Not while a CUDA graph is
        captured (the raise ends the capture, and nothing ran)."""
        if not capturing(self.device):
            flagged_call_kernel[(1,)](self.heap.ptr_table, self.heap.rank, self.world_size, self.heap.wait_budget,
                                      C.FLAG_REFUSED)

    # The *_pass checks decide in a few operations that the generic checks below would pass: those
    # (which word the errors) took ~20 µs of an eager call's host time on a lent H200 host, where
    # at T=128 the GPU waits for the host. False: the generic checks run and raise.
    def _tokens_pass(self, x: object, dtype: torch.dtype, rows: int | None = None) -> bool:
        return (type(x) is torch.Tensor and x.dtype == dtype and x.dim() == 2 and x.shape[1] == self.hidden
                and (rows is None or x.shape[0] == rows) and x.device == self.device and x.is_contiguous())

    def _routing_pass(self, x: torch.Tensor, topk_idx: object, w: object) -> bool:
        return (type(topk_idx) is torch.Tensor and topk_idx.dtype in INDEX_DTYPES
                and topk_idx.shape == (x.shape[0], self.topk) and topk_idx.device == self.device
                and (w is None or self._weights_pass(w, x.shape[0])))

    def _scales_pass(self, x: torch.Tensor, x_scales: object, dequantize: object) -> bool:
        if not self.fp8:
            return x_scales is None and dequantize is False
        return (type(x_scales) is torch.Tensor and x_scales.dtype == torch.float32 and type(dequantize) is bool
                and x_scales.shape == (x.shape[0], self.hidden // SCALE_COLS) and x_scales.device == self.device
                and x_scales.is_contiguous())

    def _weights_pass(self, w: object, T: int) -> bool:
        return (type(w) is torch.Tensor and w.dtype in FLOAT_DTYPES and w.shape == (T, self.topk)
                and w.device == self.device)

    def _check_tokens(self, x: torch.Tensor, name: str, rows: int | None = None, dtype: torch.dtype | None = None) -> None:
        check_tensor(name, x, shape=(("rows", None), ("hidden", self.hidden)))
        if rows is not None and x.shape[0] != rows:
            raise DitronConfigError(f"{name} has {x.shape[0]} rows but dispatch produced {rows}; "
                                    f"pass expert outputs in recv_x's row order")
        dtype = dtype or self.dtype
        check_tensor(name, x, dtypes=(dtype,), device=self.device,
                     dtype_hint=f"cast it or build the EPBuffer with {'dispatch_' if dtype != self.dtype else ''}"
                                f"dtype={x.dtype}")

    def _check_routing(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor | None) -> torch.Tensor | None:
        T = x.shape[0]
        check_tensor("topk_idx", topk_idx, dtypes=INDEX_DTYPES, shape=(("T", T), ("topk", self.topk)),
                     device=self.device, contiguous=False)
        return None if topk_weights is None else self._check_weights(topk_weights, T)

    def _check_weights(self, w: torch.Tensor, T: int) -> torch.Tensor:
        return check_tensor("topk_weights", w, dtypes=FLOAT_DTYPES, shape=(("T", T), ("topk", self.topk)),
                            device=self.device, contiguous=False)

    # ------------------------------------------------------------------ launchers
    def _launch_layout(self, topk_idx: torch.Tensor, alloc: Int32Arena | None = None,
                       record_pending: bool = False, flags: int = 0, fields: torch.Tensor | None = None,
                       tokens: int | None = None) -> tuple[SendLayout, RecvLayout]:
        """The layout launches; record_pending (graph mode): the exchange also keeps every rank's
        input flags for the next host-visible call (no sync); flags, fields, tokens: this rank's
        call record when it joins flagged (`join_flagged`)."""
        send = build_send_layout(topk_idx, self.num_experts, self.world_size, self.max_tokens, alloc=alloc)
        if flags:
            send.flags.fill_(flags)
        recv = exchange_layout(self.heap, send, self.num_experts, "ep/layout", self._sig_layout,
                               self._fields if fields is None else fields, alloc=alloc, pending=self._pending_flags,
                               record_pending=record_pending, tokens=tokens)
        return send, recv

    def _layout(self, topk_idx: torch.Tensor, sync: bool
                ) -> tuple[SendLayout, RecvLayout, CapturedLayout | None, bool]:
        """This call's layout: in default mode replayed from a captured graph when the signature
        has one (`graph_cache`), else launched directly. Returns (send, recv, captured, lent):
        in default mode `_rows_from_status` reads the status (the host waits there, not here);
        lent: the layout is a captured copy's own (layout_replay.LayoutReplays), and so are its
        recv_rows / recv_tok.

        Graph mode never replays: capturing synchronises the device (torch.cuda.graph does), and
        graph mode promises no host sync; its callers capture their own graphs anyway."""
        T = topk_idx.shape[0]
        # Launched directly: a call over capacity (it only raises), and routing whose address is
        # not 16-byte aligned: the kernels compiled for it would not serve the aligned static
        # copy, which would then compile inside the capture.
        if (sync and self._layouts.capacity and T <= self.max_tokens and topk_idx.data_ptr() % 16 == 0
                and self._can_capture()):
            # one capture serves the calls of up to `rows` tokens (layout_replay.layout_rows)
            rows = layout_rows(T, self.max_tokens)
            key = (rows, topk_idx.dtype, self.heap.wait_budget)  # what the captured launches depend on
            replays = self._layouts.lookup_or_give_up(
                key, lambda: LayoutReplays(lambda lent: self._capture_layout(rows, topk_idx.dtype, lent)), "EPBuffer")
            ran = replays.replay(topk_idx) if replays is not None else None
            if ran is not None:
                return ran
            if rows != T and replays is None and key not in self._padded_keys:
                # a signature's first direct call runs on the capture's rows: the kernels a later
                # capture replays compile now, outside it (later direct calls need not)
                self._padded_keys.add(key)
                send, recv = self._launch_layout(padded_routing(topk_idx, rows))
                return call_tokens(send, T), recv, None, False
        send, recv = self._launch_layout(topk_idx, record_pending=not sync)
        return send, recv, None, False

    def _whole_call(self, x: torch.Tensor, topk_idx: torch.Tensor, w: torch.Tensor | None,
                    scales: torch.Tensor | None, dequantize: bool, token_major: bool
                    ) -> tuple[SendLayout, RecvLayout, CapturedLayout, bool] | None:
        """A default-mode call (not under autograd) replayed whole from one CUDA graph: its inputs
        copied into a captured copy's static ones, the layout launches, the status copy and the
        data kernel at capacity (as `_dispatch_raw`'s early token-major path launches it; the
        status is read, and the rows sliced, after it) in one replay. Returns
        `LayoutReplays.replay`'s tuple, the copy's `outputs` holding this call's rows, or None
        (launch as usual: a signature's first call, another device or a capture under way, an
        input whose address is not 16-byte aligned (its kernels, compiled by the first call, would
        not serve the aligned static copy, which would then compile inside the capture), or every
        copy held by live handles or rows).
        Why: at small T an eager call is host-bound, and the GPU idled between the layout and the
        data kernel while the host read the status (expert-major), allocated the outputs and
        launched it (~40-70 µs at T=128 on a lent H200 host). Only for layouts whose received rows
        at capacity (token-major W * max_tokens_per_rank, expert-major K times as many) fit
        WHOLE_CALL_BYTES: each copy keeps them, and a signature keeps up to 3 copies. The rows
        a call returns are that graph memory, lent until they and the handle are dropped: a
        consumer on another stream must have its work on them ordered before the next call on
        this stream once it drops them (`record_stream` does not cover graph memory)."""
        T = x.shape[0]
        # (a first call whose layout launched directly, not padded to the capture's rows (no layout
        # cache), would leave the layout kernels for those rows to compile inside the capture)
        if not (T <= self.max_tokens and self._layouts.capacity and self._can_capture()
                and all(t is None or t.data_ptr() % 16 == 0 for t in (x, topk_idx, w, scales))):
            return None
        rows = layout_rows(T, self.max_tokens)
        key = (rows, topk_idx.dtype, self.heap.wait_budget, w is not None, scales is not None, dequantize,
               token_major)
        replays = self._calls.lookup_or_give_up(
            key, lambda: LayoutReplays(lambda lent: self._capture_call(rows, key), shared=False), "EPBuffer")
        if replays is None:
            return None
        # detached: a copy from a tensor that requires grad would put the static copy in its graph
        return replays.replay(topk_idx, tuple(t.detach() if t.requires_grad else t for t in (x, w, scales)
                                              if t is not None))

    def _capture_call(self, rows: int, key: tuple) -> CapturedLayout:
        """Capture `_whole_call`'s signature `key` on `rows` token rows: a lent layout copy whose
        graph also copies nothing in (the replay does), then runs the data kernel on static inputs
        into static outputs at capacity."""
        _, idx_dtype, _, has_w, has_scales, dequantize, token_major = key
        W, T, K, H, dev = self.world_size, self.max_tokens, self.topk, self.hidden, self.device
        with torch.inference_mode(False):  # statics a later call outside inference mode can update
            c = self._layout_statics(rows, idx_dtype, lent=True)
            x = torch.empty((rows, H), dtype=self.dispatch_dtype, device=dev)
            w = torch.empty((rows, K), dtype=torch.float32, device=dev) if has_w else None
            scales = torch.empty((rows, H // SCALE_COLS), dtype=torch.float32, device=dev) if has_scales else None
            c.inputs = tuple(t for t in (x, w, scales) if t is not None)
            out_rows = W * T if token_major else W * T * K
            c.outputs = {
                "recv_x": torch.empty((out_rows, H), dtype=self.dtype if dequantize else self.dispatch_dtype,
                                      device=dev),
                "row_index": torch.empty(W * T * K, dtype=torch.int32, device=dev) if token_major else None,
                "recv_w": torch.empty(W * T * K, dtype=torch.float32, device=dev) if has_w else None,
                "recv_scales": (torch.empty((out_rows, H // SCALE_COLS), dtype=torch.float32, device=dev)
                                if has_scales and not dequantize else None)}
            o = c.outputs
            with graph_capture(c.graph):
                self._layout_launches(c)
                self._launch_dispatch(x, w, c.send, c.recv, W * T * K, False, o["recv_x"], o["recv_w"],
                                      c.recv_rows, c.recv_tok, after_layout=True, row_index=o["row_index"],
                                      scales=scales, recv_scales=o["recv_scales"], dequantize=dequantize)
        return c

    def _can_capture(self) -> bool:
        """CUDA graphs need a GPU, and a call inside the caller's own capture launches directly."""
        return self.device.type == "cuda" and not capturing(self.device)

    def _rows_from_status(self, recv: RecvLayout, captured: CapturedLayout | None) -> int:
        """Default mode's one host read (of the replay's pinned status, or of the directly
        launched layout): raises on any rank's input flags or a recorded timeout; else the rows."""
        return self._rows_and_tokens(recv, captured)[0]

    def _rows_and_tokens(self, recv: RecvLayout, captured: CapturedLayout | None, ahead: tuple | None = None
                         ) -> tuple[int, int, tuple[int, ...]]:
        """`_rows_from_status`, the tokens received (the token-major layout's rows) and the rows of
        each local expert, all from the same read; ahead: the words `_status_ahead` queued."""
        if captured is None and ahead is None:
            words = layout_status_words(self.heap, recv, self._pending_flags).tolist()
        else:
            host, ready = (captured.status, captured.ready) if ahead is None else ahead
            if ready is not None:
                ready.synchronize()
            words = host.tolist()
        W, E = self.world_size, self.num_local_experts
        return (raise_layout_status(words, self.heap, self._pending_flags, self), sum(words[-W:]),
                tuple(words[-W - E:-W]))

    def _status_ahead(self, recv: RecvLayout, captured: CapturedLayout | None) -> tuple:
        """(host words, event) of the layout's status, queued now so that the host read after later
        launches waits for the layout only: the captured copy's pinned words, else a pinned copy of
        the directly launched layout's (CUDA) or the words themselves (CPU: already there)."""
        if captured is not None:
            return captured.status, captured.ready
        words = layout_status_words(self.heap, recv, self._pending_flags)
        if not words.is_cuda:
            return words, None
        host = torch.empty(words.shape, dtype=words.dtype, pin_memory=True)
        host.copy_(words, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(current_stream())
        return host, ready

    def _capture_layout(self, rows: int, dtype: torch.dtype, lent: bool = False) -> CapturedLayout:
        """Capture a default-mode signature's layout launches on `rows` routing rows of `dtype`
        (see `_layout`); lent: a copy handed to calls (layout_replay.LayoutReplays), which holds
        their recv_rows / recv_tok too."""
        with torch.inference_mode(False):  # statics a later call outside inference mode can update
            c = self._layout_statics(rows, dtype, lent)
            with graph_capture(c.graph):
                self._layout_launches(c)
        return c

    def _layout_statics(self, T: int, dtype: torch.dtype, lent: bool = False) -> CapturedLayout:
        """The static tensors a captured layout of T routing rows reads and writes (nothing launched yet)."""
        W, cuda = self.world_size, self.device.type == "cuda"
        rows = (W, self.max_tokens, self.topk)
        return CapturedLayout(
            topk_idx=torch.empty((T, self.topk), dtype=dtype, device=self.device),
            graph=torch.cuda.CUDAGraph() if cuda else None,
            arena=Int32Arena(layout_arena_words(T, self.topk, self.num_experts, W, self.max_tokens), self.device),
            status=torch.empty(layout_status_numel(W, self.num_local_experts), dtype=torch.int32, pin_memory=cuda),
            ready=torch.cuda.Event() if cuda else None,
            recv_rows=torch.empty(rows, dtype=torch.int32, device=self.device) if lent else None,
            recv_tok=torch.empty(rows[:2], dtype=torch.int32, device=self.device) if lent else None)

    def _layout_launches(self, c: CapturedLayout) -> None:
        """What a captured layout graph runs: the layout launches on c's static routing into c's
        arena (setting c.send, c.recv), then the copy of the status words into c's pinned buffer."""
        c.arena.used = 0
        c.send, c.recv = self._launch_layout(c.topk_idx, alloc=c.arena)
        c.status.copy_(layout_status_words(self.heap, c.recv, self._pending_flags), non_blocking=True)

    def _launch_dispatch(self, x: torch.Tensor, w: torch.Tensor | None, send: SendLayout, recv: RecvLayout,
                         rows_cap: int, scale_rows: bool, recv_x: torch.Tensor,
                         recv_w: torch.Tensor | None, recv_rows: torch.Tensor, recv_tok: torch.Tensor, *,
                         after_layout: bool, row_index: torch.Tensor | None = None,
                         scales: torch.Tensor | None = None, recv_scales: torch.Tensor | None = None,
                         dequantize: bool = False) -> None:
        """The data kernel. after_layout: this call's counts exchange ran right before on this
        stream, and stands in for the kernel's entry barrier (primitives.call_begin says why);
        False for a replay along an old handle (combine's backward)."""
        dummy_f = self._dummy_f32
        consts = (w is not None, scale_rows, not after_layout, row_index is not None, scales is not None, dequantize,
                  self.heap.wait_budget)  # (the budget may be changed on a live buffer)
        launch = self._dispatch_launches.get(consts)
        if launch is None:
            launch = self._dispatch_launches[consts] = self._bind_dispatch(*consts)
        launch(x, w if w is not None else dummy_f, send.topk_idx, send.pos, send.send_idx, send.tokens_to,
               recv.expert_off, recv.src_off, recv.tokens_from, recv.src_info, recv_x,
               recv_w if recv_w is not None else dummy_f, recv_rows, recv_tok,
               row_index if row_index is not None else self._dummy_i32,
               scales if scales is not None else dummy_f, recv_scales if recv_scales is not None else dummy_f, rows_cap)

    def _bind_dispatch(self, has_weights: bool, scale_rows: bool, entry_barrier: bool, token_major: bool,
                       has_scales: bool, dequantize: bool, budget: int) -> BoundLaunch:
        """The data kernel's launch with this buffer's fixed arguments bound (fast_launch.BoundLaunch):
        the VARY places are the call's tensors and rows_cap, in `_launch_dispatch`'s order."""
        h = self.heap
        puts = self._put_peers != 0
        return (nvshmem_launcher if puts else fast)(ep_dispatch_kernel).bind((self.num_programs,), (
            *[VARY] * 17, h.ptr_table, h.signal_table, h.offset_of("ep/stage"), h.offset_of("ep/meta"),
            h.offset_of("ep/wstage"), h.offset_of("ep/sstage") if self.fp8 else 0, self._sig_dispatch,
            self.hidden, h.rank, self.world_size, self.num_local_experts, self.max_tokens, self.n_chunks, VARY,
            budget, self.n_slices, self.slice_cols, self._dispatch_lag, self.hidden // SCALE_COLS,
            self._put_peers, *(h.offset_of(f"ep/send_{a}") if puts else 0 for a in ("x", "meta", "w"))),
            K=self.topk, HAS_WEIGHTS=has_weights, SCALE_ROWS=scale_rows, BLOCK_S=self.block_rows,
            BLOCK_H=self.block_hidden, BLOCK_W=self._block_w, ENTRY_BARRIER=entry_barrier,
            TOKEN_MAJOR=token_major, HAS_SCALES=has_scales, DEQUANT=dequantize, PUTS=puts,
            COL_PAIRS=self._col_pairs, num_warps=self.num_warps)

    def _launch_combine(self, y: torch.Tensor, w: torch.Tensor | None, handle: DispatchHandle,
                        mode: int = 0, land_own: bool = False) -> torch.Tensor:
        """The combine kernel; mode: control.MODE_FLAGS bits (0: exact; rank-reduced weighs the
        rows by handle.recv_weights when the dispatch carried weights); land_own: this rank's own
        rows land too (`_landed` reads them), else the reduce reads them from y."""
        T = handle.num_tokens
        reduced = bool(mode & C.FLAG_MODE_RANK_REDUCED)
        row_w = handle.recv_weights if reduced and not (mode & C.FLAG_MODE_TOKEN_ROWS) else None
        out = torch.empty((T, self.hidden), dtype=y.dtype, device=y.device)
        consts = (mode, land_own, (row_w if reduced else w) is not None, row_w is not None, self.heap.wait_budget)
        launch = self._combine_launches.get(consts)
        if launch is None:
            launch = self._combine_launches[consts] = self._bind_combine(*consts)
        launch(y, handle.recv_rows, handle.recv_tok, handle.recv.tokens_from, handle.recv.src_info, handle.send.slot,
               handle.send.topk_idx, w if w is not None else self._dummy_f32,
               row_w if row_w is not None else self._dummy_f32, out, T)
        return out

    def _bind_combine(self, mode: int, land_own: bool, has_weights: bool, row_weights: bool,
                      budget: int) -> BoundLaunch:
        """The combine kernel's launch with this buffer's fixed arguments bound (fast_launch.BoundLaunch):
        the VARY places are the call's tensors and T, in `_launch_combine`'s order."""
        h = self.heap
        puts = self._put_peers != 0
        return (nvshmem_launcher if puts else fast)(ep_combine_kernel).bind((self.num_programs,), (
            *[VARY] * 10, h.ptr_table, h.signal_table, h.offset_of("ep/land"), self._sig_combine, VARY, self.hidden,
            h.rank, self.world_size, self.max_tokens, self.n_chunks, budget, self.n_slices,
            self.slice_cols, self._combine_lag, mode, self._put_peers, h.offset_of("ep/send_land") if puts else 0),
            K=self.topk, HAS_WEIGHTS=has_weights, BLOCK_S=self.block_rows,
            BLOCK_T=self.block_rows, BLOCK_H=self.block_hidden, BLOCK_W=self._block_w,
            BLOCK_HA=combine_sum_columns(self.block_hidden, self.block_rows, row_weights),
            RANK_REDUCED=bool(mode & C.FLAG_MODE_RANK_REDUCED), PARTIAL_FP32=bool(mode & C.FLAG_MODE_FP32_PARTIALS),
            TOKEN_ROWS=bool(mode & C.FLAG_MODE_TOKEN_ROWS), PUTS=puts, LAND_OWN=land_own, COL_PAIRS=self._col_pairs,
            num_warps=self.num_warps)

    def _finish(self, sync: bool, under_autograd: bool = False) -> None:
        """After a launch in default mode with check_errors: read the error slot, or for a call
        under autograd (a forward that records a graph, any backward) read it once at the end of
        the backward pass instead (heap.check_error_later)."""
        if sync and self.check_errors:
            if under_autograd:
                self.heap.check_error_later()
            else:
                self.heap.check_error()

    # ------------------------------------------------------------------ raw passes (no autograd)
    def _dispatch_raw(self, x: torch.Tensor, topk_idx: torch.Tensor, w: torch.Tensor | None, sync: bool,
                      max_recv_rows: int | None = None, token_major: bool = False, scales: torch.Tensor | None = None,
                      dequantize: bool = False, under_autograd: bool = False) -> tuple[torch.Tensor, DispatchHandle]:
        W, T, K = self.world_size, self.max_tokens, self.topk
        # Token-major default mode launches the data kernel before the host read, at capacity
        # (W * max_tokens token rows: the staging area's size), and slices after it: the GPU goes
        # from the layout straight into the kernel, where waiting for the host read, then for the
        # launch, left it idle (~200 µs of an eager T=4096 call). A call that does not go moves
        # nothing (its layout has no rows) and raises at the read as before. Not under autograd:
        # training keeps recv_x for the backward, and a view of the capacity would hold up to
        # W * max_tokens rows per layer (at W=8 uniform top-8 ~1.5x the rows received).
        early = sync and token_major and not under_autograd
        # a small buffer's whole call may replay from one CUDA graph (`_whole_call`)
        # (with check_errors: its recv_rows / recv_tok are lent as they are, as `_layout`'s copies
        # lend theirs; without, a timed-out call must leave -1 "no row" there for a combine)
        whole = (self._whole_call(x, topk_idx, w, scales, dequantize, token_major)
                 if sync and self.check_errors and not under_autograd and self._calls.capacity
                 and self._whole_fits[token_major] else None)
        if whole is not None:
            send, recv, captured, _lent = whole
            recv_x, row_index, recv_w, recv_scales = (captured.outputs[n] for n in _CALL_OUTPUTS)
            recv_rows, recv_tok = captured.recv_rows, captured.recv_tok
            rows_cap, num_rows, capped, token_rows, recv_counts = W * T * K, None, None, None, None
            ahead = (captured.status, captured.ready)
        else:
            send, recv, captured, lent = self._layout(topk_idx, sync)
            # The kernel writes every entry a combine reads (each received token's K rows, -1 for a
            # k routed elsewhere), unless a wait times out. A timeout raises in this call when the
            # call reads the error slot (sync and check_errors, not under autograd): then no combine
            # sees these, and two fill launches are saved. Otherwise -1 = "no row", so that a combine
            # after a timed-out call gathers through no garbage index (a timed-out column slice may
            # still leave its columns of recv_x unwritten; the timeout is raised by the next
            # host-visible read, and this rank's next launches refuse all work until then).
            if sync and self.check_errors and not under_autograd:
                if lent:  # the captured copy's, handed out with its layout
                    recv_rows, recv_tok = captured.recv_rows, captured.recv_tok
                else:
                    recv_rows = torch.empty((W, T, K), dtype=torch.int32, device=self.device)
                    recv_tok = torch.empty((W, T), dtype=torch.int32, device=self.device)
            else:
                recv_rows = torch.full((W, T, K), -1, dtype=torch.int32, device=self.device)
                recv_tok = torch.zeros((W, T), dtype=torch.int32, device=self.device)
            capped = token_rows = recv_counts = ahead = None
            if early:
                ahead = self._status_ahead(recv, captured)
            if sync and not early:
                num_rows, token_rows, recv_counts = self._rows_and_tokens(recv, captured)
                rows_cap = num_rows
            else:  # read after the kernel (early), or never (graph mode)
                rows_cap, num_rows = W * T * K, None
                if max_recv_rows is not None and max_recv_rows < rows_cap:  # graph mode only (dispatch checks)
                    # the kernel drops rows past the cap, so every expert's rows stop there too; an
                    # overflow is recorded for the next host-visible call (device ops, no sync)
                    rows_cap = max_recv_rows
                    capped = recv.expert_off.clamp(max=rows_cap)
                    over = (recv.expert_off[-1:] > rows_cap).to(torch.int32) * C.FLAG_TOO_MANY_ROWS
                    self._pending_flags.bitwise_or_(over)
            row_index = recv_scales = None
            out_rows = (W * T if early or not sync else token_rows) if token_major else rows_cap
            recv_x = torch.empty((out_rows, self.hidden), dtype=self.dtype if dequantize else self.dispatch_dtype,
                                 device=self.device)
            if token_major:
                # graph mode: rows past the received ones read token row 0 (their y rows are zero)
                row_index = (torch.empty if sync else torch.zeros)(rows_cap, dtype=torch.int32, device=self.device)
            if scales is not None and not dequantize:
                recv_scales = torch.empty((out_rows, self.hidden // SCALE_COLS), dtype=torch.float32,
                                          device=self.device)
            # graph mode: the rows past the received ones weigh 0 (a rank-reduced backward scales by them)
            recv_w = (torch.empty if sync else torch.zeros)(rows_cap, dtype=torch.float32, device=self.device) \
                if w is not None else None
            w32 = _fp32_weights(w)
            self._launch_dispatch(x, w32, send, recv, rows_cap, False, recv_x, recv_w, recv_rows, recv_tok,
                                  after_layout=True, row_index=row_index, scales=scales, recv_scales=recv_scales,
                                  dequantize=dequantize)
        kernel_words = None
        if early or whole is not None:  # the kernel ran at capacity: read, then slice
            if self.check_errors and self.device.type == "cuda":
                # one wait for the layout's status and the kernel's error words, not one each
                kernel_words = self.heap.host_words()
            num_rows, token_rows, recv_counts = self._rows_and_tokens(recv, captured, ahead)
            rows_cap = num_rows
            out_rows = token_rows if token_major else num_rows
            recv_x = _rows_of(recv_x, out_rows)
            row_index = None if row_index is None else row_index[:num_rows]
            recv_w = None if recv_w is None else recv_w[:num_rows]
            recv_scales = None if recv_scales is None else _rows_of(recv_scales, out_rows)
        if kernel_words is not None:
            self.heap.check_error(kernel_words)
        else:
            self._finish(sync, under_autograd)
        handle = DispatchHandle(id(self), send, recv, recv_rows, recv_tok, recv_w, x.shape[0], rows_cap,
                                num_rows, sync, capped, row_index, token_rows, recv_scales,
                                w is not None and w.requires_grad and torch.is_grad_enabled(), recv_counts)
        return recv_x, handle

    def _combine_raw(self, y: torch.Tensor, handle: DispatchHandle, w: torch.Tensor | None,
                     mode: int = 0, under_autograd: bool = False, land_own: bool = False) -> torch.Tensor:
        w32 = _fp32_weights(w)
        out = self._launch_combine(y.contiguous(), w32, handle, mode, land_own)
        self._finish(handle.sync, under_autograd)
        return out

    def _dispatch_replay(self, g: torch.Tensor, handle: DispatchHandle, w: torch.Tensor | None,
                         token_rows: bool = False) -> torch.Tensor:
        """Dispatch `g` [T, H] along an existing handle (rows scaled by w): combine's backward;
        token_rows: into a token-major handle's token rows (the backward of topk_sum="caller")."""
        # default mode: the kernel writes every one of the handle's rows (a timeout raises at the end
        # of the backward pass), so no memset of them (470 MB at T=4096, H=7168, top-8); graph mode:
        # the rows past the received ones must be zero
        rows = self._token_rows(handle) if token_rows else handle.rows_cap
        grad = (torch.empty if handle.sync else torch.zeros)((rows, self.hidden), dtype=g.dtype, device=g.device)
        # the kernel also writes each pair's token row (what handle.row_index holds): into scratch
        row_index = torch.empty(handle.rows_cap, dtype=torch.int32, device=g.device) if token_rows else None
        recv_w = torch.empty(handle.rows_cap, dtype=torch.float32, device=g.device) if w is not None else None
        recv_rows = torch.empty_like(handle.recv_rows)
        recv_tok = torch.empty_like(handle.recv_tok)
        w32 = _fp32_weights(w)
        self._launch_dispatch(g.contiguous(), w32, handle.send, handle.recv, handle.rows_cap, w is not None,
                              grad, recv_w, recv_rows, recv_tok, after_layout=False, row_index=row_index)
        self._finish(handle.sync, under_autograd=True)  # combine's backward only
        return grad

    def _landed(self, num_tokens: int) -> torch.Tensor:
        """Copy of combine's landing buffer [T, K, H]: y(t, k) for the weights' gradient."""
        K, H = self.topk, self.hidden
        return self.heap.local_view("ep/land").view(-1)[:num_tokens * K * H].view(num_tokens, K, H).clone()


# The most bytes of received rows at capacity (token-major W * max_tokens_per_rank rows,
# expert-major K times as many) for which a buffer replays whole calls of that layout from CUDA
# graphs (`EPBuffer._whole_call`): each captured copy keeps its own. A decode-sized buffer (128
# tokens, H=7168, bf16) holds 14.7 MB of token rows at W=8, 29 MB of top-8 expert rows at W=2.
WHOLE_CALL_BYTES = 32 << 20
# a whole call's outputs, in the order `_dispatch_raw` takes them
_CALL_OUTPUTS = ("recv_x", "row_index", "recv_w", "recv_scales")


def request_of(x: object, topk_idx: object, num_experts: int) -> dict | None:
    """The request fields of a dispatch's arguments (None when x or topk_idx is not a 2-D tensor)."""
    if not (isinstance(x, torch.Tensor) and x.ndim == 2 and isinstance(topk_idx, torch.Tensor) and topk_idx.ndim == 2):
        return None
    return {"num_experts": num_experts, "hidden": x.shape[1], "topk": topk_idx.shape[1], "dtype": x.dtype}


def record_fields(fields: dict | None, device: torch.device) -> torch.Tensor:
    """A request's fields as the int32 words of a call record."""
    words = [field_word(v) for v in (fields or {}).values()]
    return torch.tensor(words + [0] * (RECORD_FIELDS - len(words)), dtype=torch.int32, device=device)


def _decode(words: list[int], like: dict) -> dict:
    """Record words back into request fields named as `like` (this object's request)."""
    return {n: field_value(w, v) for (n, v), w in zip(like.items(), words)}


def raise_records(src_info: list[list[int]], records: list[list[int]], me: int, owner) -> None:
    """Raise what this call's records (every rank's (flags, T) and (call, fields...)) hold, the
    same error on every rank: out of step, a refusal, a rebuild (RebuildNeeded or differing
    fields), too many tokens, bad expert ids. `owner`: the EPBuffer / FusedMoE (its request
    names the fields; num_experts, max_tokens)."""
    flags = [f for f, _ in src_info]
    any_flags = functools.reduce(operator.or_, flags, 0)
    if not any_flags:
        return
    calls = {r: rec[0] for r, rec in enumerate(records)}
    fields = {r: (_decode(rec[2:], owner.request()) if any(rec[2:]) else None) for r, rec in enumerate(records)}
    for bits in (C.FLAG_OUT_OF_STEP | C.FLAG_GAVE_UP, C.FLAG_UNREAD, C.FLAG_REFUSED):
        ranks = [r for r, f in enumerate(flags) if f & bits]
        if ranks:
            raise call_error(any_flags & bits, ranks, me, calls[me], calls, fields)
    if any_flags & C.FLAG_REBUILD:
        differ = differing(fields)
        if differ:
            raise DitronConfigError(f"every rank must pass the same arguments to this call: {differ}")
        raise RebuildNeeded(fields[0], max(rec[1] for rec in records))
    raise_input_flags(any_flags, src_info, owner.num_experts, owner.max_tokens)


def raise_input_flags(flags: int, info: list[list[int]] | None, num_experts: int, max_tokens: int) -> None:
    """Raise the input problem in `flags` (FLAG_TOO_MANY_TOKENS first, then FLAG_BAD_EXPERT).
    info: (flags, T) of every rank in this call; None for flags an earlier graph-mode call
    recorded (it moved its tokens, the offending ones dropped)."""
    who = "" if info is None else " (ranks " + ", ".join(str(r) for r, (f, _) in enumerate(info) if f & flags) + ")"
    moved = ("no token was moved" if info is not None else
             "recorded by an earlier graph-mode call (sync=False), which dropped the offending tokens or slots")
    if flags & C.FLAG_TOO_MANY_TOKENS:
        needed = max(t for _, t in info) if info is not None else max_tokens + 1
        raise CapacityError(
            f"a rank passed more tokens than max_tokens_per_rank={max_tokens}{who}: needed "
            f"{needed if info is not None else f'more than {max_tokens}'}; build the buffer with a larger "
            f"max_tokens_per_rank ({moved})", needed=needed, pending=info is None)
    if flags & C.FLAG_TOO_MANY_ROWS:
        raise CapacityError("a graph-mode dispatch (sync=False) received more rows than its max_recv_rows; the rows "
                            "past it were dropped (raise max_recv_rows, or leave it None for the full capacity)",
                            needed=max_tokens + 1, pending=True)
    if flags & C.FLAG_BAD_EXPERT:
        raise RoutingError(f"topk_idx holds expert ids outside [-1, {num_experts}){who}; "
                           f"fix the router output ({moved})")


# Of several problems recorded by graph-mode calls, the first in this order is raised first.
_PENDING_ORDER = (C.FLAG_MISSING, C.FLAG_OUT_OF_STEP | C.FLAG_GAVE_UP, C.FLAG_UNREAD | C.FLAG_REFUSED | C.FLAG_REBUILD,
                  C.FLAG_TOO_MANY_TOKENS, C.FLAG_TOO_MANY_ROWS, C.FLAG_BAD_EXPERT)


def raise_pending_flags(pending_flags: torch.Tensor, owner, flags: int | None = None) -> None:
    """Raise problems recorded by graph-mode calls (one host read, unless `flags` holds that
    read already), one kind at a time in _PENDING_ORDER; the others stay recorded for the next
    check."""
    flags = int(pending_flags.item()) if flags is None else flags
    first = next((bits & flags for bits in _PENDING_ORDER if bits & flags), 0)
    if not first:
        return
    pending_flags.fill_(flags & ~first)
    if first & C.FLAG_MISSING:
        raise DitronTimeoutError("an earlier graph-mode call (sync=False) timed out waiting for a peer that did not "
                                 "arrive: its output is empty (no rows)", stage="counts exchange")
    if first & C.STOP_FLAGS:
        raise DitronConfigError("an earlier graph-mode call (sync=False) did not run on any rank: a rank was out "
                                "of step, rejected its own arguments or asked for another buffer; its output is "
                                "empty (no rows)")
    raise_input_flags(first, None, owner.num_experts, owner.max_tokens)


def layout_status_words(heap: SymmetricHeap, recv: RecvLayout, pending_flags: torch.Tensor) -> torch.Tensor:
    """The words default mode reads on the host, as one device tensor (no sync): total rows,
    flags pending from graph-mode calls, the heap's error words, every rank's (flags, T) and
    (call, fields), the rows of each local expert, and last the tokens each source sends here."""
    return torch.cat([recv.expert_off[-1:], pending_flags, heap.error_words, recv.src_info.reshape(-1),
                      recv.records.reshape(-1), recv.num_recv, recv.tokens_from])


def layout_status_numel(world_size: int, num_local_experts: int) -> int:
    """How many int32 words `layout_status_words` returns."""
    return 2 + C.HOST_WORDS - C.ERR_FLAG + (5 + RECORD_FIELDS) * world_size + num_local_experts


def raise_layout_status(words: list[int], heap: SymmetricHeap, pending_flags: torch.Tensor, owner) -> int:
    """Raise on what `layout_status_words` read (an error a launch recorded, problems pending
    from graph-mode calls, this call's records); else return the total rows."""
    W = heap.world_size
    total, pending, err = words[0], words[1], words[2:2 + C.HOST_WORDS - C.ERR_FLAG]
    if err[0] or err[C.FAIL_CALL - C.ERR_FLAG]:
        heap.check_error()
    at = 2 + C.HOST_WORDS - C.ERR_FLAG
    if not (pending or any(words[at:at + 2 * W:2])):  # no rank flagged anything: the common call
        return total
    info = [words[at + 2 * r: at + 2 * r + 2] for r in range(W)]
    at += 2 * W
    n = 2 + RECORD_FIELDS
    records = [words[at + n * r: at + n * (r + 1)] for r in range(W)]
    raise_pending_flags(pending_flags, owner, flags=pending)
    raise_records(info, records, heap.rank, owner)
    return total


def read_layout_status(heap: SymmetricHeap, recv: RecvLayout, pending_flags: torch.Tensor, owner) -> int:
    """The one device-to-host read of default mode (see `raise_layout_status`)."""
    return raise_layout_status(layout_status_words(heap, recv, pending_flags).tolist(), heap, pending_flags, owner)


def _fp32_weights(w: torch.Tensor | None) -> torch.Tensor | None:
    """The routing weights as the kernels read them: fp32, contiguous, outside autograd (w itself
    when it already is: three no-op tensor calls cost ~5 µs of an eager call's host time)."""
    if w is None or (w.dtype == torch.float32 and not w.requires_grad and w.is_contiguous()):
        return w
    return w.detach().to(torch.float32).contiguous()


def _rows_of(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows of a tensor allocated at capacity: a view when they fill at least half
    of it, else a compact copy, so a caller that keeps the result (autograd saves it) does not hold
    a mostly unused capacity allocation (a T=128 call into a buffer for 4,096 tokens)."""
    return t[:rows] if 2 * rows >= t.shape[0] else t[:rows].clone()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def topk_dots(g: torch.Tensor, y: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """fp32 [T, K]: <g[t], y[t, k]> (0 where topk_idx[t, k] < 0), g [T, H], y [T, K, H]
    contiguous: the combine's weight gradient in one pass over y in its dtype (an einsum in fp32
    made an fp32 copy of y first: 2x its bytes more memory and ~1 ms a layer at T=4096, H=7168)."""
    T, K, H = y.shape
    out = torch.empty((T, K), dtype=torch.float32, device=y.device)
    if T:
        block_t = 4
        fast(topk_dots_kernel)[(triton.cdiv(T, block_t),)](
            g, y, topk_idx, out, T, H, K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_T=block_t,
            BLOCK_H=min(256, triton.next_power_of_2(H)))
    return out


def _alive_for_backward(buffer: EPBuffer) -> None:
    """A backward needs the buffer its forward used (the handle's layout lives in it)."""
    if buffer.heap.freed:
        raise DitronConfigError(
            "the EP buffer this layer's forward used was freed before its backward (the functional forms "
            "rebuild their buffer when a call needs more tokens or other shapes, e.g. a later layer or "
            "micro-batch): give each layer its own (EPMoE, EPBuffer), or call every layer once with the largest "
            "T before training")


class _Dispatch(torch.autograd.Function):
    """Forward: dispatch. Backward: the gradients of a token's copies summed in k order (a combine);
    token-major: the gradients of a token's rows summed in rank order (the rank-reduced combine of
    token rows)."""

    @staticmethod
    def forward(ctx, x, buffer, topk_idx, w, sync, max_recv_rows, token_major):
        recv_x, handle = buffer._dispatch_raw(x, topk_idx, w, sync, max_recv_rows, token_major, under_autograd=True)
        ctx.buffer, ctx.handle = buffer, handle
        return recv_x, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_handle):
        if grad_recv_x is None:
            return None, None, None, None, None, None, None
        _alive_for_backward(ctx.buffer)
        token_rows = C.FLAG_MODE_RANK_REDUCED | C.FLAG_MODE_TOKEN_ROWS if ctx.handle.row_index is not None else 0
        grad_x = ctx.buffer._combine_raw(grad_recv_x, ctx.handle, None, token_rows, under_autograd=True)
        return grad_x, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """Forward: combine. Backward: grad_y = w * grad_out dispatched along the handle;
    grad_w[t, k] = <grad_out[t], y(t, k)> in fp32."""

    @staticmethod
    def forward(ctx, y, w, buffer, handle, mode):
        keep = w is not None and w.requires_grad
        out = buffer._combine_raw(y, handle, w, mode, under_autograd=True, land_own=keep)
        ctx.buffer, ctx.handle, ctx.mode = buffer, handle, mode
        # y(t, k) as landed, for the weights' gradient: saved (not a ctx attribute) so that the
        # engine frees it once this backward has run, not when the graph goes (rows * H elements
        # through the rest of the backward otherwise)
        ctx.save_for_backward(w, buffer._landed(handle.num_tokens) if keep else None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w, landed = ctx.saved_tensors
        buffer, handle = ctx.buffer, ctx.handle
        _alive_for_backward(buffer)
        grad_y = None
        if ctx.needs_input_grad[0] and ctx.mode & C.FLAG_MODE_TOKEN_ROWS:  # topk_sum="caller"
            grad_y = buffer._dispatch_replay(grad_out.contiguous(), handle, None, token_rows=True)
        elif ctx.needs_input_grad[0] and ctx.mode & C.FLAG_MODE_RANK_REDUCED:
            # the rows' weights live on the expert rank (handle.recv_weights): replay unscaled, then
            # scale each row there, in fp32, one rounding (what the replay's SCALE_ROWS computes)
            grad_y = buffer._dispatch_replay(grad_out.contiguous(), handle, None)
            if handle.recv_weights is not None:
                grad_y = (grad_y.to(torch.float32) * handle.recv_weights[:, None]).to(grad_y.dtype)
        elif ctx.needs_input_grad[0]:
            grad_y = buffer._dispatch_replay(grad_out.contiguous(), handle, w)
        grad_w = None
        if landed is not None and ctx.needs_input_grad[1]:
            grad_w = topk_dots(grad_out.contiguous(), landed, handle.send.topk_idx).to(w.dtype)
        return grad_y, grad_w, None, None, None
